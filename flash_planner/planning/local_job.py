"""A request for the local model: the plan's prompt, grammar and settings handed to the
engine's batch (`engine/batch.py`) as a `BatchRequest`, and what the engine answered read
back as a `PlanResult` (a plan validated against the catalog, or a completion's text).

Every outcome is a `PlanResult`: an engine error (a request the context cannot hold, an
argument the engine refuses, non-finite logits, anything else) is a failed result naming
it, never an exception out of the service.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..engine.batch import BatchRequest
from ..engine.generate import GenerationResult
from ..engine.inputs.grammar import BoundedStrings
from ..engine.loop.speculative import NonFiniteLogits
from ..engine.state.cache import ContextOverflowError
from .feedback import Listener
from .grounding import RequestWords
from .parse import PlanError, PlanRefused, parse_plan
from .request import PlanRequest, PlanResult
from .steps import StepStream

log = logging.getLogger(__name__)

# What a request too long for the context can change (the error names it)
ROOM_FIX = ("raise the engine's max_context (--max-context, engine.max_context), lower "
            "max_new_tokens, or shorten the prompt (a shorter scene list or context; a "
            "catalog's enum_shown bounds the enum values its signatures list)")


def failed(request: PlanRequest, error: str, **extra) -> PlanResult:
    return PlanResult(request.id, str(request.task), success=False, error=error, **extra)


@dataclass
class LocalJob:
    """A ticket's work for the engine and how to read its answer."""
    work: BatchRequest
    read: Callable[[GenerationResult], PlanResult]
    request: PlanRequest
    telemetry: dict
    verb: str                      # "plan this request" | "generate": for error messages

    def outcome(self, out: GenerationResult | None, error: BaseException | None
                ) -> PlanResult:
        """The result of the engine's answer, or of the error that ended the request."""
        if error is None:
            return self.read(out)
        return engine_error(self.request, self.telemetry, self.verb, error)


def engine_error(request: PlanRequest, telemetry: dict, verb: str, error: BaseException
                 ) -> PlanResult:
    """The failed result of an error the engine raised for `request`."""
    if isinstance(error, ContextOverflowError):
        fix = f": {ROOM_FIX}" if verb != "generate" else ""
        return failed(request, f"cannot {verb}: {error}{fix}", telemetry=telemetry,
                      rejected=True)
    if isinstance(error, ValueError):
        return failed(request, f"cannot {verb}: {error}", telemetry=telemetry)
    if isinstance(error, NonFiniteLogits):
        log.error("request %s: %s", request.id, error)
        return failed(request, str(error), finish_reason="error", telemetry=telemetry)
    log.error("request %s failed: %s: %s", request.id, type(error).__name__, error)
    return failed(request, f"internal error: {type(error).__name__}: {error}",
                  finish_reason="error", telemetry=telemetry)


def embed_ahead(engine, images) -> dict:
    """Run the vision tower over a request's images here, on the preparing thread, so that
    the batch finds their embeddings in the engine's cache instead of stalling every running
    request's cycles for the tower; returns the vision telemetry to report (the tower's time
    and cache hits here, not the cache lookups of the batch's start)."""
    if not images:
        return {}
    vision, t0 = engine.require_vision(), time.perf_counter()
    hits = vision.hits
    for image in images:
        vision.embed(image)
    return {"vision_ms": round((time.perf_counter() - t0) * 1000, 3),
            "image_cache_hits": vision.hits - hits}


