"""Skill bindings against the real ROS 2 message types (ros/binding_types.py): our Plan
action, lifecycle_msgs' ChangeState service (a nested message field) and diagnostic_msgs'
SelfTest, as rosidl generated them. Every mismatch is one line naming skill and field."""

from __future__ import annotations

import pytest
from live import requires_ros

from flash_planner.planning.bindings import BindingError
from flash_planner.planning.skills import SkillCatalog

pytestmark = requires_ros


def _catalog(binding: dict, args: dict | None = None) -> SkillCatalog:
    return SkillCatalog.from_dict({"skills": [
        {"name": "ask", "description": "ask another planner",
         "args": args or {"task": {"type": "string"}, "budget": {"type": "integer"}},
         **binding}]})


PLAN = {"action": {"type": "flash_planner_interfaces/action/Plan", "server": "/other/plan",
                   "goal": {"task": "{task}", "max_new_tokens": "{budget}",
                            "enable_thinking": False, "sampling": "greedy"}}}


def test_a_binding_that_fits_its_types_resolves_to_the_goal_class():
    from flash_planner.ros.binding_types import check_types
    from flash_planner_interfaces.action import Plan

    assert check_types(_catalog(PLAN)) == {"ask": Plan.Goal}


def test_a_service_with_a_nested_message_field():
    from lifecycle_msgs.srv import ChangeState

    from flash_planner.ros.binding_types import check_types

    good = {"service": {"type": "lifecycle_msgs/srv/ChangeState", "server": "/node/change_state",
                        "request": {"transition": {"id": 3, "label": "{task}"}}}}
    assert check_types(_catalog(good)) == {"ask": ChangeState.Request}


@pytest.mark.parametrize("binding,message", [
    ({"action": {**PLAN["action"], "type": "flash_planner_interfaces/action/Navigate"}},
     "skill ask: action type flash_planner_interfaces/action/Navigate is not installed here"),
    ({"action": {**PLAN["action"], "type": "no_such_pkg/action/Go"}},
     "skill ask: action type no_such_pkg/action/Go is not installed here"),
    ({"action": {**PLAN["action"], "goal": {"prompt": "{task}"}}},
     "skill ask: flash_planner_interfaces/action/Plan has no field prompt (its fields: task,"),
    ({"action": {**PLAN["action"], "goal": {"max_new_tokens": "{task}"}}},
     "field max_new_tokens is int32; argument 'task' (string) does not fit it"),
    ({"action": {**PLAN["action"], "goal": {"enable_thinking": 1}}},
     "field enable_thinking is boolean; an integer constant does not fit it"),
    ({"action": {**PLAN["action"], "goal": {"task": {"text": "x"}}}},
     "field task is string, not a message: it takes a value, not fields"),
    ({"service": {"type": "lifecycle_msgs/srv/ChangeState", "server": "/n/change_state",
                  "request": {"transition": {"idx": 3}}}},
     "lifecycle_msgs/srv/ChangeState has no field transition.idx (its fields: id, label)"),
    ({"service": {"type": "lifecycle_msgs/srv/ChangeState", "server": "/n/change_state",
                  "request": {"transition": {"id": 0.5}}}},
     "field transition.id is uint8; a number constant does not fit it"),
])
def test_every_type_mismatch_is_one_line_naming_skill_and_field(binding, message):
    from flash_planner.ros.binding_types import check_types

    with pytest.raises(BindingError) as err:
        check_types(_catalog(binding))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_location_fills_only_a_pose_stamped(tmp_path):
    from flash_planner.ros.binding_types import check_types

    (tmp_path / "places.yaml").write_text("kitchen: {frame: map, x: 1, y: 2}\n")
    (tmp_path / "skills.yaml").write_text(
        "locations: places.yaml\n"
        "skills:\n"
        "  - name: ask\n"
        "    args: {room: {type: string}}\n"
        "    action: {type: flash_planner_interfaces/action/Plan, server: /p,\n"
        "             goal: {task: '{location:room}'}}\n")
    with pytest.raises(BindingError, match="field task is string; a location fills a "
                                           "geometry_msgs/PoseStamped"):
        check_types(SkillCatalog.from_yaml(tmp_path / "skills.yaml"))
