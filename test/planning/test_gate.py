"""The safety gate (planning/gate.py) by example: each defect of issue 99's list that the gate
or the catalog reader let through, as the smallest input that showed it. The properties over
generated catalogs and plans are test_gate_properties.py's."""

from __future__ import annotations

import math

import pytest
import yaml

from flash_planner.planning.bindings import Binding, Bound, Location, Workspace
from flash_planner.planning.execution import steps_of
from flash_planner.planning.gate import GateError, gate, poses
from flash_planner.planning.parse import PlanError, loads, parse_plan
from flash_planner.planning.skills import CatalogError, SkillCatalog

WORKSPACE = {"frame": "map", "x": [-5, 5], "y": [-5, 5]}
DRIVE = {"name": "drive", "description": "drive straight", "args": {"speed": {"type": "number"}},
         "action": {"type": "demo_msgs/action/Drive", "server": "/drive",
                    "goal": {"speed": "{speed}"}},
         "limits": {"speed": {"max": 0.5}}}
GO = {"name": "go", "description": "drive to a place",
      "args": {"target": {"type": "string", "grounded": True}},
      "action": {"type": "nav2_msgs/action/NavigateToPose", "server": "/navigate_to_pose",
                 "goal": {"pose": "{location:target}"}}}
PLACES = {"kitchen": {"frame": "map", "x": 2.0, "y": 1.0}, "sink": {"frame": "map", "x": 3.0,
                                                                    "y": -1.0}}


def catalog(tmp_path, skills, places=None, **top) -> SkillCatalog:
    if places is not None:
        (tmp_path / "places.yaml").write_text(yaml.safe_dump(places))
        top["locations"] = "places.yaml"
    path = tmp_path / "skills.yaml"
    path.write_text(yaml.safe_dump({"skills": skills, **top}))
    return SkillCatalog.from_yaml(path)


# 1. Non-finite numbers

@pytest.mark.parametrize("number", ["NaN", "-Infinity", "Infinity", "1e999"])
def test_a_plan_json_number_that_is_not_finite_is_refused(tmp_path, number):
    c = catalog(tmp_path, [DRIVE])
    with pytest.raises(PlanError, match="finite"):
        steps_of('[{"skill": "drive", "args": {"speed": NUMBER}}]'.replace("NUMBER", number),
                 c)
    with pytest.raises(PlanError, match="finite"):
        parse_plan('{"plan": [{"skill": "drive", "args": {"speed": NUMBER}}]}'.replace(
            "NUMBER", number), c)


@pytest.mark.parametrize("value", [math.nan, -math.inf, math.inf])
def test_a_step_whose_number_is_not_finite_fails_validation(tmp_path, value):
    from flash_planner.planning.parse import validate_plan

    with pytest.raises(PlanError, match="argument 'speed' must be a finite number"):
        validate_plan({"plan": [{"skill": "drive", "args": {"speed": value}}]},
                      catalog(tmp_path, [DRIVE]))


def test_the_gate_refuses_a_non_finite_number_that_validation_never_saw(tmp_path):
    c = catalog(tmp_path, [{**DRIVE, "limits": {}}])
    with pytest.raises(GateError, match=r"step 0 \(drive\): speed = nan is not a finite"):
        gate([{"skill": "drive", "args": {"speed": math.nan}}], c.bindings, None, None)
    with pytest.raises(GateError, match="below its limit"):      # a max-only limit, -inf
        gate([{"skill": "drive", "args": {"speed": -1e300}}],
             catalog(tmp_path, [{**DRIVE, "limits": {"speed": {"min": -1}}}]).bindings,
             None, None)


@pytest.mark.parametrize("where,change", [
    ("limits", {"limits": {"speed": {"max": math.nan}}}),
    ("limits", {"limits": {"speed": {"min": -math.inf}}}),
    ("timeout_s", {"action": {**DRIVE["action"], "timeout_s": math.nan}}),
    ("minimum", {"args": {"speed": {"type": "number", "minimum": math.nan}}}),
    ("default", {"args": {"speed": {"type": "number", "required": False,
                                    "default": math.inf}}}),
])
def test_a_catalog_number_that_is_not_finite_is_a_load_error(tmp_path, where, change):
    with pytest.raises(CatalogError, match=where):
        catalog(tmp_path, [{**DRIVE, **change}])


