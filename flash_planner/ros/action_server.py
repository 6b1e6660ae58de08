"""The `~/plan` action server: goals go straight to the planner service, which owns policy.

The server exists in every lifecycle state of the node: a goal while the node is not active
is accepted and ends ABORTED with the reason (the action protocol's reject carries none).
Callbacks are kept apart as in ros2/examples: the goal callback accepts at once (never
blocks: queueing, preemption and rejection are the service's), the accepted callback starts
execution, the execute callback submits the request, streams feedback and waits on the
ticket, and the cancel callback accepts and forwards the cancel to the service. Runs in a
ReentrantCallbackGroup on a MultiThreadedExecutor; rclpy is imported when the server is
built, not at import time.

Goals run concurrently: each executes on an executor thread of its own, which it holds until
its result (the node sizes its executor for engine.max_batch running goals and a full queue,
`node.executor_threads`); up to max_batch decode together in the planner's batch, the rest
wait in its queue. Each goal has its own feedback throttle, so its feedback carries only its
own text and steps, and a cancel reaches its own request alone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace

from ..planning.request import PlanRequest, PlanResult, RequestError
from ..planning.service import PlanFeedback, UnknownRequestError
from . import convert

# One feedback topic carries every goal's messages, and a message holds only the text since the
# last one: a goal's text is lost with any message a subscriber's history drops. At the
# default depth of 10, four goals decoding at once on a loaded machine overflowed a client's
# history (a goal's last message never arrived). Clients that rebuild the text subscribe as
# deep (`feedback_qos`, ActionClient's feedback_sub_qos_profile).
FEEDBACK_DEPTH = 1000


def feedback_qos():
    """The QoS of `~/plan`'s and `~/execute`'s feedback: reliable, FEEDBACK_DEPTH deep."""
    from rclpy.qos import QoSProfile, ReliabilityPolicy

    return QoSProfile(depth=FEEDBACK_DEPTH, reliability=ReliabilityPolicy.RELIABLE)


class FeedbackThrottle:
    """At most one feedback message per `period_s` for one goal; the first goes out at once.

    Feedback arriving in between is merged (texts and closed steps joined, latest counters)
    and goes out with the next message or at `flush`, so nothing is lost; feedback that
    closes a plan step goes out at once, so a robot can start the step without waiting. Each
    rclpy publish costs the decoding thread ~0.25 ms (bench/ros_overhead.py), which per
    speculative cycle is a visible share of a small model's plan. `put` runs on the planner's
    scheduler thread, which decodes every request in flight, so it never waits: it merges or
    publishes (a keep-last publish does not block). `flush` runs after the request finished
    (so after the last `put`): no lock is needed.
    """

    def __init__(self, publish: Callable[[PlanFeedback], None], period_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self._publish, self._period, self._clock = publish, period_s, clock
        self._last: float | None = None
        self._pending: PlanFeedback | None = None

    def put(self, feedback: PlanFeedback) -> None:
        if self._pending is not None:
            feedback = replace(feedback,
                               delta_text=self._pending.delta_text + feedback.delta_text,
                               steps=self._pending.steps + feedback.steps)
        now = self._clock()
        if self._last is None or now - self._last >= self._period or feedback.steps:
            self._pending, self._last = None, now
            self._publish(feedback)
        else:
            self._pending = feedback

    def flush(self) -> None:
        """Publish what is held back, if anything."""
        if self._pending is not None:
            feedback, self._pending = self._pending, None
            self._publish(feedback)


class PlanActionServer:
    """Owns one rclpy ActionServer for Plan; `service()` gives the serving planner service."""

    def __init__(self, node, service: Callable, name: str, feedback_period_s: float = 0.0,
                 with_frame: Callable[[PlanRequest], PlanRequest] = lambda r: r):
        """`with_frame` adds the image topic's latest frame to a goal's request (node.py)."""
        from rclpy.action import ActionServer
        from rclpy.callback_groups import ReentrantCallbackGroup

        from flash_planner_interfaces.action import Plan

        self._node, self._service, self._type = node, service, Plan
        self._feedback_period_s = feedback_period_s
        self._with_frame = with_frame
        self._idle = threading.Condition()  # guards the three fields below
        self._running = 0
        self._submitted: dict[str, object] = {}     # request id -> the service it went to
        self._cancel_requests: set[str] = set()     # request ids with a cancel request
        self._server = ActionServer(
            node, Plan, name, execute_callback=self._execute, goal_callback=self._on_goal,
            handle_accepted_callback=self._on_accepted, cancel_callback=self._on_cancel,
            feedback_pub_qos_profile=feedback_qos(), callback_group=ReentrantCallbackGroup())

    def _on_goal(self, goal):
        """Accept every goal at once; the service queues, preempts or rejects it."""
        from rclpy.action import GoalResponse

        return GoalResponse.ACCEPT

    def _on_accepted(self, goal_handle) -> None:
        """Start executing (the executor runs `_execute` on a free thread)."""
        goal_handle.execute()

    def _on_cancel(self, goal_handle):
        """Accept a cancel request and forward it to the service (or `_plan` will)."""
        from rclpy.action import CancelResponse

        request_id = convert.goal_request_id(goal_handle.goal_id.uuid)
        with self._idle:
            self._cancel_requests.add(request_id)
            service = self._submitted.get(request_id)
        if service is not None:
            _cancel(service, request_id)
        return CancelResponse.ACCEPT

    def _execute(self, goal_handle):
        """Run one goal to its terminal state and return the Plan result message."""
        with self._idle:
            self._running += 1
        try:
            result = self._plan(goal_handle)
            getattr(goal_handle, convert.terminal_state(result.success,
                                                        goal_handle.is_cancel_requested))()
            msg = convert.fill(self._type.Result(), convert.result_fields(result,
                                                                          self._catalog()))
            msg.telemetry.stamp = self._node.get_clock().now().to_msg()
            return msg
        finally:
            request_id = convert.goal_request_id(goal_handle.goal_id.uuid)
            with self._idle:
                self._running -= 1
                self._submitted.pop(request_id, None)
                self._cancel_requests.discard(request_id)
                self._idle.notify_all()

    def _catalog(self):
        """The catalog plans are made from now (None when the node is not serving)."""
        try:
            return self._service().catalog
        except convert.NotServing:
            return None

    def _plan(self, goal_handle) -> PlanResult:
        """Submit the goal and wait for its result (no polling: a wake-up costs the decoding
        thread the GIL, measurably on a small model; cancels arrive through `_on_cancel`)."""
        request_id = convert.goal_request_id(goal_handle.goal_id.uuid)
        with self._idle:  # `_on_cancel` records a cancel before rclpy marks the handle
            early = request_id in self._cancel_requests
        if early:  # cancelled before execution began
            return PlanResult(request_id, goal_handle.request.task, False,
                              error="cancelled before it started", finish_reason="cancelled")
        try:
            service = self._service()
            request = self._with_frame(convert.goal_to_request(goal_handle.request,
                                                               request_id))
        except convert.NotServing as exc:
            return convert.refused(str(exc), goal_handle.request.task, request_id)
        except RequestError as exc:        # an image that cannot be read, no usable frame
            return convert.refused(f"invalid request: {exc}", goal_handle.request.task,
                                   request_id)
        feedback = FeedbackThrottle(lambda fb: self._feedback(goal_handle, fb),
                                    self._feedback_period_s)
        ticket = service.submit(request, feedback.put)
        with self._idle:  # a cancel that came before this point is forwarded here
            self._submitted[request_id] = service
            cancel = request_id in self._cancel_requests
        if cancel:
            _cancel(service, request_id)
        result = ticket.result()
        feedback.flush()  # before the result, which must not overtake it
        return result

    def _feedback(self, goal_handle, feedback) -> None:
        """Publish one feedback message (called from the service's scheduler thread)."""
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


def _cancel(service, request_id: str) -> None:
    try:
        service.cancel(request_id)
    except UnknownRequestError:  # it finished (or was refused) meanwhile
        pass
