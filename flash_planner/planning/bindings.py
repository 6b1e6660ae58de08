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
binding stays plan-only. Every number a catalog gives (limits, workspace, timeouts, places)
must be finite: YAML's `.nan` and `.inf` are load errors, because a NaN bound lets every value
pass and a NaN timeout never fires. What is checked before a goal is sent is gate.py's.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml

from .finite import finite_number

PLACEHOLDER = re.compile(r"^\{(?:(location):)?([A-Za-z_]\w*)\}$")
TYPE_PATTERN = re.compile(r"^[a-z_][a-z0-9_]*/(action|srv)/[A-Z][A-Za-z0-9]*$")
BINDING_FIELDS = {"action": ("type", "server", "timeout_s", "goal"),
                  "service": ("type", "server", "timeout_s", "request")}
DEFAULT_TIMEOUT_S = 60.0


class BindingError(ValueError):
    """A binding, location table or limit that cannot be used; one line naming the skill
    and the field."""


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
    """One numeric limit on a goal field: min and/or max (finite)."""

    field: str
    min: float | None = None
    max: float | None = None


@dataclass(frozen=True)
class Workspace:
    """The box every pose a goal carries must lie in (finite bounds, lo <= hi)."""

    frame: str
    x: tuple[float, float]
    y: tuple[float, float]


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
    # (dotted field, ROS type) of every field the message has, nested ones included
    # ("pose" -> "geometry_msgs/PoseStamped"), set where the types are known (the node, at
    # configure: ros/binding_types.field_types); empty: the gate finds poses by shape
    field_types: tuple[tuple[str, str], ...] = ()

    @cached_property
    def types(self) -> dict[str, str]:
        """`field_types` as a mapping (read for every goal the gate checks)."""
        return dict(self.field_types)

    @cached_property
    def place_args(self) -> tuple[str, ...]:
        """The arguments a goal field takes as a place of the location table (read by every
        request's prompt and grammar)."""
        return tuple(dict.fromkeys(a for _, location, a in self.placeholders() if location))

    def placeholders(self) -> list[tuple[str, str | None, str]]:
        """(dotted field, "location" or None, argument) of each placeholder."""
        out = []
        for field, value in leaves(self.template):
            m = PLACEHOLDER.match(value) if isinstance(value, str) else None
            if m:
                out.append((field, m.group(1), m.group(2)))
        return out


def leaves(tree: Any, prefix: str = ""):
    """(dotted field, value) of every value in nested dicts and lists ("path[2].pose.x")."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from leaves(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            yield from leaves(value, f"{prefix}[{i}]")
    else:
        yield prefix, tree


def unknown_place(binding: Binding, args: dict[str, Any], locations: dict[str, Location]
                  ) -> tuple[str, str] | None:
    """(argument, value) of the first value a place argument's enum allows that the
    location table lacks (`args`: name -> Argument), or None."""
    for arg in binding.place_args:
        missing = [v for v in dict(args[arg].constraints).get("enum", ()) if v not in locations]
        if missing:
            return arg, missing[0]
    return None


def read_locations(path: Path, where: str) -> dict[str, Location]:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise BindingError(f"{where}: location table {path} is not readable ({exc})") from exc
    except yaml.YAMLError as exc:
        raise BindingError(f"{where}: location table {path} is not valid YAML ({exc})") from exc
    return locations_of(data, where, str(path))


def locations_from_text(text: str, source: str) -> dict[str, Location]:
    """A location table sent as text (YAML, which JSON is too), as a file would hold it."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise BindingError(f"location table from {source} is not valid YAML or JSON "
                           f"({' '.join(str(exc).split())})") from None
    return locations_of(data, "location table", source)


def locations_of(data: Any, where: str, source: str) -> dict[str, Location]:
    """A location table from its parsed form (`source`: the file, or the topic it came on
    at run time)."""
    if not isinstance(data, dict) or not data:
        raise BindingError(f"{where}: location table {source} must map names to "
                           "{frame, x, y, yaw}")
    out = {}
    for name, entry in data.items():
        at = f"{where}: location {name!r} in {source}"
        if not isinstance(entry, dict) or not isinstance(entry.get("frame"), str):
            raise BindingError(f"{at}: needs a 'frame' string and numbers x, y (yaw optional)")
        unknown = sorted(set(entry) - {"frame", "x", "y", "yaw"})
        if unknown:
            raise BindingError(f"{at}: unknown field(s) {unknown} (known: frame, x, y, yaw)")
        nums = {k: entry.get(k, 0.0 if k == "yaw" else None) for k in ("x", "y", "yaw")}
        bad = [k for k, v in nums.items() if not finite_number(v)]
        if bad:
            raise BindingError(f"{at}: {bad[0]} must be a number (finite: not .nan or .inf), "
                               f"got {entry.get(bad[0])!r}")
        out[str(name)] = Location(entry["frame"], float(nums["x"]), float(nums["y"]),
                                  float(nums["yaw"]))
    return out


def read_workspace(spec: Any, where: str) -> Workspace:
    if not isinstance(spec, dict) or set(spec) != {"frame", "x", "y"}:
        raise BindingError(f"{where}: 'workspace' must be {{frame, x: [lo, hi], y: [lo, hi]}}")
    ranges = {}
    for axis in ("x", "y"):
        r = spec[axis]
        if (not isinstance(r, list) or len(r) != 2 or not all(finite_number(v) for v in r)
                or r[0] > r[1]):
            raise BindingError(f"{where}: workspace {axis} must be [lo, hi] finite numbers, "
                               f"lo <= hi; got {r!r}")
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
    if not finite_number(timeout) or timeout <= 0:
        raise BindingError(f"{at}: 'timeout_s' must be a positive finite number, got "
                           f"{timeout!r}")
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
    unknown = None if locations is None else unknown_place(binding, args, locations)
    if unknown:
        raise BindingError(f"{at}: argument {unknown[0]!r} may name {unknown[1]!r}, which the "
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
        if not all(finite_number(v) for v in values.values()):
            raise BindingError(f"{where}: {field}'s min and max must be finite numbers, got "
                               f"{values!r}")
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
        if isinstance(v, list):     # as `leaves` walks them, so every placeholder is filled
            return [value(x, f"{field}[{i}]") for i, x in enumerate(v)]
        m = PLACEHOLDER.match(v) if isinstance(v, str) else None
        if m is None:
            return v
        location, arg = m.group(1), m.group(2)
        if arg not in args:    # an optional argument without a default, left out
            raise LookupError(f"{field}: argument {arg!r} is not given, and the goal needs it")
        name = args[arg]
        if not location:
            return name
        if not isinstance(name, str) or name not in (locations or {}):
            raise LookupError(f"{field}: location {name!r} is not in the location table "
                              f"(known: {', '.join(sorted(locations or {})) or 'none'})")
        return locations[name].pose_stamped()

    return value(binding.template, "")
