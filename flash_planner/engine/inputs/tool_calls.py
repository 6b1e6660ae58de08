"""Tool calls as a model's chat template writes them: which format the template uses, the
structural tag that holds the output to calls of the declared tools, and the calls read
back from generated text (whole, or as it streams).

Two formats, told apart by the template's own text (never assumed from the model's name):
- `qwen_3` (Qwen3, Qwen3-Next, Hermes style): `<tool_call>\\n{"name": N, "arguments": {...}}
  \\n</tool_call>`, the arguments a JSON object;
- `qwen_3_5` (Qwen3.5, Qwen3.6, Qwen3-Coder): `<tool_call>\\n<function=N>\\n<parameter=P>\\nV
  \\n</parameter>\\n...</function>\\n</tool_call>`, a parameter's value raw text, typed by its
  schema (`_value`: a string stays a string wherever the schema admits one).
xgrammar ships a structural tag for each (`get_model_structural_tag`): under `auto` free text
until the call's opening, from there the call is held to a declared tool and its schema;
`required` and a named tool allow calls only. Thinking is not part of it: the loop's
`Constraint` keeps `<think> ... </think>` free and feeds the matcher the answer alone.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .chat import template_source, template_takes

QWEN3, QWEN35 = "qwen_3", "qwen_3_5"
OPEN, CLOSE = "<tool_call>", "</tool_call>"
# the most blanks in a row inside a call (a newline and an indent of a pretty-printed value)
MAX_BLANKS = 4
_FUNCTION = re.compile(r"<function=([^>\n]+)>\n?(.*?)\n?</function>", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


class ToolCallError(ValueError):
    """Tools were asked of a model whose chat template has no tool-call format we read."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


def tool_call_format(tokenizer) -> str | None:
    """The template's tool-call format (QWEN3 or QWEN35), or None when its template does
    not render tools or writes calls in neither format."""
    if tokenizer is None or not template_takes(tokenizer, "tools"):
        return None
    source = template_source(tokenizer)
    if "<function=" in source and OPEN in source:
        return QWEN35
    if OPEN in source:
        return QWEN3
    return None


def structural_tag(fmt: str, tools: list[dict], choice: str | dict, parallel: bool):
    """xgrammar's structural tag for `tools` (OpenAI function tools) under `choice`
    ("none", "auto", "required" or {"type": "function", "function": {"name": ...}}).
    Runs of blanks inside a call are capped at MAX_BLANKS: a model that loops on them would
    otherwise never close its call. Under "none" the answer is text in which a call's
    opening cannot be written (OpenAI's none: no call, not a call returned as text)."""
    import xgrammar as xgr

    tag = xgr.get_model_structural_tag(fmt, tools=tools, tool_choice=choice,
                                       reasoning="disabled", parallel_tool_calls=parallel,
                                       max_whitespace_cnt=MAX_BLANKS)
    if choice == "none":
        text = tag.format
        tag = tag.model_copy(update={"format": text.model_copy(
            update={"excludes": [*text.excludes, OPEN]})})
    return tag


# JSON Schema's type of each JSON literal a raw value may be read as
_LITERAL_TYPES = {bool: "boolean", type(None): "null", int: "integer", float: "number"}


def admitted_types(schema: Any) -> set[str] | None:
    """The JSON types `schema` admits (its `type`, `enum` and `const` values, `anyOf` and
    `oneOf` branches; `allOf` as the first branch that says); None: any type."""
    if not isinstance(schema, Mapping):
        return None
    kinds = schema.get("type")
    if kinds is not None:
        return set(kinds if isinstance(kinds, list) else [kinds])
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if isinstance(values, list):
        return {_json_type(v) for v in values}
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            branches = [admitted_types(b) for b in schema[key]]
            return None if None in branches else set().union(*branches)
    for branch in schema.get("allOf") or []:
        found = admitted_types(branch)
        if found is not None:
            return found
    return None


def _json_type(value: Any) -> str:
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, float) and value.is_integer():
        return "integer"              # JSON Schema's integer is any number without a fraction
    return _LITERAL_TYPES.get(type(value), "string")