@pytest.mark.parametrize("field", ["x", "yaw"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_place_or_workspace_that_is_not_finite_is_a_load_error(tmp_path, field, value):
    places = {"kitchen": {"frame": "map", "x": 1.0, "y": 1.0, field: value}}
    with pytest.raises(CatalogError, match=f"location 'kitchen' in .*: {field} must be a "
                                           "number"):
        catalog(tmp_path, [GO], places)
    with pytest.raises(CatalogError, match="workspace x must be"):
        catalog(tmp_path, [DRIVE], workspace={**WORKSPACE, "x": [-value, value]})


def test_the_json_reader_refuses_what_json_is_not():
    assert loads('{"a": [1, 2.5, -3e2]}') == {"a": [1, 2.5, -300.0]}
    for text in ("NaN", '{"a": -Infinity}', "[1e400]"):
        with pytest.raises(PlanError, match="finite"):
            loads(text)


# 2. Every pose, by its message type

NAV_TYPES = (("target", "geometry_msgs/Pose"), ("target.position", "geometry_msgs/Point"),
             ("via", "geometry_msgs/Point"), ("path", "sequence<geometry_msgs/PoseStamped>"),
             ("speed", "float"))


def _binding(template, field_types=NAV_TYPES, limits=()):
    return Binding("follow", "action", "pkg/action/Follow", "/follow", template,
                   field_types=field_types, limits=limits)


def _refusal(goal_template, field_types=NAV_TYPES):
    try:
        gate([{"skill": "follow", "args": {}}], {"follow": _binding(goal_template, field_types)},
             None, Workspace("map", (-5.0, 5.0), (-5.0, 5.0)))
    except GateError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("types", [NAV_TYPES, ()], ids=["by type", "by shape"])
def test_every_pose_a_goal_carries_is_inside_the_workspace(types):
    inside = {"x": 1.0, "y": 1.0}
    assert _refusal({"target": {"position": inside}, "via": inside}, types) is None
    assert "target (40.0, 0.0) is outside" in _refusal(
        {"target": {"position": {"x": 40.0, "y": 0.0}}}, types)
    assert "via (1.0, -9.0) is outside" in _refusal({"via": {"x": 1.0, "y": -9.0}}, types)
    path = [{"header": {"frame_id": "map"}, "pose": {"position": inside}},
            {"header": {"frame_id": "map"}, "pose": {"position": {"x": 7.0, "y": 0.0}}}]
    assert "path[1] (7.0, 0.0) is outside" in _refusal({"path": path}, types)
    path[1]["header"]["frame_id"] = "odom"
    assert "path[1] is in frame 'odom'" in _refusal({"path": path}, types)


def test_a_coordinate_left_out_is_the_messages_zero_not_a_crash():
    # a PoseStamped template without y raised a TypeError in the gate
    stamped = {"header": {"frame_id": "map"}, "pose": {"position": {"x": 1.0}}}
    assert _refusal({"path": [stamped]}) is None
    assert list(poses({"path": [stamped]}, dict(NAV_TYPES))) == [
        ("path[0]", "map", {"x": 1.0})]
    far = {"header": {"frame_id": "map"}, "pose": {"position": {"y": 9.0}}}
    assert "(0.0, 9.0) is outside" in _refusal({"path": [far]})


def test_a_number_outside_its_ros_type_or_a_bool_in_a_number_field_is_refused():
    assert "does not fit its type float" in _refusal({"speed": 1e39})
    assert "is not a number (its type is float)" in _refusal({"speed": True})


def test_a_placeholder_of_an_optional_argument_left_out_is_refused_not_a_key_error():
    b = Binding("wait", "action", "pkg/action/Wait", "/wait", {"seconds": "{seconds}"})
    with pytest.raises(GateError, match="argument 'seconds' is not given"):
        gate([{"skill": "wait", "args": {}}], {"wait": b}, None, None)


def test_a_limit_on_a_field_that_holds_nan_is_refused():
    b = _binding({"speed": math.nan}, limits=(Bound("speed", max=1.0),))
    with pytest.raises(GateError, match="not a finite number"):
        gate([{"skill": "follow", "args": {}}], {"follow": b}, None, None)


# 3. Places the table holds

def test_a_place_argument_admits_only_the_tables_names(tmp_path):
    from flash_planner.planning.grounding import RequestWords
    from flash_planner.planning.prompt import build_messages

    c = catalog(tmp_path, [GO, DRIVE], PLACES)
    assert c.places == ("kitchen", "sink")

    def targets(words):
        schema = c.plan_schema(words)
        steps = {s["properties"]["skill"]["const"]: s for s in
                 schema["properties"]["plan"]["items"]["oneOf"]}
        return steps.get("go", {}).get("properties", {}).get("args", {}).get(
            "properties", {}).get("target")

    assert targets(None) == {"type": "string", "enum": ["kitchen", "sink"]}
    words = RequestWords.of("bring the red cup from the kitchen to the sink")
    assert targets(words) == {"type": "string", "enum": ["kitchen", "sink"]}
    # a task that mentions no place of the table cannot send the robot anywhere
    assert targets(RequestWords.of("bring the red cup to the garage")) is None
    user = build_messages(c, "go to the sink")[1]["content"]
    assert "Places: kitchen; sink" in user


def test_the_location_table_can_be_replaced_and_enums_must_follow(tmp_path):
    c = catalog(tmp_path, [GO], PLACES)
    hall = {"hall": Location("map", 0.5, 0.5)}
    replaced = c.with_locations(hall)
    assert replaced.places == ("hall",) and c.places == ("kitchen", "sink")
    assert gate([{"skill": "go", "args": {"target": "hall"}}], replaced.bindings,
                replaced.locations, None)[0]["pose"]["pose"]["position"]["x"] == 0.5
    fixed = catalog(tmp_path, [{**GO, "args": {"target": {"type": "string",
                                                          "enum": ["kitchen"]}}}], PLACES)
    with pytest.raises(CatalogError, match="may name 'kitchen', which the new location "
                                           "table does not hold"):
        fixed.with_locations(hall)


def test_a_location_table_sent_as_text_is_checked_like_a_file():
    from flash_planner.planning.bindings import BindingError, locations_from_text

    table = locations_from_text('{"dock": {"frame": "map", "x": 1, "y": 2}}', "~/locations")
    assert table == {"dock": Location("map", 1.0, 2.0, 0.0)}
    for text, why in [("dock: [1, 2", "not valid YAML"), ("[]", "must map names"),
                      ("dock: {frame: map, x: .nan, y: 0}", "x must be a number")]:
        with pytest.raises(BindingError, match=why):
            locations_from_text(text, "~/locations")
