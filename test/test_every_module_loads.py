"""Every module of the package imports (the quick tier's floor: a module no other quick test
reaches still loads, its imports resolved after any move). Modules whose imports need what
this machine cannot have are named with the reason."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import flash_planner

# module -> what it imports at load that these machines cannot have (test/skip_policy.py)
NEEDS = {"flash_planner.engine.trt.tensorrt_backend": "tensorrt"}


def _modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(flash_planner.__path__, "flash_planner.")
                  if ".assets" not in m.name)


def test_the_package_has_its_rooms():
    names = _modules()
    for room in ("engine.loop", "engine.state", "engine.inputs", "engine.models.qwen",
                 "engine.models.flash_next", "engine.models.drafters", "engine.models.graphs",
                 "kernels.gemm"):
        assert f"flash_planner.{room}" in names, room


@pytest.mark.parametrize("module", _modules())
def test_module_imports(module):
    need = NEEDS.get(module)
    if need is not None and importlib.util.find_spec(need) is None:
        pytest.skip(f"{module} imports {need}: TensorRT and a CUDA GPU are not available")
    importlib.import_module(module)
