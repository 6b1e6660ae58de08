"""Progress lines that say how far a start-up is, not only what it did.

A `progress` callback (Engine.load, the warm-ups) receives text; a line about compiled
graphs is a `ProgressLine`, a str that also carries its counts, so that a caller showing the
start-up (the node's /diagnostics) reads them without parsing the text, and every other
caller prints it as it is.
"""

from __future__ import annotations


class ProgressLine(str):
    """A progress line with where it stands: `phase` (e.g. "compiling"), `done` of
    `total` steps of its part."""

    phase: str
    done: int
    total: int

    def __new__(cls, text: str, phase: str, done: int, total: int) -> ProgressLine:
        line = super().__new__(cls, text)
        line.phase, line.done, line.total = phase, done, total
        return line
