"""The planner node on real rclpy: lifecycle, the Plan action, ~/task, ~/plan, /diagnostics.

Runs only where a sourced ROS 2 Jazzy provides rclpy and diagnostic_updater and the
workspace has flash_planner_interfaces built; elsewhere every test here is skipped (the same
paths run on stand-in modules in test_node_fake.py). The tiny random model never produces a
valid plan, so a finished goal is ABORTED with the parse error; the cancel test uses a model
that never stops (conftest.endless_dir).
"""

from __future__ import annotations

import json
import threading
import time
from importlib.util import find_spec

import pytest

from flash_planner.ros.node import NODE_NAME, planner_node_class

NO_RCLPY = "rclpy is not installed (ROS 2 runtime tests need a sourced ROS 2 Jazzy)"
TIMEOUT = 120.0
PLAN_ACTION = f"/{NODE_NAME}/plan"


def _missing() -> str | None:
    """Why these tests cannot run here, or None."""
    if find_spec("rclpy") is None:
        return NO_RCLPY
    for module, fix in (("diagnostic_updater", "apt install ros-jazzy-diagnostic-updater"),
                        ("flash_planner_interfaces", "colcon build, then source the "
                                                     "workspace's install/setup.bash")):
        if find_spec(module) is None:
            return f"{module} is not importable ({fix})"
    return None


MISSING = _missing()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")

if MISSING is None:
    import rclpy
    from action_msgs.msg import GoalStatus
    from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
    from rclpy.action import ActionClient
    from rclpy.context import Context
    from rclpy.executors import MultiThreadedExecutor
    from rclpy.lifecycle import TransitionCallbackReturn
    from rclpy.parameter import Parameter
    from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
    from std_msgs.msg import String

    from flash_planner_interfaces.action import Plan


