"""The `~/execute` action (ExecutePlan), the `~/approve` and `~/cancel_execution` services,
the `~/dry_run` topic and `~/execution` (the results of executions started from `~/task`):
plans run on the robot's own servers (planning/execution.py owns the policy; this is the ROS
side).

Like `~/plan`, the action exists in every lifecycle state: a goal while the node is not
active, while execution is disabled, or while another execution runs is accepted and ends
ABORTED with the reason (the action protocol's reject carries none). One execution at a
time per node (so per robot namespace): a second goal is refused, never queued, because two
plans driving one robot at once is never what was meant. The execute callback runs the whole
execution on its executor thread; a cancel request is accepted and reaches the running step
(its goal is cancelled on its server) and nothing after it is sent; `~/cancel_execution`
does the same for the running execution whichever door started it. Feedback goes through a
StepEventThrottle (execute_feedback.py, `planner.feedback_period_ms`). An exception inside
an execution ends it with failed_state "error", never without a result.
"""

from __future__ import annotations

import json
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..planning.execution import (
    Approvals,
    Execution,
    ExecutionConfig,
    ExecutionResult,
    StepEvent,
    StepRunner,
    service_replanner,
    steps_of,
)
from ..planning.parse import PlanError
from ..planning.skills import SkillCatalog
from . import convert
from .action_server import feedback_qos
from .execute_feedback import StepEventThrottle

MAX_REPLANS = 10   # the most replans a goal may ask for


@dataclass(frozen=True)
class ExecutionSetup:
    """What an execution needs from the configured node."""

    service: Any             # the planner service
    catalog: SkillCatalog
    runner: StepRunner
    config: ExecutionConfig


