"""A request for a remote backend (planner.backend remote / remote_or_local): the plan's
messages and answer schema sent to an OpenAI-compatible server (remote.py), its streamed
answer parsed as the local engine's is, the server's health recorded; a failure falls back to
the local engine where the backend allows it (the result is then None)."""

from __future__ import annotations

import logging
import time

from ..engine.loop.sampling import Sampling
from .feedback import Listener
from .grounding import RequestWords
from .local_job import failed
from .parse import PlanError, PlanRefused, parse_plan
from .plan_grammar import answer_schema
from .prompt import build_messages
from .remote import RemoteError
from .request import PlanResult
from .steps import StepStream

log = logging.getLogger(__name__)


def remote_job(service, ticket, deadline: float | None, telemetry: dict,
               words: RequestWords) -> PlanResult | None:
    """The plan from the remote, or None to plan locally (remote_or_local, after a
    failure, whose reason goes to telemetry `remote_error`)."""
    request, cfg = ticket.request, service.config
    fallback = cfg.backend == "remote_or_local"
    end = None if deadline is None else ticket.submitted + deadline - (
        cfg.remote_reserve_s if fallback else 0.0)
    thinking = service.thinking(request)
    max_new = request.max_new_tokens or cfg.max_new_tokens
    messages = build_messages(service.catalog, request.task, request.context,
                              cfg.refusal_hint, request.scene, progress=request.progress,
                              recovery=cfg.recovery)
    without = frozenset(service.unavailable)
    if without:
        telemetry["unavailable_skills"] = sorted(without)
    sampling = request.sampling if isinstance(request.sampling, Sampling) and \
        not request.sampling.greedy else None
    listener = Listener(ticket, StepStream(service.catalog, words))
    t0 = time.monotonic()
    try:
        text = service.remote.complete(
            service.remote.body(messages,
                                answer_schema(service.catalog.without(without), words),
                                max_new, thinking, sampling, service.effort(request)),
            lambda delta: listener([], delta), end,
            lambda: ticket.cancel_token.cancelled)
        steps, thought = parse_plan(text, service.catalog, words=words)
    except PlanRefused as exc:
        latency = (time.monotonic() - t0) * 1000
        service.remote.health.record(True, latency)
        telemetry.update(backend="remote", remote_latency_ms=round(latency, 3))
        return failed(request, str(exc), refusal=exc.reason, raw_text=text,
                       finish_reason="eos", telemetry=telemetry)
    except (RemoteError, PlanError) as exc:
        why = (f"the remote answered an invalid plan: {exc}" if isinstance(exc, PlanError)
               else str(exc))
        service.remote.health.record(False, (time.monotonic() - t0) * 1000, why)
        if ticket.cancel_token.cancelled:
            return failed(request, ticket.cancel_reason, finish_reason="cancelled",
                           telemetry={**telemetry, "backend": "remote"})
        if fallback and (deadline is None
                         or time.monotonic() < ticket.submitted + deadline):
            log.warning("request %s: remote failed (%s); planning locally", request.id,
                        why)
            telemetry["remote_error"] = why
            return None
        return failed(request, f"remote backend: {why}", finish_reason="error",
                       telemetry={**telemetry, "backend": "remote"})
    latency = (time.monotonic() - t0) * 1000
    service.remote.health.record(True, latency)
    telemetry.update(backend="remote", remote_latency_ms=round(latency, 3))
    if listener.first_step_ms is not None:
        telemetry["first_step_ms"] = round(listener.first_step_ms, 3)
    return PlanResult(request.id, request.task, True, plan=steps, thinking=thought,
                      raw_text=text, finish_reason="eos", telemetry=telemetry)
