"""Plans run on the robot's own servers through `~/execute` (ExecutePlan), on real rclpy:
the demo planner, the test servers of skill_servers.py (a NavigateToPose shaped like
Nav2's, a manipulation action, a speech service) and a catalog binding the default skills to
them. The servers count what they receive, so "nothing was sent" is asserted, not assumed.
"""

from __future__ import annotations

import json
import math
import threading

import pytest
import yaml
from live import TIMEOUT, requires_ros, result_of, values_of, wait_for

from flash_planner.planning.presets import default_skills_path

pytestmark = requires_ros

LOCATIONS = {"kitchen": {"frame": "map", "x": 2.0, "y": 1.0, "yaw": math.pi / 2},
             "red cup": {"frame": "map", "x": 2.5, "y": 1.5},   # where perception saw it
             "kitchen table": {"frame": "map", "x": 2.5, "y": 1.5},
             "table": {"frame": "map", "x": 2.5, "y": 1.5},
             "sink": {"frame": "map", "x": 3.0, "y": -1.0, "yaw": math.pi},
             "garage": {"frame": "map", "x": 40.0, "y": 0.0}}   # outside the workspace
MANIPULATE = "flash_planner_test_msgs/action/Manipulate"
BINDINGS = {
    "navigate_to": {"action": {"type": "flash_planner_test_msgs/action/NavigateToPose",
                               "server": "/navigate_to_pose", "timeout_s": 30,
                               "goal": {"pose": "{location:target}", "behavior_tree": ""}}},
    "pick": {"action": {"type": MANIPULATE, "server": "/manipulate", "timeout_s": 30,
                        "goal": {"verb": "pick", "object": "{object}", "speed": 0.2}}},
    "place": {"action": {"type": MANIPULATE, "server": "/manipulate", "timeout_s": 30,
                         "goal": {"verb": "place", "object": "{object}",
                                  "location": "{location}"}}},
    "open": {"approve": True,
             "action": {"type": MANIPULATE, "server": "/manipulate",
                        "goal": {"verb": "open", "object": "{object}"}}},
    "say": {"service": {"type": "flash_planner_test_msgs/srv/Speak", "server": "/speak",
                        "timeout_s": 10, "request": {"text": "{text}"}}},
    "wait": {"limits": {"speed": {"max": 30}},
             "action": {"type": MANIPULATE, "server": "/manipulate",
                        "goal": {"verb": "wait", "speed": "{seconds}"}}},
    # close stays plan-only
}


def write_catalog(tmp_path, **changes) -> str:
    """The default catalog (what the demo was trained on) with the bindings above."""
    data = yaml.safe_load(default_skills_path().read_text())
    for entry in data["skills"]:
        entry.update(json.loads(json.dumps(BINDINGS.get(entry["name"], {}))))
        for key, value in changes.get(entry["name"], {}).items():
            entry[key] = value
    (tmp_path / "places.yaml").write_text(yaml.safe_dump(LOCATIONS))
    data.update(locations="places.yaml",
                workspace={"frame": "map", "x": [-10.0, 10.0], "y": [-10.0, 10.0]})
    path = tmp_path / "robot_skills.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


