"""launch/planner.launch.py, read as Python source (launch itself is not needed)."""

from __future__ import annotations

import ast
from pathlib import Path

from flash_planner.ros.params import BY_NAME

LAUNCH = Path(__file__).resolve().parents[2] / "launch" / "planner.launch.py"
ARGUMENTS = ["params_file", "model", "namespace", "log_level", "autostart", "skills_file",
             "execute_tasks", "mcp", "mcp_port", "mcp_execute"]


def _tree() -> ast.Module:
    return ast.parse(LAUNCH.read_text(), filename=str(LAUNCH))


def _calls(tree: ast.AST, name: str) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)
            and getattr(n.func, "id", getattr(n.func, "attr", None)) == name]


def test_declares_exactly_the_documented_arguments():
    declared = [c.args[0].value for c in _calls(_tree(), "DeclareLaunchArgument")]
    assert declared == ARGUMENTS
    doc = ast.get_docstring(_tree())
    assert all(arg in doc for arg in ARGUMENTS)


def test_every_argument_is_used():
    # arg(name) -> LaunchConfiguration; flag(name): arg(name) read as a boolean
    used = {c.args[0].value for kind in ("arg", "flag") for c in _calls(_tree(), kind)
            if isinstance(c.args[0], ast.Constant)}
    assert set(ARGUMENTS) <= used


def test_parameter_overrides_are_declared_parameters():
    """Keys the launch file sets on the node (autostart, model.preset) exist in the table."""
    tree = _tree()
    keys = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            keys |= {k.value for k in node.keys if isinstance(k, ast.Constant)}
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):
            keys.add(node.slice.value)
    assert {"autostart", "model.preset", "planner.skills_file",
            "execution.from_task_topic"} <= keys
    assert keys <= set(BY_NAME), keys - set(BY_NAME)
    assert isinstance(BY_NAME["autostart"].default, bool)


def test_starts_planner_node_with_the_params_file():
    (node,) = _calls(_tree(), "Node")
    kw = {k.arg: k.value for k in node.keywords}
    assert kw["package"].value == "flash_planner"
    assert kw["executable"].value == "planner_node" and kw["name"].value == "flash_planner"
    params = kw["parameters"]
    assert isinstance(params, ast.List) and len(params.elts) == 2
    assert ast.unparse(params.elts[0]) == "arg('params_file')"
