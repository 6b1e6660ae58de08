"""Skill bindings in the catalog (planning/bindings.py): an action or service per skill, its
goal filled from the step's arguments, constants and the named-location table, every bad
binding a one-line error at load naming the skill and the field, and the safety gate that
refuses a plan outside a limit or the workspace before any goal exists to send."""

from __future__ import annotations

import math

import pytest
import yaml

from flash_planner.planning.gate import GateError, gate
from flash_planner.planning.skills import CatalogError, SkillCatalog

LOCATIONS = {"kitchen": {"frame": "map", "x": 2.0, "y": -1.5, "yaw": math.pi / 2},
             "dock": {"frame": "map", "x": 0.0, "y": 0.0},
             "roof": {"frame": "map", "x": 40.0, "y": 0.0}}


def catalog(tmp_path, skills, **top):
    (tmp_path / "locations.yaml").write_text(yaml.safe_dump(LOCATIONS))
    path = tmp_path / "skills.yaml"
    path.write_text(yaml.safe_dump({"skills": skills, **top}))
    return SkillCatalog.from_yaml(path)


NAVIGATE = {"name": "go_to_room", "description": "drive to a named room",
            "args": {"room": {"type": "string"}},
            "action": {"type": "nav2_msgs/action/NavigateToPose", "server": "/navigate_to_pose",
                       "timeout_s": 90, "goal": {"pose": "{location:room}",
                                                 "behavior_tree": ""}}}
MOVE = {"name": "drive", "description": "drive straight",
        "args": {"speed": {"type": "number"}, "distance": {"type": "number"}},
        "action": {"type": "demo_msgs/action/Drive", "server": "drive",
                   "goal": {"speed": "{speed}", "distance": "{distance}", "mode": 2}},
        "limits": {"speed": {"max": 0.5}, "distance": {"min": 0, "max": 10}},
        "approve": True}
SAY = {"name": "say", "description": "speak", "args": {"text": {"type": "string"}}}


def test_a_bound_skill_fills_its_goal_from_arguments_constants_and_locations(tmp_path):
    c = catalog(tmp_path, [NAVIGATE, MOVE, SAY], locations="locations.yaml",
                workspace={"frame": "map", "x": [-5, 5], "y": [-5, 5]})
    assert set(c.bindings) == {"go_to_room", "drive"}      # say stays plan-only
    nav = c.bindings["go_to_room"]
    assert (nav.kind, nav.type, nav.server, nav.timeout_s) == (
        "action", "nav2_msgs/action/NavigateToPose", "/navigate_to_pose", 90.0)
    assert c.bindings["drive"].approve and c.bindings["drive"].timeout_s == 60.0
    steps = [{"skill": "go_to_room", "args": {"room": "kitchen"}},
             {"skill": "say", "args": {"text": "here"}},
             {"skill": "drive", "args": {"speed": 0.3, "distance": 2.5}}]
    goals = gate(steps, c.bindings, c.locations, c.workspace)
    pose = goals[0]["pose"]
    assert pose["header"] == {"frame_id": "map"} and goals[0]["behavior_tree"] == ""
    assert pose["pose"]["position"] == {"x": 2.0, "y": -1.5, "z": 0.0}
    q = pose["pose"]["orientation"]
    assert math.isclose(q["z"], math.sin(math.pi / 4)) and math.isclose(q["w"], q["z"])
    assert goals[1] is None
    assert goals[2] == {"speed": 0.3, "distance": 2.5, "mode": 2}


@pytest.mark.parametrize("steps,message", [
    ([{"skill": "drive", "args": {"speed": 0.3, "distance": 2}},
      {"skill": "drive", "args": {"speed": 0.9, "distance": 2}}],
     "step 1 (drive): speed = 0.9 is above its limit 0.5"),
    ([{"skill": "drive", "args": {"speed": 0.1, "distance": -1}}],
     "step 0 (drive): distance = -1 is below its limit 0"),
    ([{"skill": "go_to_room", "args": {"room": "roof"}}],
     "step 0 (go_to_room): pose (40.0, 0.0) is outside the workspace x [-5.0, 5.0]"),
    ([{"skill": "go_to_room", "args": {"room": "attic"}}],
     "step 0 (go_to_room): pose: location 'attic' is not in the location table (known: "
     "dock, kitchen, roof)"),
])
def test_the_gate_refuses_the_whole_plan_naming_step_field_and_limit(tmp_path, steps, message):
    c = catalog(tmp_path, [NAVIGATE, MOVE], locations="locations.yaml",
                workspace={"frame": "map", "x": [-5, 5], "y": [-5, 5]})
    with pytest.raises(GateError) as err:
        gate(steps, c.bindings, c.locations, c.workspace)
    assert str(err.value).startswith(message)