class Robot:
    """The harness's planner node, the skill servers and an ExecutePlan client
    (`server_args`: more SkillServers keyword arguments, e.g. feedbacks and pace_s)."""

    def __init__(self, harness, ros_context, tmp_path, speak=True, catalog=None,
                 server_args=None, **params):
        from rclpy.action import ActionClient
        from skill_servers import SkillServers
        from std_msgs.msg import String

        from flash_planner.ros.action_server import feedback_qos
        from flash_planner_interfaces.action import ExecutePlan
        from flash_planner_interfaces.srv import Approve

        self.servers = SkillServers(ros_context, speak=speak, **(server_args or {}))
        # feedback period 0: every server feedback relayed, as the tests below count it
        # (test_node_execute_control.py tests the throttle)
        self.h = harness(**{"planner.skills_file": catalog or write_catalog(tmp_path),
                            "execution.check_period_s": 0.2,
                            "planner.feedback_period_ms": 0.0, **params})
        self.h.executor.add_node(self.servers.node)
        self.ExecutePlan = ExecutePlan
        self.client = ActionClient(self.h.client_node, ExecutePlan, "/flash_planner/execute",
                                   feedback_sub_qos_profile=feedback_qos())
        self.approve = self.h.client_node.create_client(Approve, "/flash_planner/approve")
        self.Approve = Approve
        self.dry_runs: list[dict] = []
        self.h.client_node.create_subscription(
            String, "/flash_planner/dry_run", lambda m: self.dry_runs.append(json.loads(m.data)),
            10)
        assert self.client.wait_for_server(timeout_sec=30)
        self.h.bring_up()

    def send(self, task="", plan=None, **fields):
        """Send an execute goal; (goal handle, its feedback list)."""
        feedback: list = []
        plan_json = fields.pop("plan_json", "" if plan is None else json.dumps(plan))
        goal = self.ExecutePlan.Goal(task=task, max_replans=fields.pop("max_replans", -1),
                                     plan_json=plan_json, **fields)
        handle = result_of(self.client.send_goal_async(
            goal, feedback_callback=lambda m: feedback.append(m.feedback)))
        assert handle.accepted
        return handle, feedback

    def execute(self, task="", plan=None, **fields):
        """(status, result, feedback) of one execution."""
        handle, feedback = self.send(task, plan, **fields)
        response = result_of(handle.get_result_async())
        return response.status, response.result, feedback

    def sent(self) -> int:
        return len(self.servers.nav.goals) + len(self.servers.manip.goals) + \
            len(self.servers.speech.goals)


@pytest.fixture
def robot(harness, ros_context, tmp_path):
    made = []

    def make(**kwargs) -> Robot:
        made.append(Robot(harness, ros_context, tmp_path, **kwargs))
        return made[-1]

    yield make
    for r in made:
        r.servers.close()


PLAN = [{"skill": "navigate_to", "args": {"target": "kitchen"}},
        {"skill": "pick", "args": {"object": "red cup"}},
        {"skill": "navigate_to", "args": {"target": "sink"}},
        {"skill": "place", "args": {"object": "red cup", "location": "sink"}},
        {"skill": "say", "args": {"text": "done"}}]


def _succeeded():
    from action_msgs.msg import GoalStatus

    return GoalStatus.STATUS_SUCCEEDED


def _aborted():
    from action_msgs.msg import GoalStatus

    return GoalStatus.STATUS_ABORTED


def test_a_plan_runs_end_to_end_with_each_goal_as_bound(robot):
    r = robot()
    status, result, feedback = r.execute(plan=PLAN)
    assert status == _succeeded(), result.error
    assert (result.success, result.steps_done, result.failed_step, result.replans) == \
        (True, 5, -1, 0)
    nav, manip, speech = r.servers.nav.goals, r.servers.manip.goals, r.servers.speech.goals
    assert len(nav) == 2 and len(manip) == 2 and len(speech) == 1
    kitchen = nav[0]["pose"]
    assert kitchen["header"]["frame_id"] == "map"
    assert kitchen["pose"]["position"] == {"x": 2.0, "y": 1.0, "z": 0.0}
    orientation = kitchen["pose"]["orientation"]   # yaw pi/2 about z
    assert math.isclose(orientation["z"], math.sin(math.pi / 4), abs_tol=1e-9)
    assert math.isclose(orientation["w"], math.cos(math.pi / 4), abs_tol=1e-9)
    assert nav[1]["pose"]["pose"]["position"]["x"] == 3.0
    assert manip[0]["verb"] == "pick" and manip[0]["object"] == "red cup"
    assert math.isclose(manip[0]["speed"], 0.2, rel_tol=1e-6)
    assert (manip[1]["verb"], manip[1]["location"]) == ("place", "sink")
    assert speech[0]["text"] == "done"
    # per step: sent, the server's own feedback (running), succeeded
    states = [(f.step_index, f.state) for f in feedback]
    for i in range(5):
        assert states.index((i, "sent")) < states.index((i, "succeeded"))
    running = [json.loads(f.message_json) for f in feedback
               if f.state == "running" and f.step_index == 0]
    assert [m["distance_remaining"] for m in running] == [3.0, 2.0, 1.0]
    assert json.loads(result.plans_json) == [PLAN]
    assert {f.execution_id for f in feedback} == {feedback[0].execution_id}


