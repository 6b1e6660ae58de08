"""What a running plan request tells its caller as it decodes: `PlanFeedback` per published
delta, with the plan steps that closed in it (`steps.py`), from the request's token
listener."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from .parse import PlanError
from .steps import StepStream

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlanFeedback:
    request_id: str
    delta_text: str
    tokens_so_far: int
    tokens_per_s: float
    mean_accepted: float
    steps: tuple[tuple[int, dict], ...] = ()    # (index, step) of plan steps closed here


FeedbackCallback = Callable[[PlanFeedback], None]


class Listener:
    """The token callback of one request: finds closed plan steps in the streamed text and
    forwards feedback (with those steps) to the ticket's consumer, if it has one."""

    def __init__(self, ticket, steps: StepStream):
        self.ticket, self.steps = ticket, steps
        self.t_start = time.monotonic()
        self.t_first: float | None = None      # first token published
        self.first_step_ms: float | None = None
        self.tokens = self.calls = 0
        self.streaming = True                  # false after a step closed invalid

    def __call__(self, ids: list[int], delta: str) -> None:
        now = time.monotonic()
        closed: tuple[tuple[int, dict], ...] = ()
        if self.streaming and delta:
            before = len(self.steps.steps)
            try:
                new = self.steps.feed(delta)
            except PlanError:       # unconstrained output; the final parse names the error
                self.streaming, new = False, []
            closed = tuple(enumerate(new, start=before))
            if closed and self.first_step_ms is None:
                self.first_step_ms = (now - self.t_start) * 1000.0
        ticket = self.ticket
        if ticket.on_feedback is None:
            return
        self.t_first = self.t_first or now
        self.tokens += len(ids)
        self.calls += 1
        cycles = self.calls - 1          # the first call is the prefill token
        elapsed = now - self.t_first
        tps = (self.tokens - 1) / elapsed if elapsed > 0 else 0.0
        accepted = (self.tokens - 1) / cycles - 1 if cycles else 0.0
        try:
            ticket.on_feedback(PlanFeedback(ticket.id, delta, self.tokens, tps,
                                            max(accepted, 0.0), closed))
        except Exception:  # a broken feedback consumer must not stop decoding
            log.exception("feedback callback of request %s failed", ticket.id)
