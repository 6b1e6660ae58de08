# flash_planner developer entry points. CPU-only machines are the default target:
# Triton kernels run under TRITON_INTERPRET=1 against their torch references.

PYTHON     ?= python3
VENV       ?= .venv
# Pinned and installed first: an unpinned torch requirement would pull GB of CUDA wheels.
TORCH_SPEC ?= torch==2.13.0
STAMP      := $(VENV)/.installed
LINT_PATHS := flash_planner kernels test bench launch setup.py

.PHONY: all venv test demo lint lint-fix clean distclean

all: test

venv: $(STAMP)

# A current setuptools builds wheels on its own (older ones need the separate `wheel`).
$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --upgrade 'setuptools>=70.1'

$(STAMP): setup.py setup.cfg | $(VENV)/bin/python
	$(VENV)/bin/pip install '$(TORCH_SPEC)'
	$(VENV)/bin/pip install -e '.[test]'
	touch $@

test: $(STAMP)
	TRITON_INTERPRET=1 $(VENV)/bin/python -m pytest -q test

demo: $(STAMP)
	$(VENV)/bin/flash-planner smoke

lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINT_PATHS)

lint-fix: $(STAMP)
	$(VENV)/bin/ruff check --fix $(LINT_PATHS)

clean:
	rm -rf build install log dist .pytest_cache .ruff_cache *.egg-info
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