def test_a_tree_recovers_inside_itself_and_a_bt_xml_tree_runs_the_same(robot):
    """A pick retried (its first goal aborted) and a fallback's second alternative taken:
    a succeeded run, every leaf named by its path; the same tree sent as BT XML runs the
    same goals."""
    from flash_planner.planning.bt import to_bt_xml
    from flash_planner.planning.presets import default_skills_path
    from flash_planner.planning.skills import SkillCatalog

    tree = [PLAN[0], {"retry": 2, "plan": [PLAN[1]]},
            {"fallback": [[PLAN[2]], [{"skill": "say", "args": {"text": "no sink"}}]]}]
    r = robot()
    for plan_json in (json.dumps(tree),
                      to_bt_xml(tree, SkillCatalog.from_yaml(default_skills_path()))):
        picks, said = len(r.servers.manip.goals), len(r.servers.speech.goals)
        r.servers.manip.script = ["abort"]
        r.servers.nav.script = ["succeed", "abort"]
        status, result, feedback = r.execute(plan_json=plan_json)
        assert status == _succeeded(), result.error
        assert (result.success, result.steps_done, result.replans) == (True, 3, 0)
        assert len(r.servers.manip.goals) - picks == 2
        assert len(r.servers.speech.goals) - said == 1
        assert r.servers.speech.goals[-1]["text"] == "no sink"
        sent = [(f.step_index, f.step_path) for f in feedback if f.state == "sent"]
        assert sent == [(0, "0"), (1, "1.0"), (1, "1.0"), (2, "2.0.0"), (3, "2.1.0")]


def test_a_task_is_planned_by_the_model_then_run(robot):
    r = robot()
    status, result, feedback = r.execute(task="go to the kitchen and say hello")
    assert status == _succeeded(), result.error
    plan = json.loads(result.plans_json)[0]
    assert [s["skill"] for s in plan] and result.steps_done == len(plan)
    assert feedback[0].state == "planning"
    assert r.sent() == len(plan)


def test_an_aborted_step_is_replanned_and_the_new_plan_completes(robot):
    r = robot()
    r.servers.manip.script = ["abort"]          # the first pick slips
    status, result, feedback = r.execute(
        task="bring the red cup from the kitchen table to the sink")
    assert status == _succeeded(), result.error
    assert result.replans == 1
    plans = json.loads(result.plans_json)
    assert len(plans) == 2
    assert "replanning" in [f.state for f in feedback]
    failed = [f for f in feedback if f.state == "failed"]
    assert len(failed) == 1 and "the gripper slipped" in failed[0].detail
    assert r.servers.manip.goals[0]["verb"] == "pick"


def test_replans_are_bounded_and_the_last_failure_is_reported(robot):
    r = robot()
    r.servers.nav.script = ["abort"] * 5
    status, result, _ = r.execute(task="go to the kitchen", max_replans=1)
    assert status == _aborted()
    assert (result.success, result.replans, result.failed_state) == (False, 1, "aborted")
    assert "no valid path to the goal" in result.error and "error_code 104" in result.error
    assert len(r.servers.nav.goals) == 2         # the first plan's and the replan's


