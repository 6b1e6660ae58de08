"""A request as the planner service holds it: the ticket its caller waits on, and the generic
generation (`Completion`, the server's chat completions) that shares the plans' queue.

A ticket is resolved once, by the service's scheduler or by the path that refused it; its
caller blocks on `result()` or registers `add_done_callback` (the server's event loop: a
waiter without a thread of its own).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from ..engine.generate import CancelToken, GenerationSettings
from ..engine.inputs.images import ImagePatches
from .feedback import FeedbackCallback
from .local_job import LocalJob
from .request import PlanRequest, PlanResult, RequestError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Completion:
    """A generic generation that shares the planner's queue (the server's chat completions):
    the prompt (chat messages or ids), its settings, an optional grammar constraint factory,
    and a token callback `on_token(ids, delta)` called from the worker."""
    prompt: Any
    settings: GenerationSettings
    constraint: Callable[[], Any] | None = None
    on_token: Callable[[list[int], str], None] | None = None
    images: tuple[ImagePatches, ...] = ()      # one per image part of the messages


class PlanTicket:
    """A submitted request; `result()` blocks until it is finished."""

    def __init__(self, request: PlanRequest, on_feedback: FeedbackCallback | None,
                 completion: Completion | None = None):
        self.request = request
        self.completion = completion
        self.on_feedback = on_feedback
        self.cancel_token = CancelToken()
        self.submitted = time.monotonic()
        self.cancel_reason = "cancelled"
        self.invalid_field: str | None = None   # the field that made submit refuse it
        self.image_age_ms: float | None = None  # its camera frame's age when submitted
        self._done = threading.Event()
        self._result: PlanResult | None = None
        self._callbacks: list[Callable[[PlanResult], None]] = []
        self._callbacks_lock = threading.Lock()
        # in flight: the engine's future and how to read it, or a remote attempt's
        self.job: LocalJob | None = None
        self.future: Future | None = None
        self.remote_tried = False
        self.stage = ""              # remote | prepare | batch: what `future` is of
        self.telemetry: dict = {}

    @property
    def id(self) -> str:
        return self.request.id

    def rejected(self, error: RequestError) -> PlanResult:
        """The result of a request that `RequestRules.checked` refused: the caller's to fix."""
        self.invalid_field = error.field
        return PlanResult(self.id, str(self.request.task), success=False,
                          error=f"invalid request: {error}", rejected=True)

    def resolve(self, result: PlanResult) -> None:
        with self._callbacks_lock:
            self._result = result
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            self._call(callback)

    def add_done_callback(self, callback: Callable[[PlanResult], None]) -> None:
        """Call `callback(result)` once the ticket is resolved (at once if it is): on the
        resolving thread, so it must only hand the result on (an event loop's
        call_soon_threadsafe), never block. A waiter without a thread of its own."""
        with self._callbacks_lock:
            if not self._done.is_set():
                self._callbacks.append(callback)
                return
        self._call(callback)

    def _call(self, callback: Callable[[PlanResult], None]) -> None:
        try:
            callback(self._result)
        except Exception:  # a broken waiter must not break the scheduler
            log.exception("a done callback of request %s failed", self.id)

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> PlanResult:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} not finished after {timeout} s")
        return self._result
