"""The safety gate: every check between a validated plan and the first goal sent, in one
place a reader can audit. ROS-free; `Execution` calls `check_plan` once per plan, and
`flash-planner plan --goals` calls `gate` to show what would be sent.

A plan passes only if every step does, before any goal exists to send:
- its skill has a binding (a plan-only skill cannot be executed) and, on the robot, the
  binding's server is on the graph (a dry run reports the away ones instead of refusing);
- its goal fills: an argument a goal field takes as a place names a place of the location
  table;
- every number in the goal is finite (no NaN, no infinity) and, where the message types are
  known, fits its field's type (a float32, an int8, ...);
- every limit's field holds a number inside [min, max];
- every pose the goal carries lies inside the workspace: found by the message's own types
  (geometry_msgs Pose, PoseStamped, Point, PointStamped, Pose2D, and arrays of them, at any
  depth) where they are known, else by shape; a pose's frame is the nearest enclosing
  header's (one without a header is taken as the workspace's frame), and a coordinate the
  goal leaves out is the message's default, 0.

A plan with structures (retry, fallback: plan_tree.py) passes only if every one of its
steps does, in written order, whichever of them will run. The first step that fails raises
GateError naming the step (its index among the plan's steps, from 0, and in a tree its
node's path), the field and the limit.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from . import plan_tree
from .bindings import Binding, Location, Workspace, fill, leaves
from .finite import finite_number

# The position of a pose type: the key holding its (x, y), "" when the message is the point
POSE_TYPES = {"geometry_msgs/PoseStamped": "pose.position",
              "geometry_msgs/Pose": "position",
              "geometry_msgs/PointStamped": "point",
              "geometry_msgs/Point": "",
              "geometry_msgs/Point32": "",
              "geometry_msgs/Pose2D": ""}
# What a number field of each ROS type can hold (a value outside is refused, not wrapped)
FLOAT32_MAX = 3.4028234663852886e38
RANGES = {"float": (-FLOAT32_MAX, FLOAT32_MAX),
          **{f"int{b}": (-(1 << (b - 1)), (1 << (b - 1)) - 1) for b in (8, 16, 32, 64)},
          **{f"uint{b}": (0, (1 << b) - 1) for b in (8, 16, 32, 64)},
          "byte": (0, 255), "octet": (0, 255), "char": (0, 255)}
_ELEMENT = re.compile(r"^(?:sequence<)?([\w/]+)(?:\[\d*\]|, ?\d+>|>)?$")


class GateError(ValueError):
    """A plan the safety gate refuses before anything is sent: names the step, the field
    and the limit."""

    def __init__(self, step: int, skill: str, message: str, path: tuple[int, ...] = ()):
        super().__init__(f"step {step}{plan_tree.at_node(path)} ({skill}): {message}")
        self.step, self.skill, self.path = step, skill, path


def check_plan(plan: list[dict[str, Any]], bindings: dict[str, Binding],
               locations: dict[str, Location] | None, workspace: Workspace | None,
               available: Callable[[Binding], bool], dry_run: bool = False
               ) -> tuple[list[dict[str, Any]], dict[int, str]]:
    """(every step's goal, step index -> why its server cannot be reached now) of a plan to
    run on the robot; GateError for the first step that is unbound, whose server is away
    (unless `dry_run`, which reports it), or whose goal `gate` refuses."""
    away = {}
    steps = plan_tree.leaves(plan_tree.tree_of(plan))
    for leaf in steps:
        step = leaf.step
        binding = bindings.get(step["skill"])
        if binding is None:
            raise GateError(leaf.index, step["skill"], "the skill has no binding in the "
                            "catalog (a plan-only skill cannot be executed)", leaf.path)
        if not available(binding):
            why = f"its {binding.kind} server {binding.server} is not on the graph"
            if not dry_run:
                raise GateError(leaf.index, step["skill"], why, leaf.path)
            away[leaf.index] = why
    return _goals(steps, bindings, locations, workspace), away


def gate(plan: list[dict[str, Any]], bindings: dict[str, Binding],
         locations: dict[str, Location] | None, workspace: Workspace | None
         ) -> list[dict[str, Any] | None]:
    """Every step's goal, filled and checked, before any is sent (None: a plan-only step),
    by the step's index among the plan's steps; the first step outside the location table,
    a number's range, a limit or the workspace raises GateError."""
    return _goals(plan_tree.leaves(plan_tree.tree_of(plan)), bindings, locations, workspace)


def _goals(steps: list[plan_tree.Leaf], bindings: dict[str, Binding],
           locations: dict[str, Location] | None, workspace: Workspace | None
           ) -> list[dict[str, Any] | None]:
    goals: list[dict[str, Any] | None] = []
    for leaf in steps:
        step = leaf.step
        binding = bindings.get(step["skill"])
        if binding is None:
            goals.append(None)
            continue
        try:
            goal = fill(binding, step.get("args", {}), locations)
        except LookupError as exc:
            raise GateError(leaf.index, step["skill"], str(exc), leaf.path) from None
        why = check_goal(binding, goal, workspace)
        if why:
            raise GateError(leaf.index, step["skill"], why, leaf.path)
        goals.append(goal)
    return goals


def check_goal(binding: Binding, goal: dict[str, Any], workspace: Workspace | None
               ) -> str | None:
    """Why a filled goal may not be sent (numbers, limits, workspace), or None."""
    types = binding.types
    for field, value in leaves(goal):
        why = _number_problem(field or "goal", value, types.get(_typed(field)))
        if why:
            return why
    for bound in binding.limits:
        value = _field(goal, bound.field)
        if not finite_number(value):
            return f"limit on {bound.field}, which the goal does not hold as a number ({value!r})"
        if bound.min is not None and value < bound.min:
            return f"{bound.field} = {value} is below its limit {bound.min}"
        if bound.max is not None and value > bound.max:
            return f"{bound.field} = {value} is above its limit {bound.max}"
    if workspace is not None:
        for field, frame, point in poses(goal, types):
            why = _outside(workspace, field, frame, point)
            if why:
                return why
    return None


def _number_problem(field: str, value: Any, ros_type: str | None) -> str | None:
    element = _element(ros_type) or ""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        if element in RANGES or element == "double":
            return f"{field} = {value!r} is not a number (its type is {ros_type})"
        return None
    if not finite_number(value):
        return f"{field} = {value!r} is not a finite number"
    lo, hi = RANGES.get(element, (None, None))
    if lo is not None and not lo <= value <= hi:
        return f"{field} = {value} does not fit its type {ros_type} ([{lo}, {hi}])"
    return None


def _outside(workspace: Workspace, field: str, frame: str | None, point: dict[str, Any]
             ) -> str | None:
    if frame is not None and frame != workspace.frame:
        return f"{field} is in frame {frame!r}, the workspace in {workspace.frame!r}"
    x, y = point.get("x", 0.0), point.get("y", 0.0)
    if not (finite_number(x) and finite_number(y)):
        return f"{field} has no finite position ({x!r}, {y!r})"
    if not (workspace.x[0] <= x <= workspace.x[1] and workspace.y[0] <= y <= workspace.y[1]):
        return (f"{field} ({x}, {y}) is outside the workspace x {list(workspace.x)}, "
                f"y {list(workspace.y)}")
    return None


def poses(goal: dict[str, Any], types: dict[str, str]):
    """(field, frame or None, the {x, y, ...} of its position) of every pose in a goal: by
    the field's ROS type where `types` names it, else by the value's shape."""
    yield from _poses(goal, "", "", types, None)


def _poses(value: Any, field: str, typed: str, types: dict[str, str], frame: str | None):
    if isinstance(value, list):
        for i, item in enumerate(value):
            yield from _poses(item, f"{field}[{i}]", typed, types, frame)
        return
    if not isinstance(value, dict):
        return
    header = value.get("header")
    if isinstance(header, dict) and "frame_id" in header:
        frame = str(header["frame_id"])
    kind = _element(types[typed]) if typed in types else _shape(value)
    if kind in POSE_TYPES:
        point: Any = value
        for key in filter(None, POSE_TYPES[kind].split(".")):
            point = point.get(key, {}) if isinstance(point, dict) else {}
        yield field or "goal", frame, point if isinstance(point, dict) else {}
        return
    for key, item in value.items():
        yield from _poses(item, f"{field}.{key}" if field else str(key),
                          f"{typed}.{key}" if typed else str(key), types, frame)


def _shape(value: dict[str, Any]) -> str | None:
    """The pose type a dict looks like, where its types are not known."""
    if isinstance(value.get("pose"), dict) and "header" in value:
        return "geometry_msgs/PoseStamped"
    if isinstance(value.get("position"), dict):
        return "geometry_msgs/Pose"
    if isinstance(value.get("point"), dict) and "header" in value:
        return "geometry_msgs/PointStamped"
    keys = set(value)
    if keys & {"x", "y"} and keys <= {"x", "y", "z", "theta"}:
        return "geometry_msgs/Point"
    return None


def _element(ros_type: str | None) -> str | None:
    """The element type of a ROS field type: 'geometry_msgs/Pose' of
    'sequence<geometry_msgs/Pose>', 'geometry_msgs/Pose[4]' or 'sequence<..., 8>'."""
    if ros_type is None:
        return None
    m = _ELEMENT.match(ros_type)
    return m.group(1) if m else ros_type


def _typed(field: str) -> str:
    """A goal field's path less its list indices (how field types are keyed)."""
    return re.sub(r"\[\d+\]", "", field)


def _field(goal: dict[str, Any], field: str) -> Any:
    node: Any = goal
    for part in field.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node
