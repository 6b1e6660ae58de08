"""`flash-planner serve`: an OpenAI-compatible HTTP server (FastAPI) on the planner's queue.

Endpoints: POST /v1/chat/completions (openai_api.py; tool calls: tool_api.py), POST /v1/plans
(our planner end to end, as `~/plan` answers it; `stream` sends each step as it closes),
GET /v1/skills (the catalog as OpenAI tools) and POST /v1/skills/check (calls of them checked
as plan steps are: planning/skill_tools.py), GET /v1/models,
GET /health, GET /metrics (Prometheus text). Every request runs through the same
PlannerService queue the ROS node uses, so its policy and depth hold here: a full queue (or
'reject' while busy) answers 429 at once. The model loads in the background after the
socket opens; until it has, /health says `loading` and requests get 503. A model that fails
to load or to warm up leaves /health at 503 `error` with the reason, which every request's
503 repeats.

Safe by default: it binds loopback unless told otherwise, `/v1/*` needs the bearer key when
one is set (--api-key or $FLASH_PLANNER_API_KEY), bodies over `max_body_bytes` get 413 and
prompts over `max_prompt_chars` too. Errors use OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`. A client that disconnects mid-stream
cancels its request, which stops within one speculative cycle.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ..engine.generate import GenerationSettings
from ..engine.inputs.chat import TemplateError, check_template_vars
from ..engine.inputs.grammar import GrammarError, JsonGrammarCompiler
from ..engine.inputs.tool_calls import (
    QWEN35,
    ToolCallStream,
    structural_tag,
    tool_call_format,
)
from ..planning.bt import xml_or_why
from ..planning.images import request_images
from ..planning.parse import PlanError
from ..planning.request import PlanRequest, PlanResult, RequestError
from ..planning.service import PlannerService
from ..planning.skill_tools import check_calls, skill_tools
from ..planning.ticket import Completion
from ..planning.warmup import WarmUpError
from .metrics import Metrics
from .openai_api import (
    ApiError,
    ChatRequest,
    ReasoningStream,
    bad,
    chunk_body,
    completion_body,
    parse_chat,
    text_chars,
)
from .tool_api import (
    ToolRequest,
    ToolRequestError,
    call_arguments,
    calls_body,
    check_control_text,
    control_texts,
    tool_string_tokens,
)

log = logging.getLogger(__name__)
BUSY = ("queue full", "busy with request")
# Under a response_format schema the thought is closed while this many tokens (at most half
# of max_tokens) are left for the answer, so that a long thought cannot leave the JSON unwritten.
SCHEMA_ANSWER_RESERVE = 160


@dataclass
class ServerState:
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = 16 << 20       # images come as data URLs inside bodies
    max_prompt_chars: int = 32_000
    default_max_tokens: int = 512
    service: PlannerService | None = None
    error: str | None = None                  # why loading failed
    grammars: dict[str, Any] = field(default_factory=dict)
    compiler: JsonGrammarCompiler | None = None   # built on first use (~1 s at 150k tokens)

    def ready(self) -> PlannerService:
        if self.service is None:
            why = f"the model failed to load: {self.error}" if self.error else \
                "the model is still loading"
            raise ApiError(503, why, "service_unavailable", code="not_ready")
        return self.service

    def _compiled(self, key: str, compile_: Callable[[JsonGrammarCompiler], Any]):
        if key not in self.grammars:
            if len(self.grammars) >= 32:
                self.grammars.pop(next(iter(self.grammars)))
            if self.compiler is None:
                self.compiler = JsonGrammarCompiler.for_engine(self.ready().engine)
            self.grammars[key] = compile_(self.compiler)
        return self.grammars[key]

    def grammar(self, schema: dict[str, Any]):
        def compile_(compiler: JsonGrammarCompiler):
            try:
                return compiler.compile(schema)
            except GrammarError as exc:
                raise bad(f"response_format: {exc}", "response_format") from None
        return self._compiled(json.dumps(schema, sort_keys=True), compile_)

    def tool_grammar(self, fmt: str, tools: ToolRequest):
        """The grammar of the request's tools under its tool_choice; a 400 naming the tool
        whose parameters xgrammar cannot take."""
        def compile_(compiler: JsonGrammarCompiler):
            try:
                return compiler.compile_tag(structural_tag(fmt, list(tools.tools),
                                                           tools.tool_choice, tools.parallel))
            except (GrammarError, ValueError) as exc:
                for tool in tools.tools:
                    try:
                        compiler.compile_tag(structural_tag(fmt, [tool], "required", True))
                    except (GrammarError, ValueError) as one:
                        raise bad(f"tools: the function {tool['function']['name']!r} cannot "
                                  f"be held by a grammar: {_first_line(one)}", "tools") from None
                raise bad(f"tools cannot be held by a grammar: {_first_line(exc)}",
                          "tools") from None
        return self._compiled(f"tools:{fmt}:{tools.key()}", compile_)


def _call_of(call: Any, i: int) -> tuple[str, dict]:
    """(name, arguments) of an OpenAI tool call or a {"name", "arguments"} object."""
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ToolRequestError(f"calls[{i}] must be {{'name', 'arguments'}} or an OpenAI tool "
                               "call", "calls")
    return fn["name"], call_arguments(fn.get("arguments", {}), f"calls[{i}].arguments", "calls")


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _status_of(result: PlanResult) -> int:
    """The HTTP status of a request the service did not run: 429 busy, 400 invalid."""
    if result.error.startswith(BUSY):
        return 429
    if result.error.startswith("the planner service is not running"):
        return 503
    return 400


def _refused(result: PlanResult, param: str | None = None) -> ApiError:
    status = _status_of(result)
    kind = {429: "rate_limit_exceeded", 503: "service_unavailable"}.get(status,
                                                                       "invalid_request_error")
    return ApiError(status, result.error, kind, param=param)


def _sse(data: Any) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def _to_loop(loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> None:
    """Run `fn(*args)` on `loop` from a worker thread; nothing once the loop has closed (the
    server stopped: no one waits)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass


