"""The planner service: a bounded request queue served by one worker thread.

The engine decodes one request at a time. A request arriving while the worker is busy is
queued, rejected, or preempts the running one (`policy`); a full queue rejects at once with
the reason. Requests can be cancelled by id (the running one stops within one speculative
cycle) and carry a deadline counted from submission. Every outcome is a `PlanResult`; an
invalid request, a model answer that is not a valid plan, or an engine failure never stops
the service from taking the next request.

With `constrain` (the default) the answer is decoded under the plan grammar compiled from the
catalog when the service is built (`plan_grammar.py`): every finished answer parses as a plan
or a refusal. Grounded arguments (`grounding.py`) name only what the request's task and scene
say: the request's grammar admits nothing else, and without the grammar a plan that names
anything else is an error naming the step and argument. Closed plan steps are found as they
stream (`steps.py`): each feedback carries the steps that closed in it, and telemetry says
when the first one did (`first_step_ms`).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from ..engine.cache import ContextOverflowError
from ..engine.chat import (
    TemplateError,
    TemplateVariableError,
    check_template_vars,
    encode_chat_parts,
)
from ..engine.engine import Engine
from ..engine.generate import CancelToken, GenerationSettings, generate
from ..engine.grammar import JsonGrammarCompiler
from ..engine.sampling import Sampling, resolve_sampling
from ..engine.speculative import NonFiniteLogits
from .grounding import RequestWords
from .parse import PlanError, PlanRefused, parse_plan
from .plan_grammar import PlanGrammar, answer_schema
from .planner_config import PlannerConfig
from .prompt import build_messages
from .remote import RemoteError, RemotePlanner
from .request import PlanRequest, PlanResult, RequestError
from .skills import SkillCatalog
from .steps import StepStream
from .warmup import warm_up

log = logging.getLogger(__name__)


class UnknownRequestError(ValueError):
    """cancel() of an id that is neither queued nor running."""


@dataclass(frozen=True)
class PlanFeedback:
    request_id: str
    delta_text: str
    tokens_so_far: int
    tokens_per_s: float
    mean_accepted: float
    steps: tuple[tuple[int, dict], ...] = ()    # (index, step) of plan steps closed here


FeedbackCallback = Callable[[PlanFeedback], None]


@dataclass(frozen=True)
class Completion:
    """A generic generation that shares the planner's queue (the server's chat completions):
    the prompt (chat messages or ids), its settings, an optional grammar constraint factory,
    and a token callback `on_token(ids, delta)` called from the worker."""
    prompt: Any
    settings: GenerationSettings
    constraint: Callable[[], Any] | None = None
    on_token: Callable[[list[int], str], None] | None = None


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
        self._done = threading.Event()
        self._result: PlanResult | None = None

    @property
    def id(self) -> str:
        return self.request.id

    def resolve(self, result: PlanResult) -> None:
        self._result = result
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> PlanResult:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} not finished after {timeout} s")
        return self._result


def _failed(request: PlanRequest, error: str, **extra) -> PlanResult:
    return PlanResult(request.id, str(request.task), success=False, error=error, **extra)


# What a request too long for the context can change (the error names it)
ROOM_FIX = ("raise the engine's max_context (--max-context, engine.max_context), lower "
            "max_new_tokens, or shorten the prompt (a shorter scene list or context; a "
            "catalog's enum_shown bounds the enum values its signatures list)")


class PlannerService:
    def __init__(self, engine: Engine, catalog: SkillCatalog, config: PlannerConfig):
        if engine.tokenizer is None:
            raise ValueError(f"{engine.config.model_path} has no tokenizer (tokenizer.json "
                             "and tokenizer_config.json): the planner needs one to read tasks")
        self.engine, self.catalog, self.config = engine, catalog, config
        # the local model's template must take it (unless only a remote model plans)
        if config.reasoning_effort is not None and config.backend != "remote":
            try:
                check_template_vars(engine.tokenizer,
                                    {"reasoning_effort": config.reasoning_effort},
                                    config.enable_thinking)
            except TemplateError as exc:
                raise ValueError(f"planner reasoning_effort {config.reasoning_effort!r}: "
                                 f"{exc}") from None
        # compiled once, at configure: a catalog it cannot express fails here (CatalogError)
        self.grammar = (PlanGrammar(catalog, JsonGrammarCompiler.for_engine(engine))
                        if config.constrain else None)
        self.remote = (RemotePlanner(config.remote) if config.backend != "local" else None)
        # requests that do not say sample this way ("model" read from the checkpoint)
        self._base_sampling = resolve_sampling(config.sampling, Sampling(),
                                               engine.generation_defaults, "planner.sampling")
        self._lock = threading.Condition()
        self._queue: collections.deque[PlanTicket] = collections.deque()
        self._running: PlanTicket | None = None
        self._stopping = False
        self._worker: threading.Thread | None = None
        self.on_result: Callable[[PlanResult], None] | None = None   # every finished result

    @classmethod
    def load(cls, engine_config, catalog: SkillCatalog, config: PlannerConfig,
             progress: Callable[[str], None] | None = None) -> PlannerService:
        """Load the engine of `engine_config` and build the service around it (not started);
        `progress` receives a line per long step (compiling, building segments)."""
        return cls(Engine.load(engine_config, progress=progress), catalog, config)

    def warm_up(self) -> float:
        """Prefill the fixed prefix (the system prompt with the catalog) into the engine's
        prefix cache and decode a short plan with each loaded proposer and with none, at
        least two whole blocks each, so the first request neither prefills the prefix nor
        pays any first call (a verify block's kernels and shapes, each proposer's own);
        then the proposers forget what they measured here (`auto`: cold calls, a plan cut
        short) and measure afresh on real requests. Returns ms; a remote-only planner, whose
        engine never decodes a request, skips it. A model that cannot decode raises
        `WarmUpError` (warmup.py)."""
        return warm_up(self)

    def prompt(self, task: str, context: str, thinking: bool, scene=(),
               reasoning_effort: str | None = None) -> tuple[list[int], list[int]]:
        """The request's prompt ids and its fixed prefix: every id before the task's message
        (the system prompt with the catalog), a token boundary by construction.
        `reasoning_effort` goes to the chat template (None: the template's default)."""
        messages = build_messages(self.catalog, task, context, self.config.refusal_hint,
                                  scene)
        ids, starts = encode_chat_parts(self.engine.tokenizer, messages, thinking,
                                        {"reasoning_effort": reasoning_effort})
        return ids, ids[:starts[-1]]

    def _grammar_state(self) -> str:
        if self.grammar is None:
            return "off"
        return "on, per request (grounded arguments)" if self.catalog.has_grounded else "on"

    def summary(self) -> str:
        """What is loaded, for a log line: model, device, memory, proposers, grammar."""
        engine = self.engine
        return (f"{engine.config.model_path} on {engine.device} ({engine.dtype}): "
                f"{engine.memory}; proposers: {', '.join(engine.proposers) or 'none'} "
                f"(method {engine.config.method}); plan grammar {self._grammar_state()}; "
                f"prefix cache {'on' if engine.prefix_cache is not None else 'off'}; "
                f"{engine.compile_report or 'eager forwards (compile off)'}")

    # ---- lifecycle
    def start(self) -> None:
        with self._lock:
            if self._worker is not None:
                return
            self._stopping = False
            self._worker = threading.Thread(target=self._serve, name="flash-planner-worker",
                                            daemon=True)
            self._worker.start()

    def stop(self, timeout: float = 10.0, reason: str = "the planner service stopped") -> None:
        """End the running request and every queued one with `reason`; join the worker."""
        with self._lock:
            self._stopping = True
            dropped = list(self._queue)
            self._queue.clear()
            if self._running is not None:
                self._running.cancel_reason = reason
                self._running.cancel_token.cancel()
            self._lock.notify_all()
            worker, self._worker = self._worker, None
        for ticket in dropped:
            self._end_queued(ticket, reason)
        if worker is not None:
            worker.join(timeout)

    @property
    def queue_depth(self) -> int:
        with self._lock:
            return len(self._queue)

    @property
    def busy(self) -> bool:
        with self._lock:
            return self._running is not None

    # ---- requests
    def submit(self, request: PlanRequest, on_feedback: FeedbackCallback | None = None
               ) -> PlanTicket:
        """Queue a request. Rejections resolve the returned ticket at once, with the reason."""
        ticket = PlanTicket(request, on_feedback)
        try:
            ticket.request = request = request.checked(self.config.max_task_chars,
                                                       self.config.max_context_chars)
            ticket.request = request = replace(request, sampling=self._sampling(request))
            self._check_effort(request)
        except RequestError as exc:
            ticket.invalid_field = exc.field
            self._finish(ticket, _failed(request, f"invalid request: {exc}", rejected=True))
            return ticket
        return self._enqueue(ticket)

    def _enqueue(self, ticket: PlanTicket) -> PlanTicket:
        """Queue a checked ticket under the queue policy, or resolve it with the reason."""
        request = ticket.request
        preempted: list[PlanTicket] = []
        with self._lock:
            reason = self._admission(request, preempted)
            if reason is None:
                self._queue.append(ticket)
                self._lock.notify_all()
        for old in preempted:  # queued ones; the running one is ended by the worker
            self._end_queued(old, f"preempted by request {request.id}")
        if reason is not None:
            self._finish(ticket, _failed(request, reason))
        return ticket

    def _admission(self, request: PlanRequest, preempted: list[PlanTicket]) -> str | None:
        """Why the request cannot be queued now (None: it can). Called under the lock."""
        if self._stopping or self._worker is None:
            return "the planner service is not running"
        ids = {t.id for t in self._queue} | ({self._running.id} if self._running else set())
        if request.id in ids:
            return f"a request with id '{request.id}' is already queued or running"
        busy = self._running is not None or self._queue
        if busy and self.config.policy == "reject":
            current = self._running.id if self._running else self._queue[0].id
            return f"busy with request {current} (queue policy 'reject')"
        if busy and self.config.policy == "preempt":
            preempted.extend(self._queue)
            self._queue.clear()
            running = self._running
            if running is not None and not running.cancel_token.cancelled:  # name the first
                running.cancel_reason = f"preempted by request {request.id}"
                running.cancel_token.cancel()
            return None
        if len(self._queue) >= self.config.queue_depth:
            return f"queue full ({self.config.queue_depth} requests waiting)"
        return None

    def cancel(self, request_id: str) -> None:
        """Cancel a queued or running request; UnknownRequestError if there is none."""
        with self._lock:
            queued = next((t for t in self._queue if t.id == request_id), None)
            if queued is not None:
                self._queue.remove(queued)
            elif self._running is not None and self._running.id == request_id:
                self._running.cancel_token.cancel()
                return
            else:
                raise UnknownRequestError(f"no queued or running request with id "
                                          f"'{request_id}'")
        self._end_queued(queued, "cancelled while queued")

    def submit_completion(self, request_id: str, completion: Completion) -> PlanTicket:
        """Queue a generic generation under the same policy as plans (a full queue or a
        'reject' policy while busy resolves the ticket at once with the reason). Its result
        carries the text, finish reason and telemetry; success means it ran."""
        return self._enqueue(PlanTicket(PlanRequest(task="(completion)", id=request_id), None,
                                        completion))

    def plan(self, request: PlanRequest, on_feedback: FeedbackCallback | None = None,
             timeout: float | None = None) -> PlanResult:
        """Submit and wait: the blocking form."""
        return self.submit(request, on_feedback).result(timeout)

    # ---- the worker
    def _serve(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._stopping:
                    self._lock.wait()
                if self._stopping:
                    return
                ticket = self._queue.popleft()
                self._running = ticket
            try:
                result = self._run(ticket)
            except Exception as exc:  # keep serving whatever one request did
                log.exception("request %s failed", ticket.id)
                result = _failed(ticket.request, f"internal error: {type(exc).__name__}: {exc}",
                                 finish_reason="error")
            with self._lock:
                self._running = None
            self._finish(ticket, result)

    def _end_queued(self, ticket: PlanTicket, reason: str) -> None:
        """End a request that never ran (cancelled, preempted or dropped at stop): it ends
        `cancelled` with the reason, as a running one does."""
        self._finish(ticket, _failed(ticket.request, reason, finish_reason="cancelled"))

    def _finish(self, ticket: PlanTicket, result: PlanResult) -> None:
        result.telemetry.setdefault("request_id", ticket.id)
        result.telemetry.setdefault("total_latency_ms",
                                    round((time.monotonic() - ticket.submitted) * 1000, 3))
        ticket.resolve(result)
        if self.on_result is not None:
            try:
                self.on_result(result)
            except Exception:  # a broken listener must not break the service
                log.exception("on_result listener failed")

    def _sampling(self, request: PlanRequest) -> Sampling:
        """The request's sampling over the service's default; RequestError names what is
        wrong."""
        try:
            sampling = resolve_sampling(request.sampling, self._base_sampling,
                                        self.engine.generation_defaults, "sampling")
            sampling = sampling.with_seed(request.seed)
        except ValueError as exc:
            raise RequestError(str(exc), "sampling") from None
        if self.config.relaxed_thinking and not sampling.greedy:
            raise RequestError("this request samples, and relaxed thinking acceptance "
                               "(speculative.relaxed_thinking) is defined for greedy decoding "
                               "only: send temperature 0 or turn relaxed thinking off",
                               "sampling")
        return sampling

    def _check_effort(self, request: PlanRequest) -> None:
        """RequestError when the request names a reasoning effort the local model's chat
        template does not take, or a value it refuses (its own message); a remote-only
        planner leaves that to the remote model."""
        if request.reasoning_effort is None or self.config.backend == "remote":
            return
        try:
            check_template_vars(self.engine.tokenizer,
                                {"reasoning_effort": request.reasoning_effort},
                                self._thinking(request))
        except TemplateVariableError as exc:
            raise RequestError(str(exc), "reasoning_effort") from None
        except TemplateError as exc:
            raise RequestError(f"reasoning_effort {request.reasoning_effort!r}: {exc}",
                               "reasoning_effort") from None

    def _effort(self, request: PlanRequest) -> str | None:
        return (self.config.reasoning_effort if request.reasoning_effort is None
                else request.reasoning_effort)

    def _settings(self, request: PlanRequest, waited_s: float) -> GenerationSettings:
        cfg = self.config
        deadline = request.deadline_s if request.deadline_s is not None else cfg.deadline_s
        return GenerationSettings(
            max_new_tokens=request.max_new_tokens or cfg.max_new_tokens,
            deadline_s=None if deadline is None else max(deadline - waited_s, 1e-3),
            speculative=cfg.speculative if request.speculative is None else request.speculative,
            method=request.method,
            relaxed_thinking=cfg.relaxed_thinking,
            relaxed_topk=cfg.relaxed_topk, relaxed_delta=cfg.relaxed_delta,
            enable_thinking=self._thinking(request), sampling=request.sampling,
            reasoning_effort=self._effort(request))

    def _thinking(self, request: PlanRequest) -> bool:
        return (self.config.enable_thinking if request.enable_thinking is None
                else request.enable_thinking)

    def _complete(self, ticket: PlanTicket) -> PlanResult:
        job, request = ticket.completion, ticket.request
        telemetry = {"queue_wait_ms": round((time.monotonic() - ticket.submitted) * 1000, 3)}
        try:
            out = generate(self.engine, job.prompt, job.settings, on_token=job.on_token,
                           cancel=ticket.cancel_token,
                           constraint=job.constraint() if job.constraint else None)
        except (ContextOverflowError, ValueError) as exc:
            return _failed(request, f"cannot generate: {exc}", telemetry=telemetry)
        except NonFiniteLogits as exc:
            return _failed(request, str(exc), finish_reason="error", telemetry=telemetry)
        telemetry.update(out.stats.as_dict())
        if out.finish_reason == "cancelled":
            return _failed(request, ticket.cancel_reason, raw_text=out.text,
                           finish_reason="cancelled", telemetry=telemetry)
        return PlanResult(request.id, request.task, True, raw_text=out.text,
                          finish_reason=out.finish_reason, telemetry=telemetry)

    def _run(self, ticket: PlanTicket) -> PlanResult:
        if ticket.completion is not None:
            return self._complete(ticket)
        request = ticket.request
        waited = time.monotonic() - ticket.submitted
        telemetry = {"queue_wait_ms": round(waited * 1000, 3)}
        deadline = request.deadline_s if request.deadline_s is not None else \
            self.config.deadline_s
        if deadline is not None and waited >= deadline:
            return _failed(request, f"deadline of {deadline} s passed while queued",
                           finish_reason="deadline", telemetry=telemetry)
        # what grounded names may be
        words = RequestWords.of(request.task, request.context, request.scene)
        if self.remote is not None:
            result = self._run_remote(ticket, deadline, telemetry, words)
            if result is not None:
                return result
        telemetry["backend"] = "local"
        try:
            ids, prefix = self.prompt(request.task, request.context, self._thinking(request),
                                      request.scene, self._effort(request))
            max_new = request.max_new_tokens or self.config.max_new_tokens
            self.engine.check_fits(len(ids), max_new)
            constraint = None
            if self.grammar is not None:
                budget = max(0, max_new - self.config.answer_reserve)
                t0 = time.monotonic()   # the request's own grammar is compiled here
                constraint = self.grammar.constraint(
                    think_budget=budget, words=words,
                    max_string_tokens=self.config.max_string_tokens)
                telemetry["grammar_ms"] = round((time.monotonic() - t0) * 1000, 3)
            # the deadline counts from submission: what encoding the prompt and making the
            # grammar's matcher took is not given back (the last thing before generating)
            settings = self._settings(request, time.monotonic() - ticket.submitted)
            # first_step_ms counts from here, as generate's clock does
            listener = _Listener(ticket, StepStream(self.catalog, words))
            out = generate(self.engine, ids, settings, on_token=listener,
                           cancel=ticket.cancel_token, constraint=constraint, prefix=prefix)
        except ContextOverflowError as exc:
            return _failed(request, f"cannot plan this request: {exc}: {ROOM_FIX}",
                           telemetry=telemetry, rejected=True)
        except ValueError as exc:
            return _failed(request, f"cannot plan this request: {exc}", telemetry=telemetry)
        except NonFiniteLogits as exc:
            log.error("request %s: %s", request.id, exc)
            return _failed(request, str(exc), finish_reason="error", telemetry=telemetry)
        telemetry.update(out.stats.as_dict())
        if constraint is not None:
            telemetry["strings_cut"] = constraint.matcher.cut
            if constraint.matcher.cut:
                log.warning("request %s: %d string(s) of the answer reached %d tokens and "
                            "were closed there (planner.max_string_tokens)", request.id,
                            constraint.matcher.cut, self.config.max_string_tokens)
        if listener.first_step_ms is not None:
            telemetry["first_step_ms"] = round(listener.first_step_ms, 3)
        base = dict(raw_text=out.text, finish_reason=out.finish_reason, telemetry=telemetry)
        if out.finish_reason == "cancelled":
            return _failed(request, ticket.cancel_reason, **base)
        if out.finish_reason == "deadline":
            return _failed(request, f"deadline of {deadline} s reached during generation",
                           **base)
        try:
            steps, thinking = parse_plan(out.text, self.catalog,
                                         truncated=out.finish_reason == "length", words=words)
        except PlanRefused as exc:
            return _failed(request, str(exc), refusal=exc.reason, **base)
        except PlanError as exc:
            more = f" (max_new_tokens {max_new}: raise it for longer plans)" \
                if out.finish_reason == "length" else ""
            return _failed(request, f"{exc}{more}", **base)
        return PlanResult(request.id, request.task, True, plan=steps, thinking=thinking,
                          **base)


    def _run_remote(self, ticket: PlanTicket, deadline: float | None, telemetry: dict,
                    words: RequestWords) -> PlanResult | None:
        """The plan from the remote, or None to plan locally (remote_or_local, after a
        failure, whose reason goes to telemetry `remote_error`)."""
        request, cfg = ticket.request, self.config
        fallback = cfg.backend == "remote_or_local"
        end = None if deadline is None else ticket.submitted + deadline - (
            cfg.remote_reserve_s if fallback else 0.0)
        thinking = self._thinking(request)
        max_new = request.max_new_tokens or cfg.max_new_tokens
        messages = build_messages(self.catalog, request.task, request.context,
                                  cfg.refusal_hint, request.scene)
        sampling = request.sampling if isinstance(request.sampling, Sampling) and \
            not request.sampling.greedy else None
        listener = _Listener(ticket, StepStream(self.catalog, words))
        t0 = time.monotonic()
        try:
            text = self.remote.complete(
                self.remote.body(messages, answer_schema(self.catalog, words), max_new,
                                 thinking, sampling, self._effort(request)),
                lambda delta: listener([], delta), end,
                lambda: ticket.cancel_token.cancelled)
            steps, thought = parse_plan(text, self.catalog, words=words)
        except PlanRefused as exc:
            latency = (time.monotonic() - t0) * 1000
            self.remote.health.record(True, latency)
            telemetry.update(backend="remote", remote_latency_ms=round(latency, 3))
            return _failed(request, str(exc), refusal=exc.reason, raw_text=text,
                           finish_reason="eos", telemetry=telemetry)
        except (RemoteError, PlanError) as exc:
            why = (f"the remote answered an invalid plan: {exc}" if isinstance(exc, PlanError)
                   else str(exc))
            self.remote.health.record(False, (time.monotonic() - t0) * 1000, why)
            if ticket.cancel_token.cancelled:
                return _failed(request, ticket.cancel_reason, finish_reason="cancelled",
                               telemetry={**telemetry, "backend": "remote"})
            if fallback and (deadline is None
                             or time.monotonic() < ticket.submitted + deadline):
                log.warning("request %s: remote failed (%s); planning locally", request.id,
                            why)
                telemetry["remote_error"] = why
                return None
            return _failed(request, f"remote backend: {why}", finish_reason="error",
                           telemetry={**telemetry, "backend": "remote"})
        latency = (time.monotonic() - t0) * 1000
        self.remote.health.record(True, latency)
        telemetry.update(backend="remote", remote_latency_ms=round(latency, 3))
        if listener.first_step_ms is not None:
            telemetry["first_step_ms"] = round(listener.first_step_ms, 3)
        return PlanResult(request.id, request.task, True, plan=steps, thinking=thought,
                          raw_text=text, finish_reason="eos", telemetry=telemetry)


class _Listener:
    """The token callback of one request: finds closed plan steps in the streamed text and
    forwards feedback (with those steps) to the ticket's consumer, if it has one."""

    def __init__(self, ticket: PlanTicket, steps: StepStream):
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
