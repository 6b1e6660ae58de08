"""`~/execute` where a step's end is in doubt, on real rclpy (issue 99, items 2-5): a server
that leaves the graph while its goal runs, one that never confirms a cancel, a service call
past its timeout, approvals that name their plan, the location table replaced on
`~/locations`, and poses found by their message types. The servers count what they receive
(test/ros/skill_servers.py)."""

from __future__ import annotations

import json

import pytest
import test_node_execute
import yaml
from live import requires_ros, result_of, wait_for
from test_node_execute import LOCATIONS, write_catalog

pytestmark = requires_ros
robot = test_node_execute.robot   # the planner node, the skill servers, an ExecutePlan client
PICK = [{"skill": "pick", "args": {"object": "red cup"}}]
TASK = "bring the red cup from the kitchen table to the sink"


def test_a_server_that_leaves_the_graph_mid_goal_ends_the_step_unavailable(robot):
    r = robot()
    r.servers.manip.script = ["deaf"]          # runs until the server is gone
    handle, feedback = r.send(plan=PICK)
    assert wait_for(lambda: len([f for f in feedback if f.state == "running"]) >= 3)
    r.servers.stop_manipulate()
    result = result_of(handle.get_result_async()).result
    # not timed_out (the binding's 30 s and a cancel grace): noticed on the graph
    assert result.failed_state == "unavailable", result.error
    assert "left the graph while its goal ran" in result.error
    assert "not confirmed" in result.error and result.replans == 0


def test_a_timeout_whose_cancel_is_never_confirmed_ends_the_run_unreplanned(robot, tmp_path,
                                                                          monkeypatch):
    from flash_planner.ros import step_clients

    monkeypatch.setattr(step_clients, "CANCEL_GRACE_S", 0.5)
    r = robot(catalog=write_catalog(tmp_path, navigate_to={"action": {
        "type": "flash_planner_test_msgs/action/NavigateToPose", "server": "/navigate_to_pose",
        "timeout_s": 0.5, "goal": {"pose": "{location:target}", "behavior_tree": ""}}}))
    r.servers.nav.script = ["deaf"]
    status, result, _ = r.execute(task=TASK)
    plan = json.loads(result.plans_json)
    assert plan[0][0]["skill"] == "navigate_to", plan
    assert result.failed_state == "unconfirmed", result.error
    assert "did not end the goal within 0.5 s" in result.error
    # a replan naming navigate_to would send the same work while the first may still run
    assert result.replans == 0 and len(r.servers.nav.goals) == 1
    assert r.servers.nav.cancels == 1


def test_a_service_call_past_its_timeout_is_unconfirmed(robot, tmp_path):
    r = robot(catalog=write_catalog(tmp_path, say={"service": {
        "type": "flash_planner_test_msgs/srv/Speak", "server": "/speak", "timeout_s": 0.3,
        "request": {"text": "{text}"}}}))
    r.servers.speech.script = ["deaf"]
    _, result, _ = r.execute(plan=[{"skill": "say", "args": {"text": "hello"}}])
    assert result.failed_state == "unconfirmed", result.error
    assert "a service call cannot be cancelled" in result.error
    r.servers.release()     # answered before the fixture destroys the service
    assert wait_for(r.servers.deaf_answered.is_set)


def test_an_approval_names_its_plan_and_a_wrong_one_is_refused(robot):
    r = robot()
    handle, feedback = r.send(plan=[{"skill": "open", "args": {"object": "fridge"}}])
    assert wait_for(lambda: any(f.state == "waiting_approval" for f in feedback))
    waiting = next(f for f in feedback if f.state == "waiting_approval")
    assert "plan 0 step 0" in waiting.detail

    def answer(plan_index: int):
        return result_of(r.approve.call_async(r.Approve.Request(
            execution_id=waiting.execution_id, plan_index=plan_index, step_index=0,
            approve=True)))

    wrong = answer(1)
    assert not wrong.accepted and "waiting: " in wrong.message
    assert f"{waiting.execution_id} plan 0 step 0 (open)" in wrong.message
    assert r.servers.manip.goals == []
    assert answer(0).accepted
    assert result_of(handle.get_result_async()).result.success
    assert len(r.servers.manip.goals) == 1