def completion_job(service, ticket) -> LocalJob:
    """A generic generation (the server's chat completions)."""
    job, request = ticket.completion, ticket.request
    telemetry = {"queue_wait_ms": round((time.monotonic() - ticket.submitted) * 1000, 3)}
    vision = embed_ahead(service.engine, job.images)
    constraint = job.constraint() if job.constraint else None
    work = BatchRequest(job.prompt, job.settings, on_token=job.on_token,
                        cancel=ticket.cancel_token, constraint=constraint, images=job.images)

    def read(out: GenerationResult) -> PlanResult:
        telemetry.update(out.stats.as_dict(), **vision)
        if constraint is not None and isinstance(constraint.matcher, BoundedStrings):
            telemetry["strings_cut"] = constraint.matcher.cut
        if out.finish_reason == "cancelled":
            return failed(request, ticket.cancel_reason, raw_text=out.text,
                          finish_reason="cancelled", telemetry=telemetry)
        return PlanResult(request.id, request.task, True, raw_text=out.text,
                          finish_reason=out.finish_reason, telemetry=telemetry)

    return LocalJob(work, read, request, telemetry, "generate")


def plan_job(service, ticket, words: RequestWords, telemetry: dict,
             deadline: float | None) -> LocalJob | PlanResult:
    """The plan request of `ticket` for the service's engine: its prompt with the fixed
    prefix, its own grammar, its settings (the deadline counts from submission); or the
    failed result when the engine cannot take it."""
    request, config = ticket.request, service.config
    telemetry["backend"] = "local"
    max_new = request.max_new_tokens or config.max_new_tokens
    try:
        ids, prefix = service.prompt(request.task, request.context,
                                     service.thinking(request), request.scene,
                                     service.effort(request), len(request.images),
                                     request.progress)
        # each image's one token becomes its tokens (the engine expands them)
        service.engine.check_fits(
            len(ids) + sum(image.tokens - 1 for image in request.images), max_new)
        constraint = None
        if service.grammar is not None:
            budget = max(0, max_new - config.answer_reserve)
            t0 = time.monotonic()   # the request's own grammar is compiled here
            without = frozenset(service.unavailable)
            if without:
                telemetry["unavailable_skills"] = sorted(without)
            constraint = service.grammar.constraint(
                think_budget=budget, words=words, max_string_tokens=config.max_string_tokens,
                without=without)
            telemetry["grammar_ms"] = round((time.monotonic() - t0) * 1000, 3)
        vision = embed_ahead(service.engine, request.images)
        # what encoding the prompt and making the grammar's matcher took is not given back
        settings = service.settings(request, time.monotonic() - ticket.submitted)
    except (ContextOverflowError, ValueError) as exc:
        return engine_error(request, telemetry, "plan this request", exc)
    # first_step_ms counts from here, as the engine's clock does
    listener = Listener(ticket, StepStream(service.catalog, words))
    work = BatchRequest(ids, settings, on_token=listener, cancel=ticket.cancel_token,
                        constraint=constraint, prefix=prefix, images=request.images)

    def read(out: GenerationResult) -> PlanResult:
        telemetry.update(out.stats.as_dict(), **vision)
        if constraint is not None:
            telemetry["strings_cut"] = constraint.matcher.cut
            if constraint.matcher.cut:
                log.warning("request %s: %d string(s) of the answer reached %d tokens and "
                            "were closed there (planner.max_string_tokens)", request.id,
                            constraint.matcher.cut, config.max_string_tokens)
        if listener.first_step_ms is not None:
            telemetry["first_step_ms"] = round(listener.first_step_ms, 3)
        base = dict(raw_text=out.text, finish_reason=out.finish_reason, telemetry=telemetry)
        if out.finish_reason == "cancelled":
            return failed(request, ticket.cancel_reason, **base)
        if out.finish_reason == "deadline":
            return failed(request, f"deadline of {deadline} s reached during generation",
                          **base)
        try:
            steps, thinking = parse_plan(out.text, service.catalog,
                                         truncated=out.finish_reason == "length", words=words)
        except PlanRefused as exc:
            return failed(request, str(exc), refusal=exc.reason, **base)
        except PlanError as exc:
            more = f" (max_new_tokens {max_new}: raise it for longer plans)" \
                if out.finish_reason == "length" else ""
            return failed(request, f"{exc}{more}", **base)
        return PlanResult(request.id, request.task, True, plan=steps, thinking=thinking,
                          **base)

    return LocalJob(work, read, request, telemetry, "plan this request")
