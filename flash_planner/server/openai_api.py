"""The OpenAI chat-completions protocol as the server speaks it: request checks, response and
stream-chunk shapes, and errors in OpenAI's shape. No web framework here (app.py is the
HTTP side), so every rule is testable as a function.

Implemented: `model`, `messages` (system / user / assistant; content a string, or text
and `image_url` parts: data URLs, http(s) only where the server allows them), `max_tokens` /
`max_completion_tokens`, `stop`, `stream` (+ `stream_options.include_usage`), `seed`,
`temperature`, `top_p`, `presence_penalty`, `frequency_penalty`, and, as vLLM accepts them,
`top_k`, `min_p`, `repetition_penalty` and `chat_template_kwargs.enable_thinking`;
`reasoning_effort` (top level, as OpenAI's API has it, or
`chat_template_kwargs.reasoning_effort`): passed to a chat template that takes it
(Qwen3.8's), a 400 naming it for one that does not (app.py); `response_format` text /
json_object / json_schema (compiled by our grammar into the speculative loop); `tools`,
`tool_choice`, `parallel_tool_calls`, assistant `tool_calls` and `role: tool` messages
(tool_api.py; the calls held by a grammar, `none` included: no call can be written), and
ours, `max_string_tokens` (the most tokens in one string or raw value of the answer; tool
calls default to the planner's). Refused with 400 naming the field: `n` > 1,
the legacy `functions` / `function_call`, `logprobs`, `logit_bias` and any other field.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from ..engine.inputs.chat import check_reasoning_effort
from ..engine.inputs.tool_calls import split_calls
from ..engine.loop.sampling import Sampling, SamplingParams
from ..planning.images import ImageSource
from .tool_api import ToolRequest, ToolRequestError, assistant_calls, calls_body, parse_tools

KNOWN = {"model", "messages", "max_tokens", "max_completion_tokens", "stop", "stream",
         "stream_options", "seed", "temperature", "top_p", "top_k", "min_p",
         "presence_penalty", "frequency_penalty", "repetition_penalty", "response_format",
         "chat_template_kwargs", "n", "user", "reasoning_effort", "tools", "tool_choice",
         "parallel_tool_calls", "max_string_tokens"}
UNSUPPORTED = {"functions", "function_call", "logprobs", "top_logprobs", "logit_bias", "audio",
               "modalities", "prediction", "service_tier", "store", "metadata"}
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                 "frequency_penalty", "repetition_penalty")
ROLES = ("system", "user", "assistant", "developer", "tool")


class ApiError(Exception):
    """An error answered in OpenAI's shape with an HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type_, param, code)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: list[dict[str, Any]]
    max_tokens: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    sampling: Sampling
    schema: dict[str, Any] | None      # a JSON schema the answer must follow, or None
    enable_thinking: bool | None
    reasoning_effort: str | None = None    # for the chat template; None: its default
    images: tuple[ImageSource, ...] = ()   # the image_url parts' URLs, in order
    tools: ToolRequest | None = None       # the declared tools and tool_choice
    # the most tokens inside one string or raw value of the answer (ours, beside OpenAI's:
    # extra_body); None: the planner's max_string_tokens for tool calls, no bound for a
    # response_format schema (it keeps its strings as written)
    max_string_tokens: int | None = None


def _content(content: Any, where: str, images: list[ImageSource]) -> str | list[dict]:
    """A message's content: its text, or its parts for the chat template (text parts, and
    an image part for each `image_url` part, whose URL joins `images`)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not all(isinstance(p, dict) for p in content):
        raise bad(f"{where} must be a string or a list of content parts", where)
    parts: list[dict] = []
    for i, part in enumerate(content):
        at = f"{where}[{i}]"
        if part.get("type") == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif part.get("type") == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else None
            if not isinstance(url, str):
                raise bad(f"{at}.image_url.url must be a string (a data URL)", at)
            images.append(ImageSource(url, f"{at}.image_url"))
            parts.append({"type": "image"})
        else:
            raise bad(f"{at}: only text and image_url content parts are supported", at)
    if not any(part["type"] == "image" for part in parts):
        return "".join(part["text"] for part in parts)
    return parts


def text_chars(messages: list[dict]) -> int:
    """The characters of the messages' text (image parts count none)."""
    return sum(len(m["content"]) if isinstance(m["content"], str) else
               sum(len(p.get("text", "")) for p in m["content"]) for m in messages)