def _value(raw: str, schema: Mapping[str, Any] | None) -> Any:
    """A qwen_3_5 parameter's value, typed by its schema as JSON Schema reads it: the text
    `null` is null where null is admitted; any other text stays a string where a string is
    admitted (without the blanks the grammar allows around it); otherwise the text is read
    as JSON, and kept only if its type is admitted (a number where only a string would
    fit stays that string). A schema that admits any type reads JSON first."""
    text = raw.strip()
    admitted = admitted_types(schema)
    if text == "null" and (admitted is None or "null" in admitted):
        return None
    if admitted is not None and "string" in admitted:
        # an enum's value keeps its own blanks (" " is a value); the grammar's blanks around
        # it are not part of it: the longest value inside the text that strips to the same
        values = schema.get("enum", [schema.get("const")]) if isinstance(schema, Mapping) \
            else ()
        fits = [v for v in values if isinstance(v, str) and v in raw and v.strip() == text]
        return max(fits, key=len) if fits else text
    try:
        value = json.loads(text)
    except ValueError:
        return text
    if admitted is not None:
        kind = _json_type(value)
        if kind not in admitted and not (kind == "integer" and "number" in admitted):
            return text
    return value


def _parameters(tools: Iterable[dict]) -> dict[str, dict]:
    return {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}


def parse_call(fmt: str, block: str, tools: Iterable[dict]) -> ToolCall | None:
    """One call from the text between `<tool_call>` and `</tool_call>`; None when it is
    not a call in the format (text the grammar did not hold: tool_choice none)."""
    if fmt == QWEN3:
        try:
            call = json.loads(block.strip())
        except ValueError:
            return None
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)
                and isinstance(call.get("arguments", {}), dict)):
            return None
        return ToolCall(call["name"], call.get("arguments", {}))
    found = _FUNCTION.search(block)
    if found is None:
        return None
    name = found.group(1).strip()
    props = _parameters(tools).get(name, {}).get("properties") or {}
    return ToolCall(name, {key.strip(): _value(raw, props.get(key.strip()))
                           for key, raw in _PARAMETER.findall(found.group(2))})


def split_calls(fmt: str, text: str, tools: Iterable[dict]
                ) -> tuple[str, list[ToolCall], bool]:
    """(the text outside calls, the calls in order, whether a call was left open: the
    output stopped inside one). A block that is no call in the format stays text."""
    tools = list(tools)
    content, calls, rest = [], [], text
    while True:
        before, found, after = rest.partition(OPEN)
        content.append(before)
        if not found:
            return _joined(content), calls, False
        block, closed, rest = after.partition(CLOSE)
        if not closed:
            return _joined(content), calls, True
        call = parse_call(fmt, block, tools)
        if call is None:
            content.append(OPEN + block + CLOSE)
        else:
            calls.append(call)


def _joined(parts: list[str]) -> str:
    return "\n".join(p.strip("\n") for p in parts if p.strip("\n"))


class ToolCallStream:
    """Generated text in, (content delta, calls closed) out: the text before the first call
    streams as it comes (held back where it may be the start of `<tool_call>`, and newlines
    at its end, which a call after them drops); each call is given whole once its
    `</tool_call>` arrives; text after a call comes with the final delta. What streamed is
    always a prefix of `split_calls`' content."""

    def __init__(self, fmt: str, tools: Iterable[dict]) -> None:
        self.fmt, self.tools = fmt, list(tools)
        self.text, self.sent, self.calls = "", "", 0

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        start = max(0, len(self.text) - len(CLOSE) + 1)
        self.text += delta
        calls: list[ToolCall] = []
        # the whole text is parsed only where a call may have closed (a `</tool_call>` ends
        # inside this delta) or at the end, not once per delta
        if final or CLOSE in self.text[start:]:
            content, calls, _ = split_calls(self.fmt, self.text, self.tools)
        if final:
            target = content
        else:
            head, found, _ = self.text.partition(OPEN)
            if not found:
                head = head[:len(head) - _partial_open(head)]
            target = head.strip("\n")
        out = target[len(self.sent):] if target.startswith(self.sent) else ""
        self.sent += out
        new = calls[self.calls:]
        self.calls += len(new)
        return out, new


def _partial_open(text: str) -> int:
    """The characters at the end of `text` that may begin `<tool_call>`."""
    for cut in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:cut]):
            return cut
    return 0