def test_the_location_table_is_replaced_on_its_topic(robot):
    from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
    from std_msgs.msg import String

    r = robot()
    latched = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE,
                         durability=DurabilityPolicy.TRANSIENT_LOCAL)
    pub = r.h.client_node.create_publisher(String, "/flash_planner/locations", latched)
    hall = {**LOCATIONS, "hall": {"frame": "map", "x": -2.0, "y": 0.5}}
    pub.publish(String(data=json.dumps(hall)))
    planner = r.h.node._planner
    assert wait_for(lambda: "hall" in planner.catalog.places)
    _, result, _ = r.execute(plan=[{"skill": "navigate_to", "args": {"target": "hall"}}])
    assert result.success, result.error
    assert r.servers.nav.goals[-1]["pose"]["pose"]["position"]["x"] == -2.0
    # a bad table is refused and the one before stays
    pub.publish(String(data="hall: {frame: map, x: .nan, y: 0}"))
    assert wait_for(lambda: r.h.node._locations.refused == 1)
    _, result, _ = r.execute(plan=[{"skill": "navigate_to", "args": {"target": "hall"}}])
    assert result.success and "kitchen" in planner.catalog.places
    _, result, _ = r.execute(plan=[{"skill": "navigate_to", "args": {"target": "attic"}}])
    assert result.failed_state == "gate" and "'attic' is not in the location table" in \
        result.error and "hall" in result.error


@pytest.mark.parametrize("field,value,message", [
    ("target", {"position": {"x": 40.0, "y": 0.0}}, "target (40.0, 0.0) is outside"),
    ("via", {"x": 1.0, "y": -30.0}, "via (1.0, -30.0) is outside"),
])
def test_poses_are_found_by_the_real_message_types(tmp_path, field, value, message):
    """A Pose or a Point (FollowPath.action of the test messages) outside the workspace,
    which the gate's old PoseStamped-shaped walk let through."""
    from flash_planner.planning.gate import GateError, gate
    from flash_planner.planning.skills import SkillCatalog
    from flash_planner.ros.binding_types import check_types, typed

    (tmp_path / "skills.yaml").write_text(yaml.safe_dump({
        "workspace": {"frame": "map", "x": [-10, 10], "y": [-10, 10]},
        "skills": [{"name": "follow", "description": "follow", "args": {},
                    "action": {"type": "flash_planner_test_msgs/action/FollowPath",
                               "server": "/follow", "goal": {field: value}}}]}))
    catalog = SkillCatalog.from_yaml(tmp_path / "skills.yaml")
    catalog = typed(catalog, check_types(catalog))
    assert dict(catalog.bindings["follow"].field_types)["path"] == \
        "sequence<geometry_msgs/PoseStamped>"
    with pytest.raises(GateError, match=message.replace("(", r"\(").replace(")", r"\)")):
        gate([{"skill": "follow", "args": {}}], catalog.bindings, None, catalog.workspace)


def test_a_runner_told_to_cancel_before_sending_sends_nothing(robot):
    """The last check before `send_goal_async`: a cancel that landed between the gate (or an
    approval) and the send reaches no server."""
    import threading

    r = robot()
    runner, bindings = r.h.node._runner, r.h.node._planner.catalog.bindings
    cancelled = threading.Event()
    cancelled.set()
    goal = {"verb": "pick", "object": "red cup", "speed": 0.2}
    outcome = runner.run(bindings["pick"], goal, lambda fb: None, cancelled)
    assert (outcome.state, outcome.reason) == ("canceled", "the execution was cancelled; "
                                                           "nothing sent")
    assert r.servers.manip.goals == []