def wait_for(predicate, timeout: float = TIMEOUT) -> bool:
    """Poll `predicate` from the test thread while the executor spins in its own."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def result_of(future, timeout: float = TIMEOUT):
    assert wait_for(future.done, timeout), "timed out waiting for a future"
    return future.result()


@pytest.fixture(scope="module")
def context():
    ctx = Context()
    rclpy.init(context=ctx)
    yield ctx
    if ctx.ok():
        rclpy.shutdown(context=ctx)


class Harness:
    """The planner node plus a client node, both spun by one MultiThreadedExecutor."""

    def __init__(self, context, **overrides):
        values = {"model.device": "cpu", "model.dtype": "fp32", "autostart": False,
                  "engine.max_context": 2048, "diagnostics.period_s": 0.2, **overrides}
        self.node = planner_node_class()(
            context=context,
            parameter_overrides=[Parameter(k, value=v) for k, v in values.items()])
        self.client_node = rclpy.create_node("plan_test_client", context=context)
        self.client = ActionClient(self.client_node, Plan, PLAN_ACTION)
        self.plans: list[dict] = []
        self.diagnostics: list = []
        latched = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE,
                             durability=DurabilityPolicy.TRANSIENT_LOCAL)
        self.client_node.create_subscription(
            String, f"/{NODE_NAME}/plan", lambda m: self.plans.append(json.loads(m.data)),
            latched)
        self.client_node.create_subscription(DiagnosticArray, "/diagnostics",
                                             self.diagnostics.append, 10)
        self.task_pub = self.client_node.create_publisher(String, f"/{NODE_NAME}/task", 10)
        self.executor = MultiThreadedExecutor(num_threads=8, context=context)
        self.executor.add_node(self.node)
        self.executor.add_node(self.client_node)
        self.thread = threading.Thread(target=self.executor.spin, daemon=True)
        self.thread.start()

    def bring_up(self) -> None:
        assert self.node.trigger_configure() == TransitionCallbackReturn.SUCCESS
        assert self.node.trigger_activate() == TransitionCallbackReturn.SUCCESS
        assert self.client.wait_for_server(timeout_sec=30)

    def statuses(self) -> list:
        """Our DiagnosticStatus entries received so far, oldest first."""
        name = f"{NODE_NAME}: planner"
        return [s for array in list(self.diagnostics) for s in array.status if s.name == name]

    def close(self) -> None:
        self.node.stop_planner()
        self.executor.shutdown()
        self.thread.join(10)
        self.client.destroy()
        self.client_node.destroy_node()
        self.node.destroy_node()


@pytest.fixture
def harness(context):
    made = []

    def make(**overrides):
        made.append(Harness(context, **overrides))
        return made[-1]

    yield make
    for h in made:
        h.close()


def _values(status) -> dict[str, str]:
    return {kv.key: kv.value for kv in status.values}


def test_goal_streams_feedback_and_aborts_with_the_error(harness, hybrid_dir):
    h = harness(**{"model.path": str(hybrid_dir)})
    h.bring_up()
    feedback = []
    goal = Plan.Goal(task="pick up the red cup", context="", max_new_tokens=16,
                     enable_thinking=False)
    goal_handle = result_of(h.client.send_goal_async(goal, feedback_callback=feedback.append))
    assert goal_handle.accepted
    response = result_of(goal_handle.get_result_async())
    assert response.status == GoalStatus.STATUS_ABORTED
    result = response.result
    assert not result.success and result.error and result.plan_json == ""
    assert result.telemetry.new_tokens > 0 and result.telemetry.finish_reason
    assert wait_for(lambda: feedback, 10)
    assert feedback[0].feedback.tokens_so_far >= 1

    request_id = bytes(goal_handle.goal_id.uuid).hex()
    assert result.telemetry.request_id == request_id
    assert wait_for(lambda: any(p["id"] == request_id for p in h.plans))
    published = next(p for p in h.plans if p["id"] == request_id)
    assert published["success"] is False and published["error"] == result.error

    assert wait_for(lambda: any(_values(s).get("requests failed") == "1"
                                for s in h.statuses()))
    status = h.statuses()[-1]
    assert _values(status)["state"] == "active"
    assert status.level in (DiagnosticStatus.OK, DiagnosticStatus.WARN, DiagnosticStatus.ERROR)


def test_cancel_a_running_goal(harness, endless_dir):
    h = harness(**{"model.path": str(endless_dir), "engine.max_context": 8192})
    h.bring_up()
    first = threading.Event()
    goal = Plan.Goal(task="pick up the red cup", context="", max_new_tokens=4000,
                     enable_thinking=False)
    goal_handle = result_of(h.client.send_goal_async(goal,
                                                     feedback_callback=lambda _: first.set()))
    assert goal_handle.accepted and first.wait(TIMEOUT)
    cancel = result_of(goal_handle.cancel_goal_async())
    assert len(cancel.goals_canceling) == 1
    response = result_of(goal_handle.get_result_async())
    assert response.status == GoalStatus.STATUS_CANCELED
    assert "cancel" in response.result.error
    assert 0 < response.result.telemetry.new_tokens < 4000


def test_invalid_task_message_gets_a_failed_result_on_plan(harness, hybrid_dir):
    h = harness(**{"model.path": str(hybrid_dir)})
    h.bring_up()
    assert wait_for(lambda: h.task_pub.get_subscription_count() > 0, 30)
    h.task_pub.publish(String(data='{"task": "pick", "colour": "red"}'))
    assert wait_for(lambda: any("unknown request field" in p.get("error", "")
                                for p in h.plans))
    h.task_pub.publish(String(data="pick up the red cup"))
    assert wait_for(lambda: any(p.get("task") == "pick up the red cup" for p in h.plans))


def test_failed_configure_keeps_the_node_and_reports_error(harness):
    h = harness(**{"model.preset": ""})  # no preset, no model.path
    assert h.node.trigger_configure() == TransitionCallbackReturn.FAILURE
    assert wait_for(lambda: any(s.level == DiagnosticStatus.ERROR
                                and "model failed to load" in s.message
                                for s in h.statuses()))


def test_lifecycle_round_trip(harness, hybrid_dir):
    h = harness(**{"model.path": str(hybrid_dir)})
    h.bring_up()
    node = h.node
    assert node.trigger_deactivate() == TransitionCallbackReturn.SUCCESS
    assert node.trigger_cleanup() == TransitionCallbackReturn.SUCCESS
    h.bring_up()  # configure + activate again: nothing declared or created twice
    goal = Plan.Goal(task="open the drawer", context="", max_new_tokens=8,
                     enable_thinking=False)
    goal_handle = result_of(h.client.send_goal_async(goal))
    assert result_of(goal_handle.get_result_async()).status == GoalStatus.STATUS_ABORTED
