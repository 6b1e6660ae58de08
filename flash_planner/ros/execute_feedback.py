"""`~/execute` feedback at a bounded rate: a step's state changes all go out, its server's
own feedback at most once per `planner.feedback_period_ms` (the throttle of `~/plan` is
action_server.FeedbackThrottle; this one merges differently: it keeps the latest message).

Nav2 publishes NavigateToPose feedback on every behaviour-tree tick (tens per second); each
became an ExecutePlan feedback message and a log line. ROS-free: a test drives it with a fake
clock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ..planning.execution import StepEvent

RUNNING = "running"   # the server's own feedback; every other state is a state change


class StepEventThrottle:
    """One execution's step events: every state change at once and in order, the "running"
    events (a server's feedback) at most one per `period_s`, the latest kept in between; the
    first after a state change goes out at once (the step's first news since).

    A held "running" event goes out with the next "running" event after the period or just
    before the step's next state change, whichever comes first, so order holds and the last
    feedback a server sent before its result is never lost. A "running" event for a step that
    has ended (its succeeded or failed, or any event of a later step, came first) is dropped:
    rclpy can deliver a goal's last feedback after its result. Runs on two threads (the
    execution's and the executor thread that calls the step's feedback callback): one lock,
    held while publishing, so two messages never overtake each other.
    """

    def __init__(self, publish: Callable[[StepEvent], None], period_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self._publish, self._period, self._clock = publish, period_s, clock
        self._lock = threading.Lock()
        self._last: float | None = None        # when a "running" event last went out
        self._pending: StepEvent | None = None
        self._latest: tuple[int, int] = (-1, -2)   # the latest (plan, step) with a change
        self._ended: set[tuple[int, int]] = set()
        self._closed = False

    def put(self, event: StepEvent) -> None:
        key = (event.plan_index, event.step_index)
        with self._lock:
            if self._closed:
                return
            if event.state == RUNNING:
                if key in self._ended or key < self._latest:
                    return
                now = self._clock()
                if self._last is None or now - self._last >= self._period:
                    self._pending, self._last = None, now
                    self._publish(event)
                else:
                    self._pending = event
                return
            self._flush()
            self._last, self._latest = None, max(self._latest, key)
            if event.state in ("succeeded", "failed"):
                self._ended.add(key)
            self._publish(event)

    def close(self) -> None:
        """Publish what is held back, then drop whatever comes later (called once the
        execution has ended, before its result goes out)."""
        with self._lock:
            self._flush()
            self._closed = True

    def _flush(self) -> None:
        if self._pending is not None:
            event, self._pending = self._pending, None
            self._publish(event)
