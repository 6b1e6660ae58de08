"""Properties of the safety gate (planning/gate.py) over generated catalogs and plans: every
goal the gate lets through is finite, within every limit and the workspace, and names a place
of the table; every catalog that loads holds only finite numbers; nothing but GateError or
CatalogError comes out of either, whatever the input.

`make test` runs a few thousand examples, the same ones every run (derandomized, so a CI run
is reproducible); `FLASH_PLANNER_GATE_EXAMPLES=20` runs twenty times as many, freshly drawn
each run (docs/development.md, "The gate's properties"). Failures found so far are kept as
examples in test_gate.py.
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flash_planner.planning.bindings import Binding, Workspace
from flash_planner.planning.finite import finite_number
from flash_planner.planning.gate import POSE_TYPES, GateError, gate
from flash_planner.planning.parse import PlanError, validate_plan
from flash_planner.planning.skills import CatalogError, SkillCatalog

SCALE = int(os.environ.get("FLASH_PLANNER_GATE_EXAMPLES", "1"))


def profile(examples: int):
    return settings(max_examples=examples * SCALE, deadline=None, database=None,
                    derandomize=SCALE == 1, suppress_health_check=[HealthCheck.too_slow])


# What a fuzzer writes where a number goes: NaN, infinities, huge and tiny values, negative
# zero, ints past float's range, strings of digits, booleans.
NUMBERS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 0.0, 1e308, -1e308, 5e-324]),
    st.integers(min_value=-(1 << 70), max_value=1 << 70),
    st.text("0123456789.-e", max_size=6), st.booleans())
SMALL = st.floats(min_value=-20, max_value=20, allow_nan=False)
NAMES = st.sampled_from(["kitchen", "sink", "dock", "hall", "garage"])

_DIR = Path(tempfile.mkdtemp(prefix="gate_properties_"))


@st.composite
def catalogs(draw):
    """A catalog's YAML: one bound skill whose goal takes a number (limited), a place and a
    constant; its limit, workspace, timeout and places drawn, non-finite ones among them."""
    bound = draw(st.dictionaries(st.sampled_from(["min", "max"]),
                                 st.one_of(SMALL, NUMBERS), min_size=1))
    workspace = {"frame": "map", "x": sorted(draw(st.lists(st.one_of(SMALL, NUMBERS),
                                                           min_size=2, max_size=2)), key=str),
                 "y": draw(st.lists(st.one_of(SMALL, NUMBERS), min_size=2, max_size=2))}
    if draw(st.booleans()):      # a usable box most of the time
        lo, hi = sorted(draw(st.lists(SMALL, min_size=4, max_size=4)))[::3]
        workspace = {"frame": "map", "x": [lo, hi], "y": [lo, hi]}
    places = draw(st.dictionaries(NAMES, st.fixed_dictionaries(
        {"frame": st.sampled_from(["map", "odom"]), "x": st.one_of(SMALL, NUMBERS),
         "y": st.one_of(SMALL, NUMBERS)}, optional={"yaw": st.one_of(SMALL, NUMBERS)}),
        min_size=1, max_size=4))
    return {"skills": [{
        "name": "act", "description": "act",
        "args": {"n": {"type": "number"}, "place": {"type": "string"}},
        "limits": {"v": bound},
        "action": {"type": "pkg/action/Act", "server": "/act",
                   "timeout_s": draw(st.one_of(st.floats(0.1, 100), NUMBERS)),
                   "goal": {"v": "{n}", "pose": "{location:place}",
                            "c": draw(st.one_of(SMALL, NUMBERS))}}}],
        "workspace": workspace}, places


def load(data, places) -> SkillCatalog:
    (_DIR / "places.yaml").write_text(yaml.safe_dump(places))
    return SkillCatalog.from_dict({**data, "locations": "places.yaml"}, base=_DIR)


def numbers_of(tree):
    if isinstance(tree, dict):
        for value in tree.values():
            yield from numbers_of(value)
    elif isinstance(tree, list):
        for value in tree:
            yield from numbers_of(value)
    elif isinstance(tree, (int, float)) and not isinstance(tree, bool):
        yield tree


@given(catalogs())
@profile(600)
def test_a_catalog_that_loads_holds_only_finite_numbers(drawn):
    try:
        c = load(*drawn)
    except CatalogError:
        return
    b = c.bindings["act"]
    numbers = [b.timeout_s, *(v for bound in b.limits for v in (bound.min, bound.max)
                              if v is not None), *c.workspace.x, *c.workspace.y,
               *(v for p in c.locations.values() for v in (p.x, p.y, p.yaw))]
    assert all(finite_number(v) for v in numbers), numbers


@given(catalogs(), st.lists(st.fixed_dictionaries(
    {"skill": st.just("act"), "args": st.fixed_dictionaries(
        {"n": st.one_of(SMALL, NUMBERS),
         "place": st.one_of(NAMES, st.text(max_size=8), NUMBERS)})}),
    min_size=1, max_size=4))
@profile(600)
def test_every_goal_the_gate_lets_through_is_finite_limited_inside_and_a_place(drawn, steps):
    try:
        c = load(*drawn)
    except CatalogError:
        return
    b, box = c.bindings["act"], c.workspace
    for plan in (steps, *([s] for s in steps)):    # the whole plan, then each step alone
        try:
            goals = gate(plan, c.bindings, c.locations, box)
        except GateError:
            continue
        for step, goal in zip(plan, goals):
            assert all(finite_number(v) for v in numbers_of(goal)), goal
            for bound in b.limits:
                v = goal[bound.field]
                assert finite_number(v), goal
                assert bound.min is None or v >= bound.min
                assert bound.max is None or v <= bound.max
            assert step["args"]["place"] in c.locations
            pose = goal["pose"]
            assert pose["header"]["frame_id"] == box.frame
            p = pose["pose"]["position"]
            assert box.x[0] <= p["x"] <= box.x[1] and box.y[0] <= p["y"] <= box.y[1]


@given(catalogs(), st.lists(st.fixed_dictionaries(
    {"skill": st.sampled_from(["act", "fly"]), "args": st.dictionaries(
        st.sampled_from(["n", "place", "other"]),
        st.one_of(SMALL, NUMBERS, NAMES, st.none(), st.lists(SMALL, max_size=2)))}),
    min_size=1, max_size=3))
@profile(400)
def test_validation_then_the_gate_raise_only_their_own_errors(drawn, steps):
    """A plan as a caller may send it (unknown skills, missing, extra and mistyped
    arguments): validation refuses it or the gate does or it passes; nothing else escapes."""
    try:
        c = load(*drawn)
    except CatalogError:
        return
    try:
        valid = validate_plan({"plan": steps}, c)
    except PlanError:
        return
    try:
        gate(valid, c.bindings, c.locations, c.workspace)
    except GateError:
        pass


POINTS = st.fixed_dictionaries({}, optional={"x": st.one_of(SMALL, NUMBERS),
                                             "y": st.one_of(SMALL, NUMBERS),
                                             "z": st.one_of(SMALL, NUMBERS)})
FRAMES = st.sampled_from(["map", "map", "odom", ""])


@st.composite
def pose_values(draw, kind: str, depth: int = 0):
    """A value of the ROS pose type `kind`, its fields drawn (some left out)."""
    if kind in ("geometry_msgs/Point", "geometry_msgs/Pose2D"):
        return draw(POINTS)
    if kind == "geometry_msgs/Pose":
        return {"position": draw(POINTS)}
    if kind == "geometry_msgs/PointStamped":
        return {"header": {"frame_id": draw(FRAMES)}, "point": draw(POINTS)}
    return {"header": {"frame_id": draw(FRAMES)}, "pose": {"position": draw(POINTS)}}


KINDS = st.sampled_from([k for k in POSE_TYPES if k != "geometry_msgs/Point32"])


@st.composite
def typed_goals(draw):
    """(a goal, its field types): up to four pose fields of random types, each a single
    value or an array of them."""
    goal, types = {}, []
    for i in range(draw(st.integers(1, 4))):
        kind, many = draw(KINDS), draw(st.booleans())
        name = f"f{i}"
        types.append((name, f"sequence<{kind}>" if many else kind))
        goal[name] = (draw(st.lists(pose_values(kind), max_size=3)) if many
                      else draw(pose_values(kind)))
    return goal, tuple(types)


def _reference_points(goal, types):
    """Every (frame, x, y) the goal's poses put the robot at, read off the declared types
    directly (a second walk, written apart from the gate's)."""
    for name, kind in types:
        element = kind[len("sequence<"):-1] if kind.startswith("sequence<") else kind
        for value in goal[name] if kind.startswith("sequence<") else [goal[name]]:
            frame = value.get("header", {}).get("frame_id")
            point = {"geometry_msgs/PoseStamped": value.get("pose", {}).get("position", {}),
                     "geometry_msgs/Pose": value.get("position", {}),
                     "geometry_msgs/PointStamped": value.get("point", {})}.get(element, value)
            yield frame, point.get("x", 0.0), point.get("y", 0.0)


@given(typed_goals(), st.booleans())
@profile(1000)
def test_every_pose_a_goal_lets_through_is_inside_the_workspace(drawn, typed):
    goal, types = drawn
    box = Workspace("map", (-5.0, 5.0), (-2.0, 2.0))
    binding = Binding("go", "action", "pkg/action/Go", "/go", goal,
                      field_types=types if typed else ())
    try:
        gate([{"skill": "go", "args": {}}], {"go": binding}, None, box)
    except GateError:
        return
    for frame, x, y in _reference_points(goal, types):
        assert frame in (None, "map")
        assert finite_number(x) and finite_number(y)
        assert -5.0 <= x <= 5.0 and -2.0 <= y <= 2.0, (goal, types)