def _with(skill, **changes):
    out = {**skill, **{k: v for k, v in changes.items() if k in ("args", "limits", "approve")}}
    kind = "action" if "action" in skill else "service"
    out[kind] = {**skill[kind], **{k: v for k, v in changes.items()
                                   if k not in ("args", "limits", "approve")}}
    return out


@pytest.mark.parametrize("skill,message", [
    (_with(NAVIGATE, type="nav2_msgs/NavigateToPose"),
     "(go_to_room) action: 'type' must read pkg/action/Name, got 'nav2_msgs/NavigateToPose'"),
    (_with(NAVIGATE, type="std_srvs/srv/Trigger"),
     "(go_to_room) action: 'type' must read pkg/action/Name"),
    (_with(NAVIGATE, server="navigate to pose"), "(go_to_room) action: 'server' must be a ROS"),
    (_with(NAVIGATE, timeout_s=0), "(go_to_room) action: 'timeout_s' must be a positive"),
    (_with(NAVIGATE, goal={"pose": "{location:place}"}),
     "(go_to_room) action: goal field pose names argument 'place', which go_to_room does not "
     "declare (declared: room)"),
    (_with(NAVIGATE, args={"room": {"type": "string", "enum": ["kitchen", "garage"]}}),
     "(go_to_room) action: argument 'room' may name 'garage', which the location table does "
     "not hold"),
    (_with(NAVIGATE, args={"room": {"type": "integer"}}),
     "(go_to_room) action: goal field pose: argument 'room' names a location, so it must be a "
     "string, not integer"),
    (_with(NAVIGATE, feedback="x"), "(go_to_room) action: unknown field(s) ['feedback']"),
    (_with(MOVE, limits={"speed": {"max": "fast"}}), "(drive) limits: speed's min and max"),
    (_with(MOVE, limits={"speed": {"min": 2, "max": 1}}),
     "(drive) limits: speed's min 2 is above its max 1"),
    (_with(MOVE, approve="yes"), "(drive): 'approve' must be true or false"),
    ({**SAY, "limits": {"x": {"max": 1}}}, "(say): 'limits' needs an action or a service"),
    ({**SAY, "executor": "/say"}, "(say): unknown field(s) ['executor']"),
    ({**NAVIGATE, "service": {"type": "std_srvs/srv/Trigger", "server": "/x"}},
     "(go_to_room): a skill binds an action or a service, not both"),
])
def test_every_bad_binding_is_one_line_at_load(tmp_path, skill, message):
    with pytest.raises(CatalogError) as err:
        catalog(tmp_path, [skill], locations="locations.yaml")
    text = str(err.value)
    assert message in text and "\n" not in text and "skills.yaml: skills[0]" in text


def test_locations_and_workspace_are_checked_at_load(tmp_path):
    with pytest.raises(CatalogError, match="takes a location, and the catalog names no "
                                           "'locations' table"):
        catalog(tmp_path, [NAVIGATE])
    with pytest.raises(CatalogError, match="location table .*missing.yaml is not readable"):
        catalog(tmp_path, [NAVIGATE], locations="missing.yaml")
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({"hall": {"frame": "map", "x": "one",
                                                                "y": 0}}))
    with pytest.raises(CatalogError, match="location 'hall' in .*: x must be a number"):
        catalog(tmp_path, [NAVIGATE], locations="bad.yaml")
    with pytest.raises(CatalogError, match=r"workspace y must be \[lo, hi\]"):
        catalog(tmp_path, [SAY], workspace={"frame": "map", "x": [0, 1], "y": [2, 1]})


def test_a_service_binding_fills_its_request(tmp_path):
    dock = {"name": "dock", "description": "dock to charge", "args": {},
            "service": {"type": "std_srvs/srv/Trigger", "server": "/dock", "timeout_s": 5}}
    c = catalog(tmp_path, [dock])
    b = c.bindings["dock"]
    assert (b.kind, b.template, b.timeout_s) == ("service", {}, 5.0)
    assert gate([{"skill": "dock", "args": {}}], c.bindings, None, None) == [{}]


def test_the_shipped_catalogs_stay_plan_only():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "config"
    for path in [root / "skills.yaml", *sorted((root / "catalogs").glob("*.yaml"))]:
        if "skills" not in yaml.safe_load(path.read_text()):      # an examples file
            continue
        assert SkillCatalog.from_yaml(path).bindings == {}, path