def test_a_step_that_times_out_is_cancelled_and_nothing_after_it_is_sent(robot, tmp_path):
    catalog = write_catalog(tmp_path, navigate_to={"action": {
        **BINDINGS["navigate_to"]["action"], "timeout_s": 1}})
    r = robot(catalog=catalog)
    r.servers.nav.script = ["hang"]
    status, result, _ = r.execute(plan=PLAN, max_replans=0)
    assert status == _aborted()
    assert (result.failed_step, result.failed_skill, result.failed_state) == \
        (0, "navigate_to", "timed_out")
    assert "no result within 1 s" in result.error
    assert wait_for(lambda: r.servers.nav.cancels == 1)
    assert r.sent() == 1


def test_cancelling_the_execution_cancels_the_running_step_and_sends_nothing_more(robot):
    r = robot()
    r.servers.nav.script = ["hang"]
    handle, feedback = r.send(plan=PLAN)
    assert wait_for(lambda: any(f.state == "running" for f in feedback))
    result_of(handle.cancel_goal_async())
    response = result_of(handle.get_result_async())
    from action_msgs.msg import GoalStatus

    assert response.status == GoalStatus.STATUS_CANCELED
    assert response.result.failed_state == "canceled"
    assert r.servers.nav.cancels == 1
    assert r.sent() == 1


def _approve(r, approve: bool, step: int = 0):
    """Answer the step once it waits (execution id left empty: the one running)."""
    def answer():
        assert wait_for(lambda: r.h.node._execute.approvals.waiting())
        request = r.Approve.Request(execution_id="", step_index=step, approve=approve)
        answered.append(result_of(r.approve.call_async(request)))

    answered: list = []
    thread = threading.Thread(target=answer)
    thread.start()
    return thread, answered


def test_a_step_marked_approve_waits_for_the_operator(robot):
    r = robot()
    plan = [{"skill": "open", "args": {"object": "fridge"}}]
    thread, answered = _approve(r, True)
    status, result, feedback = r.execute(plan=plan)
    thread.join(TIMEOUT)
    assert status == _succeeded(), result.error
    assert answered[0].accepted and "approved" in answered[0].message
    assert [f.state for f in feedback][:2] == ["waiting_approval", "sent"]
    assert r.servers.manip.goals[0]["verb"] == "open"


def test_a_denied_step_sends_nothing(robot):
    r = robot()
    thread, answered = _approve(r, False, step=1)
    plan = [{"skill": "say", "args": {"text": "opening"}},
            {"skill": "open", "args": {"object": "fridge"}}]
    status, result, _ = r.execute(plan=plan)
    thread.join(TIMEOUT)
    assert status == _aborted() and answered[0].accepted
    assert (result.failed_step, result.failed_state, result.replans) == (1, "denied", 0)
    assert "the operator denied it" in result.error
    assert r.servers.manip.goals == [] and len(r.servers.speech.goals) == 1


def test_an_approval_that_never_comes_is_a_refusal(robot):
    r = robot(**{"execution.approval_timeout_s": 0.3})
    status, result, _ = r.execute(plan=[{"skill": "open", "args": {"object": "fridge"}}])
    assert status == _aborted() and result.failed_state == "denied"
    assert "no approval within 0.3 s" in result.error
    assert r.sent() == 0
    answer = result_of(r.approve.call_async(r.Approve.Request(step_index=0, approve=True)))
    assert not answer.accepted and "waits for approval" in answer.message


@pytest.mark.parametrize("step,message", [
    ({"skill": "wait", "args": {"seconds": 120}}, "step 1 (wait): speed = 120 is above its "
                                                   "limit 30"),
    ({"skill": "navigate_to", "args": {"target": "garage"}}, "outside the workspace"),
    ({"skill": "navigate_to", "args": {"target": "attic"}},
     "location 'attic' is not in the location table"),
    ({"skill": "close", "args": {"object": "fridge"}}, "step 1 (close): the skill has no "
                                                        "binding"),
])
def test_the_safety_gate_refuses_the_whole_plan_before_anything_is_sent(robot, step,
                                                                         message):
    r = robot()
    status, result, _ = r.execute(plan=[PLAN[0], step])
    assert status == _aborted() and result.failed_state == "gate"
    assert message in result.error and "nothing sent" in result.error
    assert r.sent() == 0


