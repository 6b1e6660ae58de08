"""A start-up that says what it is doing and can be stopped: the progress callback given to
`PlannerService.load` by the node (and read by its /diagnostics from another thread).

Why: a cold start compiles for minutes; an operator watching /diagnostics must see that the
node is warming up and how far it is, and a Ctrl-C meanwhile must end it, not wait for the
compile or leave a half-configured node behind.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ..engine.progress import ProgressLine


class StartupCancelled(Exception):
    """The start-up was stopped before it finished (a shutdown during configure)."""


class StartupProgress:
    """Progress lines as they come (each passed on to `log`), the start-up's phase and
    counts, and its cancellation: the next line after `cancel()` raises StartupCancelled
    in the loading thread, which unwinds the load."""

    def __init__(self, log: Callable[[str], None]):
        self._log = log
        self._cancelled = threading.Event()
        self.started = time.monotonic()
        self.phase = "loading the model"
        self.line = ""
        self.counts = ""           # e.g. "2 of 5 graphs of the target"

    def __call__(self, line: str) -> None:
        self.check()
        self.line = str(line)
        if isinstance(line, ProgressLine):
            self.phase = line.phase
            self.counts = f"{line.done} of {line.total}"
        self._log(self.line)

    def enter(self, phase: str) -> None:
        """A phase without progress lines of its own (the planner's warm-up requests)."""
        self.check()
        self.phase, self.counts = phase, ""

    def check(self) -> None:
        if self._cancelled.is_set():
            raise StartupCancelled("the start-up was stopped")

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def values(self) -> list[tuple[str, str]]:
        """/diagnostics keys while starting: phase, counts, the latest line, seconds."""
        out = [("startup phase", self.phase)]
        if self.counts:
            out.append(("startup steps", self.counts))
        if self.line:
            out.append(("startup", self.line))
        out.append(("startup seconds", f"{time.monotonic() - self.started:.1f}"))
        return out
