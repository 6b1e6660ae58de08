"""The import directions of docs/architecture.md hold: no layer imports what its row of the
table says it never imports (lazy imports inside functions included)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "flash_planner"

# layer (a path under flash_planner/) -> module prefixes it never imports
NEVER = {
    "kernels": ("flash_planner.engine", "flash_planner.planning", "flash_planner.ros",
                "flash_planner.cli", "flash_planner.server", "flash_planner.train"),
    "engine/models": ("flash_planner.engine.loop", "flash_planner.engine.inputs",
                      "flash_planner.engine.engine", "flash_planner.planning",
                      "flash_planner.ros"),
    # the inference state: buffers and their commit, below the loop and the models
    "engine/state": ("flash_planner.engine.loop", "flash_planner.engine.inputs",
                     "flash_planner.engine.models", "flash_planner.engine.engine",
                     "flash_planner.planning"),
    # the speculative loop's parts never reach up to the inputs or the run
    "engine/loop": ("flash_planner.engine.inputs", "flash_planner.engine.engine",
                    "flash_planner.engine.batch", "flash_planner.engine.decoding",
                    "flash_planner.engine.generate", "flash_planner.planning"),
    "engine/inputs": ("flash_planner.engine.engine", "flash_planner.engine.batch",
                      "flash_planner.engine.decoding",
                      "flash_planner.engine.generate", "flash_planner.planning"),
    "engine": ("flash_planner.planning", "flash_planner.ros", "flash_planner.cli"),
    "planning": ("flash_planner.ros",),
    # what can reach a motor reads the catalog and the goal, no model and no queue
    "planning/gate.py": ("flash_planner.engine", "flash_planner.ros",
                         "flash_planner.planning.service", "flash_planner.planning.execution"),
    "planning/finite.py": ("flash_planner.",),
    # a request's checks come before any queue: the service calls them, never the reverse
    "planning/request.py": ("flash_planner.ros", "flash_planner.planning.service",
                            "flash_planner.planning.ticket"),
    # writing a tree needs the standard library only (lxml is the `bt` extra, for reading
    # one back): the node and the server export trees without it
    "planning/bt_write.py": ("lxml", "flash_planner.planning.bt"),
    "ros": ("flash_planner.engine",),
    "cli.py": ("flash_planner.ros",),
    "server": ("flash_planner.ros", "flash_planner.cli"),
    "train": ("flash_planner.ros",),
}


def _package_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1])


def imports_of(text: str, package: str) -> set[str]:
    """Every module `text` (a module of `package`) imports, relative imports resolved."""
    found = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = parts[:len(parts) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def _files(layer: str) -> list[Path]:
    root = PACKAGE / layer
    return [root] if root.suffix == ".py" else sorted(root.rglob("*.py"))


@pytest.mark.parametrize("layer", sorted(NEVER))
def test_no_layer_imports_what_it_never_imports(layer: str):
    broken = [f"{path.relative_to(PACKAGE.parent)} imports {module}"
              for path in _files(layer)
              for module in sorted(imports_of(path.read_text(), _package_of(path)))
              if module.startswith(NEVER[layer])]
    assert not broken, "\n".join(broken)


def test_relative_imports_are_resolved_so_none_slips_past_the_table():
    found = imports_of("def f():\n    from ....planning import request\nfrom . import direct\n",
                       "flash_planner.engine.models.graphs")
    assert {"flash_planner.planning.request", "flash_planner.engine.models.graphs.direct"} <= found
    assert any(m.startswith(NEVER["engine/models"]) for m in found)