def test_a_plan_that_does_not_validate_sends_nothing(robot):
    r = robot()
    status, result, _ = r.execute(plan=[{"skill": "fly", "args": {}}])
    assert status == _aborted() and "invalid plan_json, nothing sent" in result.error
    assert r.sent() == 0


def test_dry_run_publishes_every_goal_and_sends_none(robot):
    r = robot()
    status, result, feedback = r.execute(plan=PLAN, dry_run=True)
    assert status == _succeeded(), result.error
    assert wait_for(lambda: len(r.dry_runs) == len(PLAN))
    assert [d["server"] for d in r.dry_runs] == ["/navigate_to_pose", "/manipulate",
                                                 "/navigate_to_pose", "/manipulate", "/speak"]
    assert r.dry_runs[0]["goal"]["pose"]["pose"]["position"]["x"] == 2.0
    assert {f.state for f in feedback} == {"dry_run"}
    assert r.sent() == 0 and result.steps_done == 0


def test_one_execution_at_a_time(robot):
    r = robot()
    r.servers.nav.script = ["hang"]
    first, feedback = r.send(plan=PLAN)
    assert wait_for(lambda: any(f.state == "running" for f in feedback))
    status, result, _ = r.execute(plan=PLAN)
    assert status == _aborted() and result.failed_state == "refused"
    assert "one execution at a time" in result.error
    result_of(first.cancel_goal_async())
    result_of(first.get_result_async())
    assert r.sent() == 1


def test_a_missing_server_leaves_its_skill_out_until_it_comes_back(robot):
    r = robot(speak=False)
    planner = r.h.node._planner
    assert wait_for(lambda: "say" in planner.unavailable)
    assert "/speak" in planner.unavailable["say"]
    status, result, _ = r.execute(plan=[{"skill": "say", "args": {"text": "hi"}}])
    assert status == _aborted() and result.failed_state == "gate"
    assert "service server /speak is not on the graph" in result.error
    # the plan grammar leaves it out: a task asking for speech is planned without it
    status, plan_result = r.h.plan(task="say hello", thinking=False)
    if plan_result.success:
        assert "say" not in [s["skill"] for s in json.loads(plan_result.plan_json)["plan"]]
    else:
        assert "say: its service server /speak is not on the graph" in plan_result.error
    assert wait_for(lambda: any("skills unavailable" in values_of(s)
                                and "say" in values_of(s)["skills unavailable"]
                                for s in r.h.statuses()))
    r.servers.start_speak()
    assert wait_for(lambda: "say" not in planner.unavailable)
    status, result, _ = r.execute(plan=[{"skill": "say", "args": {"text": "hi"}}])
    assert status == _succeeded(), result.error
    assert r.servers.speech.goals == [{"text": "hi"}]


def test_execution_is_refused_with_the_reason_when_it_cannot_run(robot, harness, ros_context):
    r = robot(**{"execution.enabled": False})
    status, result, _ = r.execute(plan=PLAN)
    assert status == _aborted() and "execution.enabled is false" in result.error
    status, result, _ = r.execute()
    assert "execution is disabled" in result.error
    assert r.sent() == 0


def test_tasks_from_the_topic_are_planned_and_executed_when_asked(robot):
    from std_msgs.msg import String

    r = robot(**{"execution.from_task_topic": True})
    results: list[dict] = []
    r.h.client_node.create_subscription(String, "/flash_planner/execution",
                                        lambda m: results.append(json.loads(m.data)), 10)
    assert wait_for(lambda: r.h.node._runner is not None
                    and not r.h.node._planner.unavailable)
    r.h.task_pub.publish(String(data="go to the kitchen"))
    assert wait_for(lambda: results)
    assert results[0]["success"], results[0]["error"]
    assert results[0]["task"] == "go to the kitchen"
    assert [g["pose"]["pose"]["position"]["x"] for g in r.servers.nav.goals] == [2.0]
