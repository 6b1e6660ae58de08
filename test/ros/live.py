"""Helpers of the node's live tests on real rclpy: the harness and waiting for futures.

rclpy comes from ROS 2 Jazzy's PyPI wheels installed by `make test` (tools/ros_env.sh) or
from a sourced ROS 2; flash_planner_interfaces is built by the same script. Where neither is
possible the live tests skip with a reason that says what to do (never under CI on x86_64:
test_ros_env.py asserts it).
"""

from __future__ import annotations

import json
import os
import threading
import time
from importlib.util import find_spec

import pytest

NODE = "flash_planner"
TIMEOUT = 120.0
ENDLESS_TOKENS = 6000  # a goal on conftest.endless_dir's model that never ends by itself
CLIENT_THREADS = 2     # the harness executor's threads for the client node, beside the node's


def ros_missing() -> str | None:
    """Why the node cannot run on real rclpy here (with what to do), or None."""
    how = ("run the tests with `make test`, which installs ROS 2 Jazzy's wheels on x86_64 "
           "Linux with Python 3.10-3.12, or source a ROS 2 Jazzy setup.bash first")
    why = os.environ.get("FLASH_PLANNER_ROS_ENV", "")
    if find_spec("rclpy") is None:
        return f"rclpy is not importable: {how}" + (f" ({why})" if why.startswith("none") else "")
    if find_spec("flash_planner_interfaces") is None:
        return ("flash_planner_interfaces is not importable: `make test` builds it "
                "(tools/ros_env.sh); with a sourced ROS 2, colcon build it and source "
                "install/setup.bash")
    return None


MISSING = ros_missing()
requires_ros = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")


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


