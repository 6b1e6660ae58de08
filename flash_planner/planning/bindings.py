"""What executes a skill: a ROS 2 action or service named in the catalog, its goal filled
from the step's arguments, constants and a named-location table, and the limits every goal
is checked against before anything is sent. ROS-free: the message types themselves are
resolved where rclpy is (ros/), this checks everything a catalog can get wrong on its own.

A skill entry may carry

    action:  {type: nav2_msgs/action/NavigateToPose, server: /navigate_to_pose,
              timeout_s: 120, goal: {pose: "{location:target}", behavior_tree: ""}}
    service: {type: std_srvs/srv/Trigger, server: /dock, timeout_s: 10, request: {}}
    approve: true                       # an operator approves the step before it is sent
    limits:  {speed: {max: 0.5}}        # goal field (dotted path) -> min and/or max

A goal template's string "{ARG}" is the step's value of argument ARG (its own type);
"{location:ARG}" is the named location ARG's value names, as a geometry_msgs/PoseStamped
(frame, x, y and yaw from the catalog's `locations` table); anything else is a constant.
The catalog's `locations` is a YAML file (relative to the catalog) of
`NAME: {frame: map, x: 1.0, y: 2.0, yaw: 0.0}` entries, and its `workspace`
{frame, x: [lo, hi], y: [lo, hi]} bounds every pose a goal carries. A skill without a
binding stays plan-only.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

PLACEHOLDER = re.compile(r"^\{(?:(location):)?([A-Za-z_]\w*)\}$")
TYPE_PATTERN = re.compile(r"^[a-z_][a-z0-9_]*/(action|srv)/[A-Z][A-Za-z0-9]*$")
BINDING_FIELDS = {"action": ("type", "server", "timeout_s", "goal"),
                  "service": ("type", "server", "timeout_s", "request")}
DEFAULT_TIMEOUT_S = 60.0


class BindingError(ValueError):
    """A binding, location table or limit that cannot be used; one line naming the skill
    and the field."""


class GateError(ValueError):
    """A plan the safety gate refuses before anything is sent: names the step, the field
    and the limit."""

    def __init__(self, step: int, skill: str, message: str):
        super().__init__(f"step {step} ({skill}): {message}")
        self.step, self.skill = step, skill


@dataclass(frozen=True)
class Location:
    frame: str
    x: float
    y: float
    yaw: float = 0.0

    def pose_stamped(self) -> dict[str, Any]:
        """geometry_msgs/PoseStamped as nested fields (yaw about z as a quaternion)."""
        return {"header": {"frame_id": self.frame},
                "pose": {"position": {"x": self.x, "y": self.y, "z": 0.0},
                         "orientation": {"x": 0.0, "y": 0.0, "z": math.sin(self.yaw / 2),
                                         "w": math.cos(self.yaw / 2)}}}


@dataclass(frozen=True)
class Bound:
    """One numeric limit on a goal field: min and/or max."""

    field: str
    min: float | None = None
    max: float | None = None

    def violation(self, value: float) -> str | None:
        if self.min is not None and value < self.min:
            return f"{self.field} = {value} is below its limit {self.min}"
        if self.max is not None and value > self.max:
            return f"{self.field} = {value} is above its limit {self.max}"
        return None


@dataclass(frozen=True)
class Workspace:
    frame: str
    x: tuple[float, float]
    y: tuple[float, float]

    def violation(self, field: str, pose: dict[str, Any]) -> str | None:
        frame = pose.get("header", {}).get("frame_id")
        p = pose.get("pose", {}).get("position", {})
        x, y = p.get("x"), p.get("y")
        if frame != self.frame:
            return f"{field} is in frame {frame!r}, the workspace in {self.frame!r}"
        if not (self.x[0] <= x <= self.x[1] and self.y[0] <= y <= self.y[1]):
            return (f"{field} ({x}, {y}) is outside the workspace x {list(self.x)}, "
                    f"y {list(self.y)}")
        return None


@dataclass(frozen=True)
class Binding:
    """What executes one skill."""

    skill: str
    kind: str                            # "action" | "service"
    type: str                            # pkg/action/Name or pkg/srv/Name
    server: str
    template: dict[str, Any]             # the goal (action) or request (service)
    timeout_s: float = DEFAULT_TIMEOUT_S
    approve: bool = False
    limits: tuple[Bound, ...] = ()

    def placeholders(self) -> list[tuple[str, str | None, str]]:
        """(dotted field, "location" or None, argument) of each placeholder."""
        out = []
        for field, value in _leaves(self.template):
            m = PLACEHOLDER.match(value) if isinstance(value, str) else None
            if m:
                out.append((field, m.group(1), m.group(2)))
        return out


def _leaves(tree: Any, prefix: str = ""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _leaves(value, f"{prefix}.{key}" if prefix else str(key))
    else:
        yield prefix, tree


def read_locations(path: Path, where: str) -> dict[str, Location]:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise BindingError(f"{where}: location table {path} is not readable ({exc})") from exc
    except yaml.YAMLError as exc:
        raise BindingError(f"{where}: location table {path} is not valid YAML ({exc})") from exc
    if not isinstance(data, dict) or not data:
        raise BindingError(f"{where}: location table {path} must map names to "
                           "{frame, x, y, yaw}")
    out = {}
    for name, entry in data.items():
        at = f"{where}: location {name!r} in {path}"
        if not isinstance(entry, dict) or not isinstance(entry.get("frame"), str):
            raise BindingError(f"{at}: needs a 'frame' string and numbers x, y (yaw optional)")
        unknown = sorted(set(entry) - {"frame", "x", "y", "yaw"})
        if unknown:
            raise BindingError(f"{at}: unknown field(s) {unknown} (known: frame, x, y, yaw)")
        nums = {k: entry.get(k, 0.0 if k == "yaw" else None) for k in ("x", "y", "yaw")}
        bad = [k for k, v in nums.items()
               if isinstance(v, bool) or not isinstance(v, (int, float))]
        if bad:
            raise BindingError(f"{at}: {bad[0]} must be a number, got {entry.get(bad[0])!r}")
        out[str(name)] = Location(entry["frame"], float(nums["x"]), float(nums["y"]),
                                  float(nums["yaw"]))
    return out


def read_workspace(spec: Any, where: str) -> Workspace:
    if not isinstance(spec, dict) or set(spec) != {"frame", "x", "y"}:
        raise BindingError(f"{where}: 'workspace' must be {{frame, x: [lo, hi], y: [lo, hi]}}")
    ranges = {}
    for axis in ("x", "y"):
        r = spec[axis]
        if (not isinstance(r, list) or len(r) != 2 or any(
                isinstance(v, bool) or not isinstance(v, (int, float)) for v in r) or r[0] > r[1]):
            raise BindingError(f"{where}: workspace {axis} must be [lo, hi] numbers, lo <= hi; "
                               f"got {r!r}")
        ranges[axis] = (float(r[0]), float(r[1]))
    return Workspace(str(spec["frame"]), ranges["x"], ranges["y"])


def read_binding(skill: str, entry: dict[str, Any], args: dict[str, Any],
                 locations: dict[str, Location] | None, where: str) -> Binding | None:
    """The binding of one catalog entry (None: plan-only); `args` name -> Argument."""
    kinds = [k for k in ("action", "service") if k in entry]
    if not kinds:
        for key in ("approve", "limits"):
            if key in entry:
                raise BindingError(f"{where} ({skill}): '{key}' needs an action or a service")
        return None
    if len(kinds) == 2:
        raise BindingError(f"{where} ({skill}): a skill binds an action or a service, not both")
    kind = kinds[0]
    spec = entry[kind]
    at = f"{where} ({skill}) {kind}"
    if not isinstance(spec, dict):
        raise BindingError(f"{at}: expected a mapping")
    unknown = sorted(set(spec) - set(BINDING_FIELDS[kind]))
    if unknown:
        raise BindingError(f"{at}: unknown field(s) {unknown} (known: "
                           f"{', '.join(BINDING_FIELDS[kind])})")
    type_ = spec.get("type")
    want = "action" if kind == "action" else "srv"
    m = TYPE_PATTERN.match(type_) if isinstance(type_, str) else None
    if m is None or m.group(1) != want:
        raise BindingError(f"{at}: 'type' must read pkg/{want}/Name, got {type_!r}")
    server = spec.get("server")
    if not isinstance(server, str) or not re.match(r"^/?[A-Za-z_][\w/]*$", server):
        raise BindingError(f"{at}: 'server' must be a ROS name such as /navigate_to_pose, "
                           f"got {server!r}")
    timeout = spec.get("timeout_s", DEFAULT_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise BindingError(f"{at}: 'timeout_s' must be a positive number, got {timeout!r}")
    template = spec.get("goal" if kind == "action" else "request", {})
    if not isinstance(template, dict):
        raise BindingError(f"{at}: '{'goal' if kind == 'action' else 'request'}' must be a "
                           "mapping of the message's fields")
    approve = entry.get("approve", False)
    if not isinstance(approve, bool):
        raise BindingError(f"{where} ({skill}): 'approve' must be true or false")
    binding = Binding(skill, kind, type_, server, template, float(timeout), approve,
                      _limits(entry.get("limits", {}), f"{where} ({skill}) limits"))
    for field, location, arg in binding.placeholders():
        if arg not in args:
            raise BindingError(f"{at}: goal field {field} names argument {arg!r}, which "
                               f"{skill} does not declare (declared: {', '.join(args) or 'none'})")
        if location:
            if locations is None:
                raise BindingError(f"{at}: goal field {field} takes a location, and the catalog "
                                   "names no 'locations' table")
            if args[arg].type != "string":
                raise BindingError(f"{at}: goal field {field}: argument {arg!r} names a "
                                   f"location, so it must be a string, not {args[arg].type}")
            enum = dict(args[arg].constraints).get("enum", ())
            missing = [v for v in enum if v not in locations]
            if missing:
                raise BindingError(f"{at}: argument {arg!r} may name {missing[0]!r}, which the "
                                   "location table does not hold")
    return binding


def _limits(spec: Any, where: str) -> tuple[Bound, ...]:
    if not isinstance(spec, dict):
        raise BindingError(f"{where}: expected goal field -> {{min, max}}")
    out = []
    for field, bound in spec.items():
        if not isinstance(bound, dict) or not bound or set(bound) - {"min", "max"}:
            raise BindingError(f"{where}: {field} must be {{min: N, max: N}} (either or both)")
        values = dict(bound)
        if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in values.values()):
            raise BindingError(f"{where}: {field}'s min and max must be numbers")
        if "min" in values and "max" in values and values["min"] > values["max"]:
            raise BindingError(f"{where}: {field}'s min {values['min']} is above its max "
                               f"{values['max']}")
        out.append(Bound(str(field), values.get("min"), values.get("max")))
    return tuple(out)


def fill(binding: Binding, args: dict[str, Any], locations: dict[str, Location] | None
         ) -> dict[str, Any]:
    """The goal (or request) of a validated step: placeholders replaced by its values."""

    def value(v: Any, field: str) -> Any:
        if isinstance(v, dict):
            return {k: value(x, f"{field}.{k}" if field else k) for k, x in v.items()}
        m = PLACEHOLDER.match(v) if isinstance(v, str) else None
        if m is None:
            return v
        location, arg = m.group(1), m.group(2)
        if not location:
            return args[arg]
        name = args[arg]
        if name not in (locations or {}):
            raise LookupError(f"{field}: location {name!r} is not in the location table "
                              f"(known: {', '.join(sorted(locations or {})) or 'none'})")
        return locations[name].pose_stamped()

    return value(binding.template, "")


def field_value(goal: dict[str, Any], field: str) -> Any:
    node: Any = goal
    for part in field.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def gate(steps: list[dict[str, Any]], bindings: dict[str, Binding],
         locations: dict[str, Location] | None, workspace: Workspace | None
         ) -> list[dict[str, Any] | None]:
    """Every step's goal, filled and checked, before any is sent (None: a plan-only step);
    the first step outside a limit, the workspace or the location table raises GateError."""
    goals: list[dict[str, Any] | None] = []
    for i, step in enumerate(steps):
        binding = bindings.get(step["skill"])
        if binding is None:
            goals.append(None)
            continue
        try:
            goal = fill(binding, step.get("args", {}), locations)
        except LookupError as exc:
            raise GateError(i, step["skill"], str(exc)) from None
        for bound in binding.limits:
            v = field_value(goal, bound.field)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise GateError(i, step["skill"], f"limit on {bound.field}, which the goal "
                                f"does not hold as a number ({v!r})")
            why = bound.violation(v)
            if why:
                raise GateError(i, step["skill"], why)
        if workspace is not None:
            for field, pose in _poses(goal):
                why = workspace.violation(field, pose)
                if why:
                    raise GateError(i, step["skill"], why)
        goals.append(goal)
    return goals


def _poses(tree: Any, prefix: str = ""):
    """(field, PoseStamped-shaped dict) in a goal."""
    if isinstance(tree, dict):
        if "header" in tree and isinstance(tree.get("pose"), dict):
            yield prefix or "goal", tree
            return
        for key, value in tree.items():
            yield from _poses(value, f"{prefix}.{key}" if prefix else str(key))
