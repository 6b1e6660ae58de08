"""A running execution under control, on real rclpy (the robot of test_node_execute.py): a
server's fast feedback reaches `~/execute` at a bounded rate with every state change, a
deactivate mid-step cancels the step and waits for it, `~/cancel_execution` stops a `~/task`
execution, and an exception inside an execution gives an error and a result.
"""

from __future__ import annotations

import json
import threading

import test_node_execute
from live import requires_ros, result_of, wait_for
from test_node_execute import PLAN, _aborted, _succeeded

pytestmark = requires_ros
robot = test_node_execute.robot   # the fixture: the planner node and the skill servers

FAST = 50    # feedback messages per goal, 1 ms apart: faster than a Nav2 behaviour tree ticks


def _status(name: str) -> int:
    from action_msgs.msg import GoalStatus

    return getattr(GoalStatus, f"STATUS_{name}")


def _feedback_topic(r):
    """Every ExecutePlan feedback message as the topic carried it, per goal: rclpy's client
    stops calling a goal's feedback callback once its result has arrived."""
    from flash_planner.ros.action_server import feedback_qos

    seen: dict[bytes, list] = {}
    lock = threading.Lock()

    def add(msg) -> None:
        with lock:
            seen.setdefault(bytes(msg.goal_id.uuid), []).append(msg.feedback)

    sub = r.h.client_node.create_subscription(
        r.ExecutePlan.Impl.FeedbackMessage, "/flash_planner/execute/_action/feedback", add,
        feedback_qos())
    assert wait_for(lambda: sub.get_publisher_count() > 0)

    def of(handle) -> list:
        with lock:
            return list(seen.get(bytes(handle.goal_id.uuid), ()))

    return of


def _executions(r) -> list[dict]:
    from std_msgs.msg import String

    results: list[dict] = []
    r.h.client_node.create_subscription(String, "/flash_planner/execution",
                                        lambda m: results.append(json.loads(m.data)), 10)
    return results


def _ready_for_tasks(r) -> None:
    assert wait_for(lambda: r.h.node._runner is not None
                    and not r.h.node._planner.unavailable)


def test_fast_server_feedback_is_throttled_and_every_state_change_arrives_in_order(robot):
    # a period longer than the run: each step relays its first feedback and its latest
    r = robot(server_args={"feedbacks": FAST, "pace_s": 0.001},
              **{"planner.feedback_period_ms": 10000.0})
    feedback_of = _feedback_topic(r)
    handle, _ = r.send(plan=PLAN[:2])
    response = result_of(handle.get_result_async())
    assert response.status == _succeeded(), response.result.error
    assert wait_for(lambda: (1, "succeeded") in [(f.step_index, f.state)
                                                 for f in feedback_of(handle)])
    feedback = feedback_of(handle)
    states = [(f.step_index, f.state) for f in feedback]
    assert [s for s in states if s[1] != "running"] == [
        (0, "sent"), (0, "succeeded"), (1, "sent"), (1, "succeeded")]
    running = [i for i, (_, state) in enumerate(states) if state == "running"]
    assert 1 <= len(running) <= 4 < 2 * FAST      # the servers published 2 * FAST
    for i in running:                              # each inside its own step
        step = states[i][0]
        assert states.index((step, "sent")) < i < states.index((step, "succeeded"))
    distances = [json.loads(feedback[i].message_json)["distance_remaining"] for i in running
                 if states[i][0] == 0]
    assert distances == sorted(distances, reverse=True)   # in the server's order


def test_deactivating_mid_step_cancels_it_and_waits_then_the_node_runs_again(robot, capfd):
    r = robot()
    r.servers.nav.script = ["hang"]
    handle, feedback = r.send(plan=PLAN)
    assert wait_for(lambda: any(f.state == "running" for f in feedback))
    r.h.transition("deactivate")
    # deactivate returned once the execution had ended: its step's cancel came first
    assert r.h.node._execute.current is None
    assert r.servers.nav.cancels == 1
    response = result_of(handle.get_result_async())
    assert response.status in (_status("CANCELED"), _aborted())
    assert response.result.failed_state == "canceled"
    assert "the planner node was deactivated" in response.result.error
    assert r.sent() == 1
    r.h.transition("activate")
    status, result, _ = r.execute(plan=PLAN[:1])
    assert status == _succeeded(), result.error
    assert "Traceback" not in capfd.readouterr().err


def test_a_task_execution_is_cancelled_through_cancel_execution(robot):
    from flash_planner_interfaces.srv import CancelExecution

    r = robot(**{"execution.from_task_topic": True})
    results = _executions(r)
    client = r.h.client_node.create_client(CancelExecution, "/flash_planner/cancel_execution")
    assert client.wait_for_service(timeout_sec=30)

    def cancel(execution_id: str = ""):
        return result_of(client.call_async(CancelExecution.Request(execution_id=execution_id)))

    answer = cancel()
    assert not answer.accepted and answer.message == "no execution is running"
    _ready_for_tasks(r)
    r.servers.nav.script = ["hang"]
    from std_msgs.msg import String

    r.h.task_pub.publish(String(data="go to the kitchen"))
    assert wait_for(lambda: r.servers.nav.goals)
    running = r.h.node._execute.current.id
    answer = cancel("another-execution")
    assert not answer.accepted and f"(running: {running})" in answer.message
    answer = cancel()
    assert answer.accepted and running in answer.message
    assert wait_for(lambda: results)
    assert results[0]["execution_id"] == running and not results[0]["success"]
    assert results[0]["failed_state"] == "canceled"
    assert "cancelled through ~/cancel_execution" in results[0]["error"]
    assert wait_for(lambda: r.servers.nav.cancels == 1)
    assert r.sent() == 1


def test_an_exception_in_an_execution_gives_an_error_and_a_result(robot, monkeypatch):
    from std_msgs.msg import String

    r = robot(**{"execution.from_task_topic": True})
    results = _executions(r)

    def broken(*args, **kwargs):
        raise TypeError("a runner bug")

    monkeypatch.setattr(r.h.node._runner, "run", broken)
    status, result, _ = r.execute(plan=PLAN[:1])
    assert status == _aborted()
    assert (result.success, result.failed_state) == (False, "error")
    assert result.error == "internal error: TypeError: a runner bug"
    _ready_for_tasks(r)
    r.h.task_pub.publish(String(data="go to the kitchen"))
    assert wait_for(lambda: results)
    assert (results[0]["failed_state"], results[0]["error"]) == (
        "error", "internal error: TypeError: a runner bug")
    monkeypatch.undo()                      # the node keeps serving
    status, result, _ = r.execute(plan=PLAN[:1])
    assert status == _succeeded(), result.error
    assert r.sent() == 1
