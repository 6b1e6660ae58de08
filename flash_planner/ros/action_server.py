"""The `~/plan` action server: goals go straight to the planner service, which owns policy.

The server exists in every lifecycle state of the node: a goal while the node is not active
is accepted and ends ABORTED with the reason (the action protocol's reject carries none).
Callbacks are kept apart as in ros2/examples: the goal callback accepts at once (never
blocks: queueing, preemption and rejection are the service's), the cancel callback accepts,
the accepted callback starts execution, and the execute callback submits the request, streams
feedback and polls for a cancel between waits on the ticket. Runs in a ReentrantCallbackGroup
on a MultiThreadedExecutor; rclpy is imported when the server is built, not at import time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ..planning.request import PlanResult
from ..planning.service import UnknownRequestError
from . import convert

POLL_S = 0.02  # how often a waiting goal looks for a cancel request


class PlanActionServer:
    """Owns one rclpy ActionServer for Plan; `service()` gives the serving planner service."""

    def __init__(self, node, service: Callable, name: str):
        from rclpy.action import ActionServer
        from rclpy.callback_groups import ReentrantCallbackGroup

        from flash_planner_interfaces.action import Plan

        self._node, self._service, self._type = node, service, Plan
        self._idle = threading.Condition()
        self._running = 0
        self._server = ActionServer(
            node, Plan, name, execute_callback=self._execute, goal_callback=self._on_goal,
            handle_accepted_callback=self._on_accepted, cancel_callback=self._on_cancel,
            callback_group=ReentrantCallbackGroup())

    def _on_goal(self, goal):
        """Accept every goal at once; the service queues, preempts or rejects it."""
        from rclpy.action import GoalResponse

        return GoalResponse.ACCEPT

    def _on_accepted(self, goal_handle) -> None:
        """Start executing (the executor runs `_execute` on a free thread)."""
        goal_handle.execute()

    def _on_cancel(self, goal_handle):
        """Accept cancel requests; `_execute` forwards them to the service."""
        from rclpy.action import CancelResponse

        return CancelResponse.ACCEPT

    def _execute(self, goal_handle):
        """Run one goal to its terminal state and return the Plan result message."""
        with self._idle:
            self._running += 1
        try:
            result = self._plan(goal_handle)
            getattr(goal_handle, convert.terminal_state(result.success,
                                                        goal_handle.is_cancel_requested))()
            msg = convert.fill(self._type.Result(), convert.result_fields(result))
            msg.telemetry.stamp = self._node.get_clock().now().to_msg()
            return msg
        finally:
            with self._idle:
                self._running -= 1
                self._idle.notify_all()

    def _plan(self, goal_handle) -> PlanResult:
        """Submit the goal and wait for its result, forwarding a cancel request once."""
        request_id = convert.goal_request_id(goal_handle.goal_id.uuid)
        if goal_handle.is_cancel_requested:  # cancelled before execution began
            return PlanResult(request_id, goal_handle.request.task, False,
                              error="cancelled before it started", finish_reason="cancelled")
        request = convert.goal_to_request(goal_handle.request, request_id)
        try:
            service = self._service()
        except convert.NotServing as exc:
            return convert.refused(str(exc), request.task, request_id)
        ticket = service.submit(request, lambda fb: self._feedback(goal_handle, fb))
        forwarded = False
        while True:
            if not forwarded and goal_handle.is_cancel_requested:
                forwarded = True
                try:
                    service.cancel(ticket.id)
                except UnknownRequestError:  # it finished (or was refused) meanwhile
                    pass
            try:
                return ticket.result(timeout=POLL_S)
            except TimeoutError:
                pass

    def _feedback(self, goal_handle, feedback) -> None:
        """Publish one feedback message (called from the service's worker thread)."""
        msg = convert.fill(self._type.Feedback(), convert.feedback_fields(feedback))
        goal_handle.publish_feedback(msg)

    def wait_idle(self, timeout: float) -> bool:
        """Wait (bounded) until no goal is executing; True if none is."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._running and time.monotonic() < deadline:
                self._idle.wait(deadline - time.monotonic())
            return not self._running

    def close(self, timeout: float = 5.0) -> None:
        """Wait (bounded) for running goals to finish, then destroy the action server."""
        self.wait_idle(timeout)
        self._server.destroy()