class Harness:
    """The planner node and a client node (action client, topics), spun in one thread."""

    def __init__(self, context, **overrides):
        import rclpy
        from diagnostic_msgs.msg import DiagnosticArray
        from rclpy.action import ActionClient
        from rclpy.executors import MultiThreadedExecutor
        from rclpy.parameter import Parameter
        from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
        from std_msgs.msg import String

        from flash_planner.ros.action_server import feedback_qos
        from flash_planner.ros.node import planner_node_class
        from flash_planner_interfaces.action import Plan
        from flash_planner_interfaces.msg import PlanTelemetry

        values = {"model.device": "cpu", "model.dtype": "fp32", "autostart": False,
                  "diagnostics.period_s": 0.2, **overrides}
        self.context, self.Plan = context, Plan
        self.node = planner_node_class()(
            context=context,
            parameter_overrides=[Parameter(k, value=v) for k, v in values.items()])
        self.client_node = rclpy.create_node("plan_test_client", context=context)
        self.client = ActionClient(self.client_node, Plan, f"/{NODE}/plan",
                                   feedback_sub_qos_profile=feedback_qos())
        self.plans: list[dict] = []
        # every goal's feedback as the topic carried it (`feedback_of`)
        self._feedback: dict[bytes, list] = {}
        self._feedback_lock = threading.Lock()
        self.telemetry: list = []
        self.diagnostics: list = []
        latched = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE,
                             durability=DurabilityPolicy.TRANSIENT_LOCAL)
        sub = self.client_node.create_subscription
        sub(String, f"/{NODE}/plan", lambda m: self.plans.append(json.loads(m.data)), latched)
        sub(PlanTelemetry, f"/{NODE}/telemetry", self.telemetry.append, 10)
        sub(DiagnosticArray, "/diagnostics", self.diagnostics.append, 10)
        sub(Plan.Impl.FeedbackMessage, f"/{NODE}/plan/_action/feedback", self._feedback_seen,
            feedback_qos())
        self.task_pub = self.client_node.create_publisher(String, f"/{NODE}/task", 10)
        # sized as planner_node sizes its own (max_batch running goals, a full queue,
        # spares), plus the client node's callbacks: goals run concurrently here too
        self.executor = MultiThreadedExecutor(
            num_threads=self.node.executor_threads() + CLIENT_THREADS, context=context)
        self.executor.add_node(self.node)
        self.executor.add_node(self.client_node)
        self._spinning = True
        self.wait_set_races = 0    # spins lost to an entity destroyed meanwhile (_spin)
        self.thread = threading.Thread(target=self._spin, name="harness-executor", daemon=True)
        self.thread.start()
        assert self.client.wait_for_server(timeout_sec=30)

    def _feedback_seen(self, msg) -> None:
        with self._feedback_lock:
            self._feedback.setdefault(bytes(msg.goal_id.uuid), []).append(msg.feedback)

    def feedback_of(self, handle) -> list:
        """Every feedback message of the goal of `handle` so far, in order, read from the
        action's feedback topic itself: rclpy's ActionClient stops calling a goal's feedback
        callback once its result has arrived, and the result (a service response) can
        arrive before the last feedback (a topic message) that was published before it."""
        with self._feedback_lock:
            return list(self._feedback.get(bytes(handle.goal_id.uuid), ()))

    def _spin(self) -> None:
        from rclpy._rclpy_pybind11 import InvalidHandle, RCLError

        while self._spinning and self.context.ok():
            try:
                self.executor.spin_once(timeout_sec=0.05)
            except (InvalidHandle, RCLError) as exc:
                # A server a test destroys (a server leaving the graph, the fixture's
                # teardown) can be destroyed between the executor listing a node's entities
                # and adding them to its wait set: that spin fails, the next one lists the
                # node without it. Anything else still ends the thread.
                if "invalid" not in str(exc) and "destruction was requested" not in str(exc):
                    raise
                self.wait_set_races += 1

    def transition(self, *names: str) -> None:
        """Trigger lifecycle transitions in order; each must succeed."""
        from rclpy.lifecycle import TransitionCallbackReturn

        for name in names:
            result = getattr(self.node, f"trigger_{name}")()
            assert result == TransitionCallbackReturn.SUCCESS, (name, result)

    def bring_up(self) -> None:
        self.transition("configure", "activate")

    def goal(self, task: str = "bring the red cup from the kitchen table to the sink",
             max_new_tokens: int = 0, thinking: bool = True, client=None, on_feedback=None,
             sampling: str = "", seed: int = 0, scene: list[str] | None = None,
             images: list | None = None):
        """Send a goal (`images`: sensor_msgs/Image messages); returns its accepted goal
        handle."""
        goal = self.Plan.Goal(task=task, context="", scene=scene or [], images=images or [],
                              max_new_tokens=max_new_tokens, enable_thinking=thinking,
                              sampling=sampling, seed=seed)
        handle = result_of((client or self.client).send_goal_async(
            goal, feedback_callback=on_feedback))
        assert handle.accepted
        return handle

    def running_goal(self, **kwargs):
        """A long goal (on the endless model) that has produced its first feedback."""
        first = threading.Event()
        handle = self.goal(max_new_tokens=ENDLESS_TOKENS, thinking=False,
                           on_feedback=lambda _: first.set(), **kwargs)
        assert first.wait(TIMEOUT)
        return handle

    def plan(self, **kwargs):
        """Send a goal and wait for its (status, result)."""
        response = result_of(self.goal(**kwargs).get_result_async())
        return response.status, response.result

    def statuses(self) -> list:
        """Our DiagnosticStatus entries received so far, oldest first."""
        name = f"{NODE}: planner"
        return [s for array in list(self.diagnostics) for s in array.status if s.name == name]

    def close(self) -> None:
        self.node.stop_planner()
        # rclpy 7.1.6's Executor.shutdown destroys its guard condition without waiting (its
        # wait tests the flag it has just set): a spin() still inside it then hands a callback
        # to the pool that triggers the destroyed guard, and the spinning thread dies with
        # InvalidHandle. So the loop ends first, its last callbacks finish, then shutdown.
        self._spinning = False
        self.executor.wake()
        self.thread.join(10)
        pending = list(getattr(self.executor, "_futures", ()))    # the pool's callbacks
        end = time.monotonic() + 10
        while any(not task.done() for task in pending) and time.monotonic() < end:
            time.sleep(0.01)
        self.executor.shutdown()
        self.client.destroy()
        self.client_node.destroy_node()
        self.node.destroy_node()


def values_of(status) -> dict[str, str]:
    return {kv.key: kv.value for kv in status.values}