def _int(body: dict, name: str, low: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise bad(f"{name} must be an integer >= {low}, got {value!r}", name)
    return value


def parse_chat(body: Any, served_model: str) -> ChatRequest:
    """A checked ChatRequest, or ApiError (400, or 404 for a model we do not serve)."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    for name in sorted(set(body) & UNSUPPORTED):
        raise bad(f"{name} is not supported by this server", name)
    unknown = sorted(set(body) - KNOWN - UNSUPPORTED)
    if unknown:
        raise bad(f"unknown field(s) {unknown}", unknown[0])
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model is required (a string)", "model")
    if model != served_model:
        raise ApiError(404, f"the model '{model}' does not exist; this server serves "
                       f"'{served_model}'", param="model", code="model_not_found")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad("messages must be a non-empty list", "messages")
    try:
        tools = parse_tools(body)
        messages, images = _messages(raw)
    except ToolRequestError as exc:
        raise bad(str(exc), exc.param) from None
    if _int(body, "n", 1) not in (None, 1):
        raise bad("n must be 1: this server returns one choice", "n")
    max_tokens = _int(body, "max_completion_tokens", 1) or _int(body, "max_tokens", 1)
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) and s for s in stop) and len(
            stop) <= 4:
        stops = tuple(stop)
    else:
        raise bad("stop must be a string or a list of up to 4 non-empty strings", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad("stream_options must be an object", "stream_options")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise bad("seed must be an integer", "seed")
    values = {k: body[k] for k in SAMPLING_KEYS if body.get(k) is not None}
    if "temperature" not in values:
        values["temperature"] = 1.0          # OpenAI's default; 0 = greedy
    try:
        params = SamplingParams.from_dict(values, "sampling")
        sampling = Sampling(params, params, None if seed is None else seed % 2**63)
    except ValueError as exc:
        raise bad(str(exc).removeprefix("sampling: "), next(
            (k for k in values if k in str(exc)), None)) from None
    kwargs = body.get("chat_template_kwargs") or {}
    thinking = kwargs.get("enable_thinking") if isinstance(kwargs, dict) else None
    if thinking is not None and not isinstance(thinking, bool):
        raise bad("chat_template_kwargs.enable_thinking must be true or false",
                  "chat_template_kwargs")
    return ChatRequest(model, messages, max_tokens, stops, stream,
                       bool(options.get("include_usage")), sampling,
                       _schema(body.get("response_format")), thinking,
                       _reasoning_effort(body, kwargs), tuple(images), tools,
                       _int(body, "max_string_tokens", 1))


def _messages(raw: list) -> tuple[list[dict], list[ImageSource]]:
    """The messages in the chat template's shape and the image parts' sources."""
    messages: list[dict] = []
    images: list[ImageSource] = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise bad(f"messages[{i}].role must be one of {ROLES}", f"messages[{i}].role")
        role = "system" if m["role"] == "developer" else m["role"]
        calls = m.get("tool_calls") if role == "assistant" else None
        content = m.get("content")
        if calls is not None and content is None:      # an assistant turn that only calls
            content = ""
        message = {"role": role, "content": _content(content, f"messages[{i}].content",
                                                     images)}
        if calls is not None:
            message["tool_calls"] = assistant_calls(calls, f"messages[{i}].tool_calls")
        if role == "tool":
            if not isinstance(message["content"], str):
                raise bad(f"messages[{i}].content: a tool result is text", f"messages[{i}]")
            call = m.get("tool_call_id")
            if not isinstance(call, str) or not call:
                raise bad(f"messages[{i}].tool_call_id must name the call this result "
                          "answers", f"messages[{i}].tool_call_id")
            message["tool_call_id"] = call
        messages.append(message)
    return messages, images


def _reasoning_effort(body: dict, kwargs: Any) -> str | None:
    """`reasoning_effort` at the top level or in chat_template_kwargs (the same value when
    both are given), checked: a short lowercase word."""
    top = body.get("reasoning_effort")
    inner = kwargs.get("reasoning_effort") if isinstance(kwargs, dict) else None
    if top is not None and inner is not None and top != inner:
        raise bad(f"reasoning_effort {top!r} and chat_template_kwargs.reasoning_effort "
                  f"{inner!r} differ: give one", "reasoning_effort")
    value = top if top is not None else inner
    where = "reasoning_effort" if top is not None else "chat_template_kwargs.reasoning_effort"
    try:
        return check_reasoning_effort(value, where)
    except ValueError as exc:
        raise bad(str(exc), "reasoning_effort") from None


def _schema(fmt: Any) -> dict[str, Any] | None:
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object",
                                                             "json_schema"):
        raise bad("response_format.type must be text, json_object or json_schema",
                  "response_format")
    if fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return {"type": "object"}
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise bad("response_format.json_schema.schema must be a JSON schema object",
                  "response_format")
    return spec["schema"]


OPEN, CLOSE = "<think>", "</think>"


def split_reasoning(text: str, final: bool = True) -> tuple[str, str]:
    """(reasoning, content) of generated text, as vLLM's reasoning parsers answer it: a
    leading `<think> ... </think>` block is the reasoning, the rest (leading newlines
    dropped) the content. Not `final`: a tag cut off at the end is held back."""
    if text.startswith(OPEN):
        end = text.find(CLOSE)
        if end >= 0:
            return text[len(OPEN):end].strip("\n"), text[end + len(CLOSE):].lstrip("\n")
        body = text[len(OPEN):]
        if not final:
            for cut in range(len(CLOSE) - 1, 0, -1):      # a partial </think> at the end
                if body.endswith(CLOSE[:cut]):
                    body = body[:-cut]
                    break
            # newlines at the end are held back too: if </think> follows them they are
            # stripped, and what was streamed must stay a prefix of the closed reasoning
            body = body.rstrip("\n")
        return body.lstrip("\n"), ""
    if not final and OPEN.startswith(text):               # maybe the start of <think>
        return "", ""
    return "", text


class ReasoningStream:
    """Deltas of (reasoning, content) as the generated text grows."""

    def __init__(self) -> None:
        self.text, self.sent = "", ("", "")

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        self.text += delta
        now = split_reasoning(self.text, final)
        out = tuple(n[len(s):] if n.startswith(s) else n for n, s in zip(now, self.sent))
        self.sent = (max(now[0], self.sent[0], key=len), max(now[1], self.sent[1], key=len))
        return out[0], out[1]


def completion_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex[:24]


def finish_reason(reason: str, called: bool = False) -> str:
    """Ours -> OpenAI's: eos and stop strings are `stop` (`tool_calls` when the answer
    called tools), the token limit is `length`."""
    if reason == "length":
        return "length"
    return "tool_calls" if called else "stop"


def usage(telemetry: dict[str, Any]) -> dict[str, int]:
    prompt, completion = int(telemetry.get("prompt_tokens", 0)), int(
        telemetry.get("new_tokens", 0))
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def completion_body(cid: str, model: str, text: str, reason: str,
                    telemetry: dict[str, Any], tools: ToolRequest | None = None,
                    tool_format: str | None = None) -> dict[str, Any]:
    """The answer; with tools under a grammar, its calls as `tool_calls` (a call the token
    limit cut off is not one: the answer says `length`)."""
    reasoning, content = split_reasoning(text)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    calls = []
    if tools is not None and tools.constrained and tool_format is not None:
        content, calls, _ = split_calls(tool_format, content, tools.tools)
        message["content"] = content or None
        if calls:
            message["tool_calls"] = calls_body(calls)
    if reasoning:
        message["reasoning_content"] = reasoning
    return {"id": cid, "object": "chat.completion", "created": int(time.time()),
            "model": model, "system_fingerprint": "flash_planner",
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": finish_reason(reason, bool(calls))}],
            "usage": usage(telemetry)}


def chunk_body(cid: str, model: str, delta: dict[str, Any], reason: str | None = None,
               usage_of: dict[str, Any] | None = None, called: bool = False) -> dict[str, Any]:
    body = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model, "system_fingerprint": "flash_planner",
            "choices": [{"index": 0, "delta": delta, "logprobs": None,
                         "finish_reason": None if reason is None else finish_reason(reason,
                                                                                    called)}]}
    if usage_of is not None:
        body["usage"] = usage(usage_of)
    return body
