"""OpenAI tool calls on /v1/chat/completions, as the protocol defines them: a request's `tools`,
`tool_choice` and `parallel_tool_calls` checked; the tool turns of its messages (an assistant's
`tool_calls`, `role: tool` results) in the shape chat templates render; the answer's calls
as `tool_calls` (ids, names, `arguments` as a JSON string). No web framework here.

A tool's definition and a call's arguments are rendered by the model's chat template as its
own text, where a control token's text would be parsed as that token; such text is refused
(`check_control_text`), as message contents never need to be (chat.py keeps those apart).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..engine.inputs.tool_calls import ToolCall

CHOICES = ("none", "auto", "required")
# OpenAI's rule for a function's name
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
FUNCTION_KEYS = {"name", "description", "parameters", "strict"}


class ToolRequestError(ValueError):
    """A bad tools field: the message names what, `param` the request field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolRequest:
    """The request's tools in OpenAI's function shape, its tool_choice ("none", "auto",
    "required" or a function's name) and whether several calls may come in one answer."""
    tools: tuple[dict, ...]
    choice: str
    parallel: bool = True
    named: bool = False          # choice is a function's name

    @property
    def constrained(self) -> bool:
        """Whether the answer is held to calls (or text and calls) by a grammar."""
        return self.choice != "none"

    @property
    def tool_choice(self) -> str | dict:
        """The choice in xgrammar's (and OpenAI's) shape."""
        if self.named:
            return {"type": "function", "function": {"name": self.choice}}
        return self.choice

    def key(self) -> str:
        return json.dumps([self.tools, self.choice, self.named, self.parallel], sort_keys=True)

    def by_name(self, name: str) -> dict:
        return next(t for t in self.tools if t["function"]["name"] == name)


def _function(tool: Any, at: str) -> dict:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise ToolRequestError(f"{at} must be {{'type': 'function', 'function': {{...}}}}",
                               "tools")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise ToolRequestError(f"{at}.function must be an object", "tools")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ToolRequestError(f"{at}.function.name must be 1 to 64 letters, digits, _ or -, "
                               f"got {name!r}", "tools")
    unknown = sorted(set(fn) - FUNCTION_KEYS)
    if unknown:
        raise ToolRequestError(f"{at}.function ({name}): unknown field(s) {unknown}", "tools")
    if not isinstance(fn.get("description", ""), str):
        raise ToolRequestError(f"{at}.function ({name}).description must be a string", "tools")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        raise ToolRequestError(f"{at}.function ({name}).parameters must be a JSON schema of "
                               "an object", "tools")
    out = {"name": name, "parameters": params}
    if fn.get("description"):
        out["description"] = fn["description"]
    return {"type": "function", "function": out}


def parse_tools(body: dict) -> ToolRequest | None:
    """The request's ToolRequest (None when it declares no tools), or ToolRequestError."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ToolRequestError("parallel_tool_calls must be true or false",
                               "parallel_tool_calls")
    if raw is None or raw == []:
        if choice not in (None, "none"):
            raise ToolRequestError(f"tool_choice {choice!r} needs tools: the request declares "
                                   "none", "tool_choice")
        return None
    if not isinstance(raw, list):
        raise ToolRequestError("tools must be a list of function tools", "tools")
    tools, seen = [], set()
    for i, tool in enumerate(raw):
        tool = _function(tool, f"tools[{i}]")
        name = tool["function"]["name"]
        if name in seen:
            raise ToolRequestError(f"tools[{i}]: the function name {name!r} is declared twice",
                                   "tools")
        seen.add(name)
        tools.append(tool)
    named = False
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise ToolRequestError("tool_choice must be none, auto, required or {'type': "
                                   "'function', 'function': {'name': ...}}", "tool_choice")
        if name not in seen:
            raise ToolRequestError(f"tool_choice names the function {name!r}, which tools "
                                   f"does not declare (declared: {sorted(seen)})",
                                   "tool_choice")
        choice, named = name, True
    elif choice not in CHOICES:
        raise ToolRequestError(f"tool_choice must be one of {CHOICES} or a named function, "
                               f"got {choice!r}", "tool_choice")
    return ToolRequest(tuple(tools), choice, parallel, named)


def assistant_calls(calls: Any, at: str) -> list[dict]:
    """An assistant message's `tool_calls` in the template's shape: each call's arguments
    parsed from their JSON string into an object (Qwen's templates render the object)."""
    if not isinstance(calls, list) or not calls:
        raise ToolRequestError(f"{at} must be a non-empty list of calls", "messages")
    out = []
    for j, call in enumerate(calls):
        where = f"{at}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ToolRequestError(f"{where} must be {{'id', 'type': 'function', 'function': "
                                   "{'name', 'arguments'}}", "messages")
        parsed = call_arguments(fn.get("arguments", "{}"), f"{where}.function.arguments",
                                "messages")
        out.append({"id": str(call.get("id", "")), "type": "function",
                    "function": {"name": fn["name"], "arguments": parsed}})
    return out


def call_arguments(arguments: Any, where: str, param: str) -> dict:
    """A call's arguments as an object: OpenAI sends them as a JSON string, an object is
    taken as it is; ToolRequestError naming `where` otherwise."""
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError as exc:
        raise ToolRequestError(f"{where} is not valid JSON: {exc}", param) from None
    if not isinstance(parsed, dict):
        raise ToolRequestError(f"{where} must be a JSON object", param)
    return parsed


def check_control_text(value: Any, where: str, control: Sequence[str], param: str) -> None:
    """ToolRequestError naming the first string inside `value` that holds a control token's
    text (`control`: the tokenizer's added tokens)."""
    if isinstance(value, str):
        hit = next((c for c in control if c in value), None)
        if hit is not None:
            raise ToolRequestError(f"{where} contains {hit!r}, a control token of this model: "
                                   "it cannot appear in tool definitions or call arguments",
                                   param)
    elif isinstance(value, dict):
        for key, item in value.items():
            check_control_text(key, where, control, param)
            check_control_text(item, f"{where}.{key}", control, param)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_control_text(item, f"{where}[{i}]", control, param)


def control_texts(tokenizer) -> tuple[str, ...]:
    """The texts of the tokenizer's added tokens (its control tokens)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return tuple(sorted({t.content for t in decoder.values() if len(t.content) > 1}))


def tool_string_tokens(max_string_tokens: int, max_tokens: int, tools) -> int:
    """The most tokens in one string or raw value of a tool call, unless the request says:
    the planner's `max_string_tokens`, and at most max_tokens / (2 x the most parameters a
    tool declares), never below 4: every value of a call at its bound fills at most half of
    max_tokens, which leaves the other half to the call around them."""
    params = max((len(t["function"]["parameters"].get("properties") or {}) for t in tools),
                 default=1)
    return min(max_string_tokens, max(4, max_tokens // (2 * max(params, 1))))


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def calls_body(calls: Iterable[ToolCall], first_index: int = 0,
               with_index: bool = False) -> list[dict]:
    """Calls in OpenAI's `tool_calls` shape (with `index`: a stream's deltas)."""
    out = []
    for k, call in enumerate(calls, first_index):
        body = {"id": call_id(), "type": "function",
                "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
        out.append({"index": k, **body} if with_index else body)
    return out
