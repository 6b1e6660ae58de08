"""The planner service: a bounded request queue served by one scheduler thread.

The engine decodes up to `max_batch` requests at once (`engine/batch.py`: one verify per
cycle for all of them; max_batch 1 decodes one at a time on the engine's own state). The
scheduler moves queued requests into flight while a slot is free, runs the batch's cycles
and resolves each request as it ends. A request arriving while every slot is taken is
queued, rejected, or preempts the others (`policy`); a full queue rejects at once with the
reason. Requests can be cancelled by id (a running one stops within one speculative cycle)
and carry a deadline counted from submission. Every outcome is a `PlanResult`; an invalid
request, a model answer that is not a valid plan, or an engine failure ends that request
alone and never stops the service from taking the next. A remote backend's requests wait on
their server in threads of their own, beside the batch.

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
from concurrent.futures import Future, ThreadPoolExecutor

from ..engine.batch import Batch
from ..engine.engine import Engine
from ..engine.generate import GenerationSettings
from ..engine.inputs.chat import TemplateError, check_template_vars, encode_chat_parts
from ..engine.inputs.grammar import JsonGrammarCompiler
from ..engine.loop.sampling import Sampling, resolve_sampling
from .feedback import FeedbackCallback, PlanFeedback
from .grounding import RequestWords
from .local_job import LocalJob, completion_job, failed, plan_job
from .plan_grammar import PlanGrammar
from .planner_config import PlannerConfig
from .prompt import build_messages
from .remote import RemotePlanner
from .remote_job import remote_job
from .request import PlanRequest, PlanResult, RequestError, RequestRules
from .skills import SkillCatalog
from .ticket import Completion, PlanTicket
from .warmup import warm_up

__all__ = ["Completion", "PlanFeedback", "PlanTicket", "PlannerService",
           "UnknownRequestError"]

log = logging.getLogger(__name__)


class UnknownRequestError(ValueError):
    """cancel() of an id that is neither queued nor running."""


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
        self.grammar = (PlanGrammar(catalog, JsonGrammarCompiler.for_engine(engine),
                                    config.recovery)
                        if config.constrain else None)
        self.remote = (RemotePlanner(config.remote) if config.backend != "local" else None)
        # what every request is checked against before it is queued; requests that do not
        # say sample the planner's way ("model" read from the checkpoint)
        self.rules: RequestRules = RequestRules(
            max_task_chars=config.max_task_chars, max_context_chars=config.max_context_chars,
            base_sampling=resolve_sampling(config.sampling, Sampling(),
                                           engine.generation_defaults, "planner.sampling"),
            generation_defaults=engine.generation_defaults,
            relaxed_thinking=config.relaxed_thinking, enable_thinking=config.enable_thinking,
            backend=config.backend, tokenizer=engine.tokenizer, engine=engine,
            image_limits=config.images)
        # the local model's requests decode in one batch (none for a remote-only planner)
        self.batch = Batch(engine) if config.backend != "remote" else None
        self.max_batch = (self.batch.max_batch if self.batch is not None
                          else engine.config.resolve_max_batch(engine.device))
        self._lock = threading.Condition()
        self._queue: collections.deque[PlanTicket] = collections.deque()
        self._inflight: dict[str, PlanTicket] = {}
        self._stopping = False
        self._worker: threading.Thread | None = None
        self._preparer = ThreadPoolExecutor(1, thread_name_prefix="flash-planner-prepare")
        self.on_result: Callable[[PlanResult], None] | None = None   # every finished result
        # skill -> why it cannot run now (its server is not on the graph: the ROS node's
        # check); such skills are left out of each request's plan grammar. Replaced whole
        # (`set_unavailable`), read once per request.
        self.unavailable: dict[str, str] = {}

    @classmethod
    def load(cls, engine_config, catalog: SkillCatalog, config: PlannerConfig,
             progress: Callable[[str], None] | None = None) -> PlannerService:
        """Load the engine of `engine_config` and build the service around it (not started);
        `progress` receives a line per long step (compiling, building segments). Graphs left
        to the background compile after `warm_up` (or from the first request served)."""
        return cls(Engine.load(engine_config, progress=progress, hold_background=True),
                   catalog, config)

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
               reasoning_effort: str | None = None, images: int = 0, progress: str = ""
               ) -> tuple[list[int], list[int]]:
        """The request's prompt ids and its fixed prefix: every id before the task's message
        (the system prompt with the catalog), a token boundary by construction.
        `reasoning_effort` goes to the chat template (None: the template's default);
        `images` image parts open the task's message (one image token each, expanded by
        the engine)."""
        def encode(images: int) -> tuple[list[int], list[int]]:
            messages = build_messages(self.catalog, task, context, self.config.refusal_hint,
                                      scene, images, progress, self.config.recovery)
            ids, starts = encode_chat_parts(self.engine.tokenizer, messages, thinking,
                                            {"reasoning_effort": reasoning_effort})
            return ids, ids[:starts[-1]]

        ids, prefix = encode(images)
        if images:   # the prefix ends where the task's message begins, before its images:
            # the ids the text-only prompt's prefix shares (one cached prefix for both)
            text_prefix = encode(0)[1]
            n = next((i for i, (a, b) in enumerate(zip(ids, text_prefix)) if a != b),
                     min(len(ids), len(text_prefix)))
            prefix = ids[:n]
        return ids, prefix

    def _grammar_state(self) -> str:
        if self.grammar is None:
            return "off"
        return "on, per request (grounded arguments)" if self.catalog.has_grounded else "on"

    def _batch_state(self) -> str:
        if self.batch is None or self.max_batch == 1:
            return "one request at a time"
        return (f"up to {self.max_batch} requests at once "
                f"({self.batch.slots.nbytes.total / (1 << 20):.1f} MiB of slots)")

    def summary(self) -> str:
        """What is loaded, for a log line: model, device, memory, proposers, grammar."""
        engine = self.engine
        return (f"{engine.config.model_path} on {engine.device} ({engine.dtype}): "
                f"{engine.memory}; proposers: {', '.join(engine.proposers) or 'none'} "
                f"(method {engine.config.method}); plan grammar {self._grammar_state()}; "
                f"prefix cache {'on' if engine.prefix_cache is not None else 'off'}; "
                f"{self._batch_state()}; {engine.kv_scales_label}; "
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
        """End every running request and every queued one with `reason`; join the
        scheduler (running requests end within a cycle)."""
        with self._lock:
            self._stopping = True
            dropped = list(self._queue)
            self._queue.clear()
            for ticket in self._inflight.values():
                ticket.cancel_reason = reason
                ticket.cancel_token.cancel()
            self._lock.notify_all()
            worker, self._worker = self._worker, None
        for ticket in dropped:
            self._end_queued(ticket, reason)
        if worker is not None:
            worker.join(timeout)

    @property
    def queue_depth(self) -> int:
        """Requests waiting for a slot."""
        with self._lock:
            return len(self._queue)

    @property
    def running(self) -> int:
        """Requests in flight: decoding, prefilling, or waiting on a remote server."""
        with self._lock:
            return len(self._inflight)

    @property
    def busy(self) -> bool:
        return self.running > 0

    def load_report(self) -> dict[str, int]:
        """What the scheduler holds now and has done (diagnostics): running and queued
        requests, the slots, and the batch's cycles and published tokens so far."""
        stats = self.batch.stats if self.batch is not None else None
        return {"running": self.running, "queued": self.queue_depth,
                "max_batch": self.max_batch,
                "cycles": stats.cycles if stats else 0, "tokens": stats.tokens if stats else 0}

    # ---- requests
    def submit(self, request: PlanRequest, on_feedback: FeedbackCallback | None = None
               ) -> PlanTicket:
        """Queue a request. Rejections resolve the returned ticket at once, with the reason."""
        ticket = PlanTicket(request, on_feedback)
        try:
            ticket.request, ticket.image_age_ms = self.rules.checked(request)
        except RequestError as exc:
            self._finish(ticket, ticket.rejected(exc))
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
            self._finish(ticket, failed(request, reason))
        return ticket

    def _admission(self, request: PlanRequest, preempted: list[PlanTicket]) -> str | None:
        """Why the request cannot be queued now (None: it can). Called under the lock."""
        if self._stopping or self._worker is None:
            return "the planner service is not running"
        if request.id in self._inflight or any(t.id == request.id for t in self._queue):
            return f"a request with id '{request.id}' is already queued or running"
        # the requests ahead of this one that hold or wait for a slot
        taken = len(self._inflight) + len(self._queue)
        if self.config.policy == "preempt" and taken:
            # the newest request supersedes every other (one robot, its latest task)
            preempted.extend(self._queue)
            self._queue.clear()
            for running in self._inflight.values():
                if not running.cancel_token.cancelled:       # name the first preemption
                    running.cancel_reason = f"preempted by request {request.id}"
                    running.cancel_token.cancel()
            return None
        if taken >= self.max_batch and self.config.policy == "reject":
            current = next(iter(self._inflight), None) or self._queue[0].id
            return (f"busy with request {current} and every other slot "
                    f"(max_batch {self.max_batch}; queue policy 'reject')")
        if taken >= self.max_batch + self.config.queue_depth:
            return (f"queue full ({self.config.queue_depth} requests waiting, "
                    f"{self.max_batch} running)")
        return None

    def cancel(self, request_id: str) -> None:
        """Cancel a queued or running request; UnknownRequestError if there is none."""
        with self._lock:
            queued = next((t for t in self._queue if t.id == request_id), None)
            if queued is not None:
                self._queue.remove(queued)
            elif request_id in self._inflight:
                self._inflight[request_id].cancel_token.cancel()
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

    def plan_in_this_thread(self, request: PlanRequest) -> PlanResult:
        """Plan `request` in the calling thread, the service not started (a profiler records
        the ops of the thread that started it: bench/gpu.py)."""
        if self._worker is not None:
            raise RuntimeError("the service is running: submit the request instead")
        ticket = PlanTicket(request, None)
        made = plan_job(self, ticket, self._words(request), {}, self._deadline(request))
        if isinstance(made, PlanResult):
            return made
        future = self.batch.submit(made.work)
        while not future.done():
            self.batch.step()
        error = future.exception()
        return made.outcome(None if error else future.result(), error)

    def plan(self, request: PlanRequest, on_feedback: FeedbackCallback | None = None,
             timeout: float | None = None) -> PlanResult:
        """Submit and wait: the blocking form."""
        return self.submit(request, on_feedback).result(timeout)

    # ---- the scheduler
    def _serve(self) -> None:
        """Move queued requests into flight while slots are free, run the batch's cycles,
        resolve requests as they end; after `stop`, until none is in flight."""
        while True:
            with self._lock:
                # a queued request is work only while a slot is free: waiting on anything
                # else spun this loop through every queued request's preparation, holding
                # the GIL from the preparing thread (one at a time ran ~0.6x as fast queued)
                while not self._stopping and not self._admissible() and not self._progress():
                    self._lock.wait()
                if self._stopping and not self._inflight:
                    return
                admitted = []
                while self._admissible():
                    ticket = self._queue.popleft()
                    self._inflight[ticket.id] = ticket
                    admitted.append(ticket)
            if admitted and self.engine.background_held:   # serving without a warm-up
                self.engine.compile_in_background(release=True)
            for ticket in admitted:
                self._guarded(ticket, self._launch)
            if self.batch is not None and (self.batch.running or self.batch.waiting):
                try:
                    self.batch.step()
                except Exception as exc:   # a fault of the batch itself: its requests end
                    log.exception("the decoding batch failed")
                    self.batch.abort(exc)
            self._collect()

    def _admissible(self) -> bool:
        """Whether a queued request can take a slot now. Called under the lock."""
        return bool(self._queue) and len(self._inflight) < self.max_batch

    def _progress(self) -> bool:
        """Whether the scheduler has work without a new request: a cycle to run or a
        finished request to resolve. Called under the lock."""
        if self.batch is not None and (self.batch.running or self.batch.waiting):
            return True
        return any(t.future is not None and t.future.done() for t in self._inflight.values())

    def _guarded(self, ticket: PlanTicket, step: Callable[[PlanTicket], None]) -> None:
        """Run a scheduler step of one request; whatever it raises ends that request."""
        try:
            step(ticket)
        except Exception as exc:  # keep serving whatever one request did
            log.exception("request %s failed", ticket.id)
            self._resolve(ticket, failed(ticket.request, f"internal error: "
                                         f"{type(exc).__name__}: {exc}", finish_reason="error"))

    def _launch(self, ticket: PlanTicket) -> None:
        """Put a request in flight: to the batch, or to its remote server first."""
        if ticket.completion is not None:
            return self._prepare(ticket, completion_job, self, ticket)
        request = ticket.request
        waited = time.monotonic() - ticket.submitted
        telemetry = ticket.telemetry = {"queue_wait_ms": round(waited * 1000, 3)}
        if ticket.image_age_ms is not None:
            telemetry["image_age_ms"] = round(ticket.image_age_ms, 3)
        deadline = self._deadline(request)
        if deadline is not None and waited >= deadline:
            return self._resolve(ticket, failed(
                request, f"deadline of {deadline} s passed while queued",
                finish_reason="deadline", telemetry=telemetry))
        # a request with images plans here: the remote takes text only
        if self.remote is not None and not ticket.remote_tried and not request.images:
            ticket.remote_tried, ticket.stage = True, "remote"
            ticket.future = Future()
            threading.Thread(target=self._remote_attempt, args=(ticket, deadline),
                             name=f"flash-planner-remote-{ticket.id}", daemon=True).start()
            return None
        return self._prepare(ticket, plan_job, self, ticket, self._words(request), telemetry,
                             deadline)

    def _prepare(self, ticket: PlanTicket, make: Callable[..., LocalJob | PlanResult],
                 *args) -> None:
        """Make the request's job (its prompt encoded, its grammar compiled: milliseconds
        each) on the preparing thread, beside the batch's cycles, not between them."""
        ticket.stage = "prepare"
        ticket.future = self._preparer.submit(make, *args)
        ticket.future.add_done_callback(lambda _: self._wake())

    def _wake(self) -> None:
        with self._lock:
            self._lock.notify_all()

    def _to_batch(self, ticket: PlanTicket, job: LocalJob) -> None:
        ticket.job, ticket.stage = job, "batch"
        ticket.future = self.batch.submit(job.work)

    def _remote_attempt(self, ticket: PlanTicket, deadline: float | None) -> None:
        """A remote request's own thread: its result, or None to plan locally."""
        try:
            result = remote_job(self, ticket, deadline, ticket.telemetry,
                                self._words(ticket.request))
        except Exception as exc:
            log.exception("request %s failed", ticket.id)
            result = failed(ticket.request, f"internal error: {type(exc).__name__}: {exc}",
                            finish_reason="error")
        ticket.future.set_result(result)
        self._wake()

    def _collect(self) -> None:
        """Resolve the requests whose work ended; a remote failure falls back to the batch."""
        with self._lock:
            ended = [t for t in self._inflight.values()
                     if t.future is not None and t.future.done()]
        for ticket in ended:
            self._guarded(ticket, self._read)

    def _read(self, ticket: PlanTicket) -> None:
        future, job = ticket.future, ticket.job
        ticket.future = None
        if ticket.stage == "remote":         # its result, or None: plan locally
            result = future.result()
            if result is not None:
                return self._resolve(ticket, result)
            return self._prepare(ticket, plan_job, self, ticket, self._words(ticket.request),
                                 ticket.telemetry, self._deadline(ticket.request))
        if ticket.stage == "prepare":        # the job, or the result that ends it now
            made = future.result()
            if isinstance(made, PlanResult):
                return self._resolve(ticket, made)
            return self._to_batch(ticket, made)
        error = future.exception()
        return self._resolve(ticket, job.outcome(None if error else future.result(), error))

    def _resolve(self, ticket: PlanTicket, result: PlanResult) -> None:
        with self._lock:
            self._inflight.pop(ticket.id, None)
        self._finish(ticket, result)

    def _deadline(self, request: PlanRequest) -> float | None:
        return request.deadline_s if request.deadline_s is not None else self.config.deadline_s

    @staticmethod
    def _words(request: PlanRequest) -> RequestWords:
        """What grounded names may be."""
        return RequestWords.of(request.task, request.context, request.scene)

    def _end_queued(self, ticket: PlanTicket, reason: str) -> None:
        """End a request that never ran (cancelled, preempted or dropped at stop): it ends
        `cancelled` with the reason, as a running one does."""
        self._finish(ticket, failed(ticket.request, reason, finish_reason="cancelled"))

    def set_locations(self, locations) -> None:
        """Replace the catalog's location table (places perception found, sent at run
        time): requests from now on are prompted, constrained and gated with it. The system
        prompt does not list places (the user prompt does), so the warm prefix stays valid.
        CatalogError when an argument's enum names a place the new table lacks."""
        catalog = self.catalog.with_locations(locations)
        grammar = (None if self.grammar is None
                   else PlanGrammar(catalog, self.grammar.compiler, self.config.recovery))
        self.grammar, self.catalog = grammar, catalog   # a request reads each once

    def set_unavailable(self, reasons: dict[str, str]) -> None:
        """Skills that cannot run now, each with why; requests from now on plan without
        them."""
        self.unavailable = dict(reasons)

    def _name_unavailable(self, result: PlanResult) -> None:
        """A plan naming a skill that was unavailable when it was asked for fails, naming
        why (possible without the grammar); a failed plan says which skills were away."""
        away = result.telemetry.get("unavailable_skills")
        if not away:
            return
        reasons = {name: self.unavailable.get(name, "its server is not on the graph")
                   for name in away}
        named = next((i for i, step in enumerate(result.plan or ())
                      if step["skill"] in reasons), None)
        if result.success and named is not None:
            skill = result.plan[named]["skill"]
            result.success, result.plan = False, None
            result.error = f"step {named + 1} ({skill}) cannot run now: {reasons[skill]}"
        elif not result.success:
            result.error += " (unavailable now: " + "; ".join(
                f"{name}: {why}" for name, why in sorted(reasons.items())) + ")"

    def _finish(self, ticket: PlanTicket, result: PlanResult) -> None:
        self._name_unavailable(result)
        result.telemetry.setdefault("request_id", ticket.id)
        result.telemetry.setdefault("total_latency_ms",
                                    round((time.monotonic() - ticket.submitted) * 1000, 3))
        ticket.resolve(result)
        if self.on_result is not None:
            try:
                self.on_result(result)
            except Exception:  # a broken listener must not break the service
                log.exception("on_result listener failed")

    def effort(self, request: PlanRequest) -> str | None:
        return (self.config.reasoning_effort if request.reasoning_effort is None
                else request.reasoning_effort)

    def settings(self, request: PlanRequest, waited_s: float) -> GenerationSettings:
        cfg = self.config
        deadline = request.deadline_s if request.deadline_s is not None else cfg.deadline_s
        return GenerationSettings(
            max_new_tokens=request.max_new_tokens or cfg.max_new_tokens,
            deadline_s=None if deadline is None else max(deadline - waited_s, 1e-3),
            speculative=cfg.speculative if request.speculative is None else request.speculative,
            method=request.method,
            relaxed_thinking=cfg.relaxed_thinking,
            relaxed_topk=cfg.relaxed_topk, relaxed_delta=cfg.relaxed_delta,
            enable_thinking=self.thinking(request), sampling=request.sampling,
            reasoning_effort=self.effort(request))

    def thinking(self, request: PlanRequest) -> bool:
        return (self.config.enable_thinking if request.enable_thinking is None
                else request.enable_thinking)
