"""The robot side of execution: one ActionClient or service client per bound skill, made at
configure, and `run` (execution.StepRunner): send one goal, relay its feedback, wait for
its end under the binding's timeout, cancel it on request.

A step's end is read from the server: an action's goal status (SUCCEEDED, ABORTED, CANCELED)
and its result message, a service's response. A result or response with a boolean `success`
field set false counts as aborted (std_srvs' and most skill servers' convention), with its
`message` (or `error_msg`) as the reason. A timeout or a cancel sends the server a cancel and
waits up to CANCEL_GRACE_S for it to end the goal; a timeout whose cancel the server does not
confirm in that time is "unconfirmed" (the goal may still run). A service call cannot be
cancelled: on a cancel or timeout the call is abandoned (its response ignored) and that is
said; past its timeout it is "unconfirmed" too.

While a goal runs, its server is looked up on the graph: missing for longer than the node's
execution.check_period_s plus LIVENESS_GRACE_S, the step ends "unavailable" with its end not
confirmed (a cancel is still sent, in case the server is only cut off). A server that exits
leaves the graph at once; one whose process is killed leaves it when DDS notices (Fast DDS:
its participant's lease, 20 s by default).

rclpy is imported when the runner is built; the waits run on the calling (execute) thread
while the node's MultiThreadedExecutor completes the futures on its others.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

from ..planning.bindings import Binding
from ..planning.execution import POLL_S, StepOutcome
from .binding_types import interface_class
from .messages import to_fields, to_message

CANCEL_GRACE_S = 5.0   # how long a cancelled goal may take to end on its server
# How long configure waits for discovery to find the bound servers before the first check
# (a client made a moment ago has not heard of a server that has long been up).
DISCOVERY_S = 2.0
# How much longer than one check period a running goal's server may be off the graph before
# the step ends: discovery can miss a server for a moment without it being gone.
LIVENESS_GRACE_S = 1.0


class RosStepRunner:
    """Clients for every binding of a catalog, on `node`."""

    def __init__(self, node, bindings: dict[str, Binding], check_period_s: float = 2.0):
        from rclpy.action import ActionClient
        from rclpy.callback_groups import ReentrantCallbackGroup

        group = ReentrantCallbackGroup()
        self._node, self._clients, self._types = node, {}, {}
        self.gone_after_s = check_period_s + LIVENESS_GRACE_S
        for skill, binding in bindings.items():
            interface = interface_class(binding)
            self._types[skill] = interface
            self._clients[skill] = (
                ActionClient(node, interface, binding.server, callback_group=group)
                if binding.kind == "action"
                else node.create_client(interface, binding.server, callback_group=group))

    def close(self) -> None:
        for client in self._clients.values():
            if hasattr(client, "send_goal_async"):
                client.destroy()
            else:
                self._node.destroy_client(client)
        self._clients = {}

    def available(self, binding: Binding) -> bool:
        client = self._clients[binding.skill]
        return (client.server_is_ready() if binding.kind == "action"
                else client.service_is_ready())

    def wait_discovered(self, bindings: dict[str, Binding], timeout_s: float = DISCOVERY_S
                        ) -> None:
        """Wait (bounded) until every bound server is seen, or the timeout."""
        deadline = time.monotonic() + timeout_s
        while self.missing(bindings) and time.monotonic() < deadline:
            time.sleep(POLL_S)

    def missing(self, bindings: dict[str, Binding]) -> dict[str, str]:
        """skill -> why it cannot run now, for each binding whose server is not on the graph."""
        return {skill: f"its {b.kind} server {b.server} is not on the graph"
                for skill, b in bindings.items() if not self.available(b)}

    def run(self, binding: Binding, goal: dict[str, Any],
            on_feedback: Callable[[dict[str, Any]], None],
            cancelled: threading.Event) -> StepOutcome:
        deadline = time.monotonic() + binding.timeout_s
        if cancelled.is_set():      # cancelled between the gate (or an approval) and now
            return StepOutcome("canceled", "the execution was cancelled; nothing sent")
        if not self.available(binding):
            return StepOutcome("unavailable", f"{binding.server} is not on the graph; "
                               "nothing sent")
        interface = self._types[binding.skill]
        try:
            message = to_message(interface.Goal() if binding.kind == "action"
                                 else interface.Request(), goal)
        except ValueError as exc:   # the gate checked the types at configure; never expected
            return StepOutcome("rejected", f"the goal does not fit {binding.type}: {exc}")
        if binding.kind == "action":
            return self._action(binding, message, on_feedback, cancelled, deadline)
        return self._service(binding, message, cancelled, deadline)

    def _action(self, binding, goal, on_feedback, cancelled, deadline) -> StepOutcome:
        client = self._clients[binding.skill]
        alive = self._alive(binding)
        sent = client.send_goal_async(
            goal, feedback_callback=lambda msg: on_feedback(to_fields(msg.feedback)))
        how = _wait(sent, deadline, cancelled, alive)
        if how != "done":   # no answer yet: a goal accepted later is cancelled at once
            sent.add_done_callback(lambda f: f.result() is not None and f.result().accepted
                                   and f.result().cancel_goal_async())
            return self._ended(how, binding, "before the server accepted the goal; one "
                               "accepted later is cancelled at once", confirmed=False)
        handle = sent.result()
        if not handle.accepted:
            return StepOutcome("rejected", f"{binding.server} rejected the goal")
        result = handle.get_result_async()
        how = _wait(result, deadline, cancelled, alive)
        if how == "gone":
            handle.cancel_goal_async()
            return self._ended(how, binding, "cancel sent", confirmed=False)
        if how != "done":
            handle.cancel_goal_async()
            ended = _wait(result, time.monotonic() + CANCEL_GRACE_S, threading.Event())
            note = ("cancel sent; the server ended the goal" if ended == "done" else
                    f"cancel sent; the server did not end the goal within {CANCEL_GRACE_S:g} s")
            return self._ended(how, binding, note, confirmed=ended == "done")
        return _from_status(binding, result.result().status, to_fields(result.result().result))

    def _service(self, binding, request, cancelled, deadline) -> StepOutcome:
        future = self._clients[binding.skill].call_async(request)
        how = _wait(future, deadline, cancelled, self._alive(binding))
        if how != "done":
            return self._ended(how, binding, "a service call cannot be cancelled: its "
                               "response will be ignored", confirmed=False)
        response = to_fields(future.result())
        return _judged(binding, "succeeded", response)

    def _alive(self, binding: Binding) -> Callable[[], bool]:
        """False once the binding's server has been off the graph for gone_after_s."""
        seen = [time.monotonic()]

        def alive() -> bool:
            now = time.monotonic()
            if self.available(binding):
                seen[0] = now
            return now - seen[0] < self.gone_after_s

        return alive

    def _ended(self, how: str, binding: Binding, note: str, confirmed: bool) -> StepOutcome:
        """The outcome of a wait that did not end in a result: cancelled, timed out (or
        "unconfirmed" when the server did not confirm the end) or the server gone."""
        if how == "canceled":
            return StepOutcome("canceled", f"the execution was cancelled ({binding.server}: "
                               f"{note})")
        if how == "gone":
            return StepOutcome("unavailable", f"{binding.server} left the graph while its "
                               f"goal ran (not seen for {self.gone_after_s:g} s; {note}); the "
                               "goal's end is not confirmed", ended=False)
        return StepOutcome("timed_out" if confirmed else "unconfirmed",
                           f"{binding.server} gave no result within {binding.timeout_s:g} s "
                           f"({note})")