class ExecuteActionServer:
    """Owns the ExecutePlan action server, the Approve and CancelExecution services and the
    dry-run and execution publishers;
    `setup()` gives an ExecutionSetup or raises convert.NotServing with the reason."""

    def __init__(self, node, setup: Callable[[], ExecutionSetup], name: str,
                 feedback_period_s: float = 0.0):
        from rclpy.action import ActionServer
        from rclpy.callback_groups import ReentrantCallbackGroup
        from std_msgs.msg import String

        from flash_planner_interfaces.action import ExecutePlan
        from flash_planner_interfaces.srv import Approve, CancelExecution

        self._node, self._setup, self._type, self._string = node, setup, ExecutePlan, String
        self._feedback_period_s = feedback_period_s
        self.approvals = Approvals()
        self._lock = threading.Condition()
        self._current: Execution | None = None
        self._cancel_requests: set[str] = set()   # goal ids with a cancel request
        self._cancel_reason = ""   # why the current execution was cancelled, if not by its goal
        group = ReentrantCallbackGroup()
        self._dry_run = node.create_publisher(String, "~/dry_run", 10)
        self._executions = node.create_publisher(String, "~/execution", 10)
        self._approve = node.create_service(Approve, "~/approve", self._on_approve,
                                            callback_group=group)
        self._cancel_service = node.create_service(
            CancelExecution, "~/cancel_execution", self._on_cancel_execution,
            callback_group=group)
        self._server = ActionServer(
            node, ExecutePlan, name, execute_callback=self._execute,
            goal_callback=self._on_goal, handle_accepted_callback=lambda h: h.execute(),
            cancel_callback=self._on_cancel, callback_group=group,
            feedback_pub_qos_profile=feedback_qos())

    @property
    def current(self) -> Execution | None:
        return self._current

    def _on_goal(self, goal):
        from rclpy.action import GoalResponse

        return GoalResponse.ACCEPT

    def _on_cancel(self, goal_handle):
        from rclpy.action import CancelResponse

        execution_id = convert.goal_request_id(goal_handle.goal_id.uuid)
        with self._lock:   # recorded, for a cancel that comes before the run registers
            self._cancel_requests.add(execution_id)
            current = self._current
        if current is not None and current.id == execution_id:
            current.cancel()
        return CancelResponse.ACCEPT

    def _on_approve(self, request, response):
        response.accepted, response.message = self.approvals.answer(
            request.execution_id, request.step_index, request.approve, request.plan_index)
        return response

    def _on_cancel_execution(self, request, response):
        with self._lock:
            current = self._current
        if current is None:
            response.accepted, response.message = False, "no execution is running"
        elif request.execution_id and request.execution_id != current.id:
            response.accepted, response.message = False, (
                f"execution {request.execution_id} is not running (running: {current.id})")
        else:
            self.cancel_running("cancelled through ~/cancel_execution", current)
            response.accepted, response.message = True, (
                f"execution {current.id} cancelled: its running step's goal is cancelled on "
                "its server, nothing after it is sent")
        return response

    def _execute(self, goal_handle):
        execution_id = convert.goal_request_id(goal_handle.goal_id.uuid)
        try:
            result = self._run(goal_handle, execution_id)
        finally:
            with self._lock:
                self._cancel_requests.discard(execution_id)
        if result.success:
            goal_handle.succeed()
        elif goal_handle.is_cancel_requested:
            goal_handle.canceled()
        else:
            goal_handle.abort()
        if not result.success:
            self._node.get_logger().warning(f"execution {execution_id} failed: {result.error}")
        return convert.fill(self._type.Result(), result_fields(result))

    def _run(self, goal_handle, execution_id: str) -> ExecutionResult:
        throttle = StepEventThrottle(lambda e: self._feedback(goal_handle, execution_id, e),
                                     self._feedback_period_s)
        try:
            return self.run(execution_id, goal_handle.request, throttle.put)
        finally:
            throttle.close()   # what it holds goes out before the result

    def run(self, execution_id: str, goal, on_event: Callable[[StepEvent], None]
            ) -> ExecutionResult:
        """Run one execution (an ExecutePlan goal's fields) in this thread; an unexpected
        exception ends it with failed_state "error" (its traceback logged once) rather than
        leaving a goal without an error or a ~/task execution without a result."""
        try:
            return self._run_execution(execution_id, goal, on_event)
        except Exception as exc:
            self._node.get_logger().error(
                f"execution {execution_id}: internal error\n{traceback.format_exc()}")
            lines = str(exc).strip().splitlines()
            what = type(exc).__name__ + (f": {lines[0]}" if lines else "")
            return ExecutionResult().fail(-1, "", "error", f"internal error: {what}")

    def _run_execution(self, execution_id: str, goal, on_event: Callable[[StepEvent], None]
                       ) -> ExecutionResult:
        try:
            setup = self._setup()
        except convert.NotServing as exc:
            return ExecutionResult().fail(-1, "", "refused", str(exc))
        if not goal.task.strip() and not goal.plan_json.strip():
            return ExecutionResult().fail(-1, "", "refused", "the goal has neither a task nor "
                                          "a plan_json: give one")
        if not -1 <= goal.max_replans <= MAX_REPLANS:
            return ExecutionResult().fail(-1, "", "refused", f"max_replans must be -1 (the "
                                          f"node's) or 0-{MAX_REPLANS}, got {goal.max_replans}")
        steps = None
        if goal.plan_json.strip():
            try:
                steps = steps_of(goal.plan_json, setup.catalog)
            except PlanError as exc:
                return ExecutionResult().fail(-1, "", "gate", f"invalid plan_json, nothing "
                                              f"sent: {exc}")
        config = ExecutionConfig(
            setup.config.max_replans if goal.max_replans < 0 else goal.max_replans,
            setup.config.approval_timeout_s, goal.dry_run or setup.config.dry_run)
        execution = Execution(execution_id, setup.catalog, setup.runner,
                              service_replanner(setup.service), self.approvals, config,
                              on_event, self._publish_dry_run)
        with self._lock:
            if self._current is not None:
                return ExecutionResult().fail(-1, "", "refused", (
                    f"execution {self._current.id} is running: one execution at a time "
                    "per node; cancel it or wait for its result"))
            self._current, self._cancel_reason = execution, ""
            if execution_id in self._cancel_requests:
                execution.cancel()
        try:
            result = execution.run(goal.task.strip(), goal.context, tuple(goal.scene), steps)
        finally:
            with self._lock:
                self._current, reason = None, self._cancel_reason
                self._lock.notify_all()
        if result.failed_state == "canceled" and reason:
            result.error += f" ({reason})"
        return result

    def run_task(self, request) -> None:
        """Plan and execute a ~/task request (execution.from_task_topic) in a thread of its
        own: its steps are logged, its result published on ~/execution as JSON."""
        goal = self._type.Goal(task=request.task, context=request.context,
                               scene=list(request.scene), max_replans=-1)
        log = self._node.get_logger()

        def run() -> None:
            # a server's feedback (running) can come on every tick of its loop: DEBUG
            result = self.run(request.id, goal, lambda e: (
                log.debug if e.state == "running" else log.info)(
                f"execution {request.id}: plan {e.plan_index} step {e.step_index} "
                f"{e.skill} {e.state} {e.detail}".rstrip()))
            if not result.success:
                log.warning(f"execution {request.id} failed: {result.error}")
            self._executions.publish(self._string(data=json.dumps(
                {"execution_id": request.id, "task": request.task, **result_fields(result)},
                sort_keys=True)))

        threading.Thread(target=run, name=f"execution-{request.id}", daemon=True).start()

    def _feedback(self, goal_handle, execution_id: str, event: StepEvent) -> None:
        msg = convert.fill(self._type.Feedback(), feedback_fields(execution_id, event))
        goal_handle.publish_feedback(msg)

    def _publish_dry_run(self, record: dict[str, Any]) -> None:
        self._dry_run.publish(self._string(data=json.dumps(record, sort_keys=True)))

    def cancel_running(self, reason: str = "", execution: Execution | None = None) -> None:
        """Cancel the running execution (or `execution`, if it still runs), if any: its
        step's goal is cancelled on its server, nothing after it is sent; `reason` is added
        to its result's error."""
        with self._lock:
            current = self._current
            if current is None or (execution is not None and current is not execution):
                return
            if reason and not self._cancel_reason:
                self._cancel_reason = reason
        current.cancel()

    def wait_idle(self, timeout: float) -> bool:
        """Wait (bounded) until no execution runs; True if none does."""
        with self._lock:
            return self._lock.wait_for(lambda: self._current is None, timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Cancel a running execution, wait (bounded) for it, destroy the servers."""
        self.cancel_running()
        self.wait_idle(timeout)
        self._server.destroy()
        self._node.destroy_service(self._approve)
        self._node.destroy_service(self._cancel_service)
        self._node.destroy_publisher(self._dry_run)
        self._node.destroy_publisher(self._executions)


def result_fields(result: ExecutionResult) -> dict[str, Any]:
    """ExecutePlan.Result fields of an execution's result."""
    return {"success": result.success, "steps_done": int(result.steps_done),
            "failed_step": int(result.failed_step), "failed_skill": result.failed_skill,
            "failed_state": result.failed_state, "error": result.error,
            "replans": int(result.replans), "plans_json": json.dumps(result.plans)}


def feedback_fields(execution_id: str, event: StepEvent) -> dict[str, Any]:
    """ExecutePlan.Feedback fields of one step event."""
    return {"execution_id": execution_id, "plan_index": int(event.plan_index),
            "step_index": int(event.step_index), "step_path": event.path or str(event.step_index),
            "skill": event.skill, "state": event.state,
            "detail": event.detail,
            "message_json": "" if event.message is None else json.dumps(event.message,
                                                                        sort_keys=True)}
