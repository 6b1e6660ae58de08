"""The step boundary: each plan step as soon as its JSON object closes in the streamed text.

`StepStream.feed(delta)` takes the model's output text as it is published and returns the
steps whose objects closed in it, each validated against its skill (`parse.validate_step`).
The answer starts at the first `{` outside `<think> ... </think>`; a step is an object
directly inside the envelope's `"plan"` array. Under the plan grammar every closed step is
already valid, so a step is final when it closes; without the grammar this is an incremental
parse of whatever the model writes, and a step that closes invalid is reported as a
`PlanError` by `feed` (the whole answer is still judged by `parse_plan` at the end).
"""

from __future__ import annotations

import json
from typing import Any

from .grounding import RequestWords
from .parse import THINK_CLOSE, THINK_OPEN, PlanError, loads, validate_step
from .skills import SkillCatalog


class StepStream:
    def __init__(self, catalog: SkillCatalog, words: RequestWords | None = None):
        self.catalog, self.words = catalog, words
        self.text = ""
        self.steps: list[dict[str, Any]] = []
        self._pos = 0              # next character to scan
        self._answer = False       # scanning the answer's JSON
        self._stack: list[str] = []   # open containers: "{" or "["
        self._in_string = self._escape = False
        self._key = ""             # the last string at envelope depth: the array's key
        self._string_start = 0
        self._step_start = -1

    def feed(self, delta: str) -> list[dict[str, Any]]:
        """Steps closed in `delta`, in order; PlanError for a step that closes invalid."""
        self.text += delta
        closed: list[dict[str, Any]] = []
        if not self._answer and not self._find_answer():
            return closed
        text, stack = self.text, self._stack
        for i in range(self._pos, len(text)):
            ch = text[i]
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
                    if len(stack) == 1:
                        self._key = text[self._string_start:i]
                continue
            if ch == '"':
                self._in_string, self._string_start = True, i + 1
            elif ch in "{[":
                stack.append(ch)
                if ch == "{" and self._is_step(len(stack) - 1):
                    self._step_start = i
            elif ch in "}]" and stack:
                stack.pop()
                if ch == "}" and self._step_start >= 0 and self._is_step(len(stack)):
                    closed.append(self._close_step(text[self._step_start:i + 1]))
                    self._step_start = -1
        self._pos = len(text)
        return closed

    def _is_step(self, index: int) -> bool:
        """Whether an object at stack index `index` (0 = the envelope) is a plan step."""
        return index == 2 and self._stack[:2] == ["{", "["] and self._key == "plan"

    def _find_answer(self) -> bool:
        """Skip thinking; True once the answer's first `{` is reached."""
        while True:
            brace = self.text.find("{", self._pos)
            think = self.text.find(THINK_OPEN, self._pos)
            if think >= 0 and (brace < 0 or think < brace):
                close = self.text.find(THINK_CLOSE, think)
                if close < 0:
                    return False
                self._pos = close + len(THINK_CLOSE)
                continue
            if brace < 0:
                return False
            self._pos, self._answer = brace, True
            return True

    def _close_step(self, raw: str) -> dict[str, Any]:
        index = len(self.steps)
        try:
            step = loads(raw)
        except json.JSONDecodeError as exc:
            raise PlanError(f"step {index + 1} is not valid JSON: {exc.msg}") from None
        self.steps.append(validate_step(step, index, self.catalog, self.words))
        return step