def _wait(future, deadline: float, cancelled: threading.Event,
          alive: Callable[[], bool] | None = None) -> str:
    """"done", "timeout", "canceled" or "gone" (`alive` turned false), whichever comes
    first: woken by the future's done callback at once (a poll would add its period to every
    step), by a cancel or the server's loss within POLL_S."""
    done = threading.Event()
    future.add_done_callback(lambda _: done.set())
    while not (done.is_set() or future.done()):
        if cancelled.is_set():
            return "canceled"
        if alive is not None and not alive():
            return "gone"
        left = deadline - time.monotonic()
        if left <= 0:
            return "timeout"
        done.wait(min(POLL_S, left))
    return "done"


def _from_status(binding: Binding, status: int, result: dict[str, Any]) -> StepOutcome:
    from action_msgs.msg import GoalStatus

    if status == GoalStatus.STATUS_SUCCEEDED:
        return _judged(binding, "succeeded", result)
    state = {GoalStatus.STATUS_ABORTED: "aborted",
             GoalStatus.STATUS_CANCELED: "canceled"}.get(status, "aborted")
    return StepOutcome(state, f"{state} by {binding.server}{_said(result)}", result)


def _judged(binding: Binding, state: str, result: dict[str, Any]) -> StepOutcome:
    if result.get("success") is False:
        return StepOutcome("aborted", f"{binding.server} reported success false"
                           f"{_said(result)}", result)
    return StepOutcome(state, f"{binding.server} succeeded", result)


def _said(result: dict[str, Any]) -> str:
    """What the server said, for a person: its message, else its result as JSON."""
    text = result.get("message") or result.get("error_msg")
    if isinstance(text, str) and text:
        code = result.get("error_code")
        return f": {text}" + (f" (error_code {code})" if code not in (None, 0) else "")
    return f": {json.dumps(result, sort_keys=True)}" if result else ""
