# flash_planner developer entry points. CPU-only machines are the default target:
# Triton kernels run under TRITON_INTERPRET=1 against their torch references.

PYTHON     ?= python3
VENV       ?= .venv
# Pinned and installed first: an unpinned torch requirement would pull GB of CUDA wheels.
TORCH_SPEC ?= torch==2.13.0
STAMP      := $(VENV)/.installed
LINT_PATHS := flash_planner test bench launch tools setup.py

DEMO_TASK  ?= bring the red cup from the kitchen table to the sink

.PHONY: all venv ros-env thor-deps thor-image test check test-gpu demo demo-model bench bench-peer bench-ros bench-batch bench-vision bench-startup bench-gpu kernels-report lint lint-fix clean distclean

all: test

venv: $(STAMP)

# A current setuptools builds wheels on its own (older ones need the separate `wheel`).
$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --upgrade 'setuptools>=70.1'

# pip byte-compiles every installed file on one core (half of a fresh venv's two minutes);
# compileall does it on every core. Ahead of time, because a machine may set
# PYTHONDONTWRITEBYTECODE, and then each process would compile what it imports again. Its
# status is not checked: like pip, it skips files for newer Pythons (one of torch's tests).
$(STAMP): setup.py setup.cfg | $(VENV)/bin/python
	$(VENV)/bin/pip install --no-compile '$(TORCH_SPEC)'
	$(VENV)/bin/pip install --no-compile -e '.[test]'
	$(VENV)/bin/python -m compileall -qq -j 0 \
		"$$($(VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
		|| true
	touch $@

# ROS 2 for the node's tests: Jazzy's PyPI wheels in the venv and our interfaces built with
# cmake (or a sourced ROS 2 and its colcon); cached, see tools/ros_env.sh.
ROS_ENV    := build/ros_env

ros-env: $(STAMP)
	tools/ros_env.sh $(VENV) $(ROS_ENV)

# The Thor image's Python dependencies resolve for Python 3.12 manylinux aarch64 from wheels
# (a pip dry run: nothing is installed; see tools/thor_deps.py). `make test` runs the same
# check as a test (test/test_thor_deps.py), beside the others rather than before them.
thor-deps: $(STAMP)
	$(VENV)/bin/python tools/thor_deps.py

# The Thor image (docker/thor/Dockerfile): build it on the Thor, or where docker can build
# linux/arm64 images (THOR_BASE picks the NGC PyTorch release; docs/thor.md).
THOR_IMAGE ?= flash-planner:thor
THOR_BASE  ?= nvcr.io/nvidia/pytorch:25.10-py3
thor-image:
	@command -v docker >/dev/null || { echo "thor-image: docker is not installed"; exit 1; }
	docker build --platform linux/arm64 --build-arg BASE_IMAGE=$(THOR_BASE) \
		-f docker/thor/Dockerfile -t $(THOR_IMAGE) .

# One pytest-xdist worker per core (TEST_WORKERS=0: no workers); a test file stays on one
# worker, so its module fixtures (engines, compiled graphs, a server) are built once. The
# slowest tests are printed: docs/development.md says what each proves.
TEST_WORKERS ?= auto
test: ros-env
	. $(ROS_ENV)/env.sh && TRITON_INTERPRET=1 $(VENV)/bin/python -m pytest -q -rs \
		-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=20 \
		--junitxml=build/test-report.xml test

# Plan a sample task with the embedded demo model (shipped in flash_planner/assets/demo).
demo: $(STAMP)
	$(VENV)/bin/flash-planner plan "$(DEMO_TASK)"

# Retrain the demo model from scratch (fixed seeds; about an hour on 2 CPU cores).
demo-model: $(STAMP)
	$(VENV)/bin/python -m flash_planner.train.build_demo