class _Relay:
    """Worker-thread events into the request's event loop: deltas, steps, the result."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, kind: str, item: Any) -> None:
        _to_loop(self.loop, self.queue.put_nowait, (kind, item))

    def when_done(self, ticket) -> None:
        ticket.add_done_callback(lambda result: self.put("done", result))


def result_of(ticket) -> asyncio.Future:
    """The ticket's result, awaitable without a thread of its own: a thread per waiting
    request (asyncio.to_thread) capped the requests a client set could keep in flight at
    the default executor's size (cores + 4: 6 on two cores, under max_batch 8)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def deliver(result) -> None:
        if not future.done():          # not cancelled (a client that went away)
            future.set_result(result)

    ticket.add_done_callback(lambda result: _to_loop(loop, deliver, result))
    return future


def create_app(state: ServerState, load: Callable[[], PlannerService] | None = None
               ) -> FastAPI:
    """The app; `load` (run in a thread at startup) returns the started PlannerService."""

    def lifespan(app):
        class Span:
            async def __aenter__(self):
                if load is not None:
                    threading.Thread(target=_load, daemon=True, name="model-load").start()

            async def __aexit__(self, *exc):
                if state.service is not None:
                    state.service.stop()
        return Span()

    def _load() -> None:
        try:
            service = load()
            service.on_result = metrics.finished
            state.service = service
        except (WarmUpError, ValueError, OSError) as exc:
            # expected: a model that cannot decode, a bad checkpoint file (the engine's
            # CheckpointError), preset or setting; the message names it: one line is the story
            log.error("loading the model failed: %s", exc)
            log.debug("where loading failed", exc_info=True)
            state.error = str(exc)
        except Exception as exc:      # a bug: its stack; reported by /health and every 503
            log.exception("loading the model failed")
            state.error = f"{type(exc).__name__}: {exc}"

    app = FastAPI(title="flash_planner", lifespan=lifespan, docs_url=None, redoc_url=None)
    def in_service() -> float:
        service = state.service
        return float(service.queue_depth + service.running) if service is not None else 0.0

    metrics = app.state.metrics = Metrics(in_service,
                                          lambda: 1.0 if state.service is not None else 0.0)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        metrics.observe(request.url.path, exc.status)
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        return JSONResponse(ApiError(exc.status_code, str(exc.detail), "invalid_request_error"
                                     ).body(), status_code=exc.status_code)

    def check_key(request: Request) -> None:
        if state.api_key is not None:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {state.api_key}".encode()):
                raise ApiError(401, "a valid API key is required (Authorization: Bearer KEY)",
                               "authentication_error", code="invalid_api_key")

    async def body_of(request: Request) -> Any:
        check_key(request)
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > state.max_body_bytes:
            raise ApiError(413, f"the request body is {declared} bytes, the limit is "
                           f"{state.max_body_bytes}", code="request_too_large")
        raw = await request.body()
        if len(raw) > state.max_body_bytes:
            raise ApiError(413, f"the request body is {len(raw)} bytes, the limit is "
                           f"{state.max_body_bytes}", code="request_too_large")
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise bad(f"the request body is not valid JSON: {exc}") from None

    @app.get("/health")
    async def health():
        if state.service is not None:
            threads = state.service.engine.threads
            load = state.service.load_report()
            return {"status": "ok", "model": state.model_name,
                    "queue_depth": load["queued"], "busy": load["running"] > 0,
                    "running": load["running"], "max_batch": load["max_batch"],
                    "threads": threads.as_dict() if threads else None}
        body = {"status": "error" if state.error else "loading", "model": state.model_name}
        if state.error:
            body["error"] = state.error
        return JSONResponse(body, status_code=503)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        check_key(request)
        return {"object": "list", "data": [{"id": state.model_name, "object": "model",
                                            "created": 0, "owned_by": "flash_planner"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await body_of(request)
        service = state.ready()
        chat = parse_chat(body, state.model_name)
        chars = text_chars(chat.messages)
        if chars > state.max_prompt_chars:
            raise ApiError(413, f"the prompt is {chars} characters, the limit is "
                           f"{state.max_prompt_chars}", param="messages",
                           code="context_length_exceeded")
        if chat.reasoning_effort is not None:
            _check_effort(service, chat)
        fmt = _tool_format(service, chat) if chat.tools is not None else None
        # tool_choice none holds the answer to text with no call in it, unless a
        # response_format schema holds it already (JSON is no call)
        if chat.tools is not None and (chat.tools.constrained or chat.schema is None):
            grammar = state.tool_grammar(fmt, chat.tools)
        else:
            grammar = state.grammar(chat.schema) if chat.schema is not None else None
        try:
            images = request_images(chat.images, service.engine, service.config.images) \
                if chat.images else ()
        except RequestError as exc:
            raise bad(str(exc), exc.field) from None
        cid = "chatcmpl-" + uuid.uuid4().hex[:24]
        if chat.stream:
            return await _chat_stream(service, chat, cid, grammar, images, fmt)
        ticket = service.submit_completion(cid, _completion(service, chat, grammar, images,
                                                                  fmt))
        result = await result_of(ticket)
        _check_ran(result, ticket)
        metrics.observe("/v1/chat/completions", 200, result.telemetry)
        return completion_body(cid, state.model_name, result.raw_text, result.finish_reason,
                               result.telemetry, chat.tools, fmt)

    def _tool_format(service: PlannerService, chat: ChatRequest) -> str:
        """The model's tool-call format; a 400 when its template renders no tools, when
        tools and a response_format both hold the answer, or when a definition or a call's
        arguments hold a control token's text."""
        tokenizer = service.engine.tokenizer
        fmt = tool_call_format(tokenizer)
        if fmt is None:
            raise bad("this model's chat template does not render tools in a tool-call "
                      "format the server reads (Qwen3's JSON or Qwen3.5's <function=...> "
                      "calls inside <tool_call>): send the request without tools", "tools")
        if chat.tools.constrained and chat.schema is not None:
            raise bad("response_format and tools both hold the answer: give one (or "
                      "tool_choice none)", "response_format")
        control = control_texts(tokenizer)
        try:
            for i, tool in enumerate(chat.tools.tools):
                check_control_text(tool, f"tools[{i}]", control, "tools")
            for i, m in enumerate(chat.messages):
                check_control_text(m.get("tool_calls", []), f"messages[{i}].tool_calls",
                                   control, "messages")
        except ToolRequestError as exc:
            raise bad(str(exc), exc.param) from None
        return fmt

    def _check_effort(service: PlannerService, chat: ChatRequest) -> None:
        """400 naming reasoning_effort when the model's chat template does not take it or
        refuses the value (the template's own message)."""
        try:
            check_template_vars(service.engine.tokenizer,
                                {"reasoning_effort": chat.reasoning_effort},
                                chat.enable_thinking)
        except TemplateError as exc:
            raise bad(f"reasoning_effort {chat.reasoning_effort!r}: {exc}",
                      "reasoning_effort") from None

    def _completion(service: PlannerService, chat: ChatRequest, grammar, images,
                    fmt: str | None, on_token=None) -> Completion:
        max_new = chat.max_tokens or state.default_max_tokens
        settings = GenerationSettings(
            max_new_tokens=max_new, stop_strings=chat.stop, enable_thinking=chat.enable_thinking,
            sampling=None if chat.sampling.greedy else chat.sampling,
            reasoning_effort=chat.reasoning_effort,
            tools=chat.tools.tools if chat.tools is not None else ())
        constraint = None
        if grammar is not None:
            budget = max_new - min(SCHEMA_ANSWER_RESERVE, max_new // 2)
            # a tool call's strings and raw values close within a bound, so a model looping
            # inside one still closes its call (a call left open reaches no client)
            calls = chat.tools is not None and chat.tools.constrained
            bound = chat.max_string_tokens or (
                tool_string_tokens(service.config.max_string_tokens, max_new, chat.tools.tools)
                if calls else None)
            constraint = functools.partial(grammar.constraint, think_budget=budget,
                                           max_string_tokens=bound,
                                           raw_values=calls and fmt == QWEN35)
        return Completion(chat.messages, settings, constraint, on_token, images)

    def _check_ran(result: PlanResult, ticket) -> None:
        if result.success:
            return
        if result.finish_reason == "":                # never ran: busy, full or stopping
            raise _refused(result)
        if result.error.startswith("cannot generate"):
            raise bad(result.error.removeprefix("cannot generate: "), "messages")
        raise ApiError(500, result.error, "server_error")

    async def _chat_stream(service, chat: ChatRequest, cid: str, grammar, images,
                           fmt: str | None):
        relay = _Relay()
        ticket = service.submit_completion(
            cid, _completion(service, chat, grammar, images, fmt,
                             lambda ids, delta: relay.put("delta", delta)))
        if ticket.done():
            _check_ran(ticket.result(), ticket)
        relay.when_done(ticket)
        model = state.model_name

        calls = (ToolCallStream(fmt, chat.tools.tools)
                 if chat.tools is not None and chat.tools.constrained else None)
        called = 0

        def deltas(reasoning: str, content: str, final: bool = False):
            """The chunks of one text delta: reasoning, content, then each call closed."""
            nonlocal called
            if reasoning:
                yield _sse(chunk_body(cid, model, {"reasoning_content": reasoning}))
            closed = []
            if calls is not None:
                content, closed = calls.feed(content, final)
            if content:
                yield _sse(chunk_body(cid, model, {"content": content}))
            for call in calls_body(closed, called, with_index=True):
                yield _sse(chunk_body(cid, model, {"tool_calls": [call]}))
            called += len(closed)

        async def events() -> AsyncIterator[str]:
            split = ReasoningStream()
            try:
                yield _sse(chunk_body(cid, model, {"role": "assistant", "content": ""}))
                while True:
                    kind, item = await relay.queue.get()
                    if kind == "delta":
                        for chunk in deltas(*split.feed(item)):
                            yield chunk
                        continue
                    for chunk in deltas(*split.feed("", final=True), final=True):
                        yield chunk
                    result: PlanResult = item
                    status = 200 if result.success else 500
                    metrics.observe("/v1/chat/completions", status, result.telemetry)
                    if not result.success:
                        yield _sse(ApiError(500, result.error, "server_error").body())
                    else:
                        yield _sse(chunk_body(cid, model, {}, result.finish_reason,
                                              called=called > 0))
                        if chat.include_usage:
                            usage = chunk_body(cid, model, {}, usage_of=result.telemetry)
                            usage["choices"] = []
                            yield _sse(usage)
                    yield _sse("[DONE]")
                    return
            finally:
                if not ticket.done():                 # the client went away: stop decoding
                    try:
                        service.cancel(cid)
                    except ValueError:
                        pass

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/v1/skills")
    async def skills(request: Request):
        """The catalog's skills as OpenAI tools; `scene` (repeated) and `task` hold the
        grounded arguments to the request's names as the plan grammar does."""
        check_key(request)
        service = state.ready()
        scene = request.query_params.getlist("scene")
        task = request.query_params.get("task", "")
        return {"object": "list", "data": skill_tools(service.catalog, scene, task)}

    @app.post("/v1/skills/check")
    async def check_skills(request: Request):
        """Calls of the skills (OpenAI `tool_calls` or {"name", "arguments"} objects) as
        validated plan steps: the checks a plan gets; a 400 naming the first problem."""
        body = await body_of(request)
        service = state.ready()
        if not isinstance(body, dict) or not isinstance(body.get("calls"), list):
            raise bad("the body must be {'calls': [...], 'task'?: str, 'scene'?: [str]}",
                      "calls")
        try:
            calls = [_call_of(c, i) for i, c in enumerate(body["calls"])]
            steps = check_calls(service.catalog, calls, str(body.get("task", "")),
                                tuple(body.get("scene") or ()))
        except (PlanError, ToolRequestError) as exc:
            raise bad(str(exc), "calls") from None
        return {"steps": steps}

    @app.post("/v1/plans")
    async def plans(request: Request):
        body = await body_of(request)
        service = state.ready()
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object")
        stream = body.pop("stream", False)
        if not isinstance(stream, bool):
            raise bad("stream must be true or false", "stream")
        answer_format = body.pop("format", "json")
        if answer_format not in ("json", "bt"):
            raise bad(f"format must be json or bt (the plan also as a BehaviorTree.CPP v4 "
                      f"tree), got {answer_format!r}", "format")

        def answer(result: PlanResult) -> dict[str, Any]:
            out = result.as_dict()
            if answer_format == "bt" and result.success:
                xml, why = xml_or_why(result.plan, service.catalog)
                out["bt_xml"] = xml or None
                if why:
                    out["bt_error"] = why
            return out

        try:
            plan_request = PlanRequest.from_dict(body)
        except RequestError as exc:
            raise bad(str(exc), exc.field) from None
        if not stream:
            ticket = service.submit(plan_request)
            result = await result_of(ticket)
            if not result.success and (result.rejected or result.finish_reason == "" and
                                       result.error.startswith((*BUSY, "the planner"))):
                raise _refused(result, ticket.invalid_field)
            metrics.observe("/v1/plans", 200, result.telemetry)
            return answer(result)
        relay = _Relay()
        ticket = service.submit(plan_request, lambda fb: relay.put("steps", fb.steps))
        if ticket.done() and not ticket.result().success \
                and ticket.result().finish_reason == "":
            raise _refused(ticket.result(), ticket.invalid_field)
        relay.when_done(ticket)

        async def events() -> AsyncIterator[str]:
            try:
                while True:
                    kind, item = await relay.queue.get()
                    if kind == "steps":
                        for index, step in item:
                            yield _sse({"index": index, "step": step})
                        continue
                    metrics.observe("/v1/plans", 200, item.telemetry)
                    yield _sse(answer(item))
                    yield _sse("[DONE]")
                    return
            finally:
                if not ticket.done():
                    try:
                        service.cancel(ticket.id)
                    except ValueError:
                        pass

        return StreamingResponse(events(), media_type="text/event-stream")

    return app