# The benchmarks (timings are printed, never asserted); the charts go to docs/img.
bench: $(STAMP)
	$(VENV)/bin/pip install -q matplotlib
	$(VENV)/bin/python bench/decode.py --threads 1
	$(VENV)/bin/python bench/spec.py
	$(VENV)/bin/python bench/plan.py --png-dir docs/img
	$(VENV)/bin/python bench/plan.py --constrained
	$(VENV)/bin/python bench/grounding.py --grammar off,request
	$(VENV)/bin/python bench/grammar.py
	$(VENV)/bin/python bench/tool_calls.py
	$(VENV)/bin/python bench/latency.py --png-dir docs/img
	$(VENV)/bin/python bench/weight_bytes.py --png-dir docs/img
	$(VENV)/bin/python bench/moe_lengths.py
	$(VENV)/bin/python bench/overhead.py --cold-and-warm

# The GPU figures in one command (bench/gpu.py): run on a CUDA machine; its Python needs
# torch, triton and transformers, and this tree (no install). The JSON goes to bench/out/.
# The quick tier before a commit (test/quick_tier.py: every module loads, the import rules,
# docs and lint, one fast file per room; no compile proofs, no llama.cpp build): a few
# minutes warm. `make test` stays the whole suite.
check: ros-env
	$(VENV)/bin/python -m ruff check $(LINT_PATHS)
	. $(ROS_ENV)/env.sh && TRITON_INTERPRET=1 $(VENV)/bin/python -m pytest -q -rs -m quick \
		-n $(TEST_WORKERS) --dist loadfile test

# The tests that need a CUDA GPU (marked `cuda`: skipped without one), and the kernels
# compiled for it, with the GPU machine's own Python (torch, triton, transformers, plus the
# wheels docs/thor.md lists for bench-gpu, and pytest).
test-gpu:
	@$(PYTHON) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else \
		'test-gpu: no CUDA GPU here (torch.cuda.is_available() is False)')"
	PYTHONPATH=. $(PYTHON) -m pytest -q -rs -p no:cacheprovider test/kernels
	PYTHONPATH=. $(PYTHON) -m pytest -q -rs -p no:cacheprovider -m cuda test

bench-gpu:
	mkdir -p bench/out && PYTHONPATH=. $(PYTHON) bench/gpu.py --json-out bench/out/gpu.json

# Ours against llama.cpp, side by side: llama.cpp is built once from the pinned
# llama-cpp-python source distribution (needs cmake and g++; cached, see bench/peer.py).
bench-peer: $(STAMP)
	$(VENV)/bin/python bench/peer.py --png-dir docs/img

# The ROS layer's cost: the same tasks through the planner service and the Plan action,
# then what ~/execute adds per step of a plan (bench/ros_execute.py, run by ros_overhead.py).
bench-ros: ros-env
	. $(ROS_ENV)/env.sh && $(VENV)/bin/python bench/ros_overhead.py

# Batched requests through the planner service against one at a time: 1, 2, 4 and 8
# closed-loop clients on the same held-out tasks, per method (several minutes on 2 cores);
# then through `flash-planner serve`: one client alone, 8 closed-loop clients, bursts of 8.
# BATCH_ARGS=--compile: compiled forwards, with an eager batched service beside them.
BATCH_ARGS ?=
bench-batch: $(STAMP)
	$(VENV)/bin/python bench/batch.py $(BATCH_ARGS)
	$(VENV)/bin/python bench/serve_load.py --scaling

bench-vision: $(STAMP)
	$(VENV)/bin/python bench/vision.py

# Start-up of the compiled engines, cold and warm cache, each start a new process (~15 min).
bench-startup: ros-env
	. $(ROS_ENV)/env.sh && $(VENV)/bin/python bench/startup.py

# Every declared Triton kernel specialization compiled for sm_90 and sm_110 (no GPU needed):
# registers, spills, shared memory, cubin size, tensor-core instructions.
kernels-report: $(STAMP)
	env -u TRITON_INTERPRET $(VENV)/bin/python -m flash_planner.kernels.report

lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINT_PATHS)

lint-fix: $(STAMP)
	$(VENV)/bin/ruff check --fix $(LINT_PATHS)

clean:
	rm -rf build install log dist .pytest_cache .ruff_cache *.egg-info
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
