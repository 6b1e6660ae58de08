"""Faults during a request, on the demo planner: an exception inside a cycle, non-finite
logits, cancel and preempt at random points, and a deadline that expires mid-generation.

Faults are injected by wrapping the engine's target model (`FaultyModel`): the Nth forward
raises or returns NaN logits. Everything else is the real engine and service.
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from flash_planner.engine.engine import Engine
from flash_planner.engine.speculative import NonFiniteLogits
from flash_planner.planning.presets import ModelPreset, default_skills_path
from flash_planner.planning.request import PlanRequest
from flash_planner.planning.service import PlannerConfig, PlannerService
from flash_planner.planning.skills import SkillCatalog

TIMEOUT = 120
TASK = "bring the red cup from the kitchen table to the sink"


def _demo_engine() -> Engine:
    return Engine.load(ModelPreset.load("demo").engine_config(device="cpu", dtype="fp32"))


class FaultyModel:
    """The target model, whose forward number `at` (1 = the first prefill chunk) raises
    (`kind="raise"`) or returns NaN logits (`kind="nan"`)."""

    def __init__(self, model, at: int, kind: str):
        self.model, self.at, self.kind, self.calls = model, at, kind, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.at and self.kind == "raise":
            raise RuntimeError(f"injected fault in forward {self.at}")
        out = self.model(*args, **kwargs)
        if self.calls == self.at:
            out.logits = torch.full_like(out.logits, float("nan"))
        return out

    def __getattr__(self, name):
        return getattr(self.model, name)


@pytest.fixture(scope="module")
def engine():
    return _demo_engine()


@pytest.fixture(scope="module")
def reference(engine):
    """The reference task's result on a fresh engine."""
    return _plan_once(engine, PlanRequest(TASK))


def _plan_once(engine, request, **config):
    service = PlannerService(engine, SkillCatalog.from_yaml(default_skills_path()),
                             PlannerConfig(**config))
    service.start()
    try:
        return service.plan(request, timeout=TIMEOUT)
    finally:
        service.stop()


@pytest.mark.parametrize("speculative", [True, False], ids=["spec", "plain"])
@pytest.mark.parametrize("kind,at", [("raise", 1), ("raise", 2), ("raise", 6),
                                     ("nan", 1), ("nan", 4)])
def test_a_fault_fails_the_request_and_the_next_is_as_on_a_fresh_engine(
        engine, reference, monkeypatch, kind, at, speculative):
    assert reference.success, reference.error
    faulty = FaultyModel(engine.model, at, kind)
    service = PlannerService(engine, SkillCatalog.from_yaml(default_skills_path()),
                             PlannerConfig(speculative=speculative))
    service.start()
    try:
        monkeypatch.setattr(engine, "model", faulty)
        failed = service.plan(PlanRequest(TASK, id="faulty"), timeout=TIMEOUT)
        assert faulty.calls >= at  # the fault fired
        monkeypatch.setattr(engine, "model", faulty.model)
        assert not failed.success and failed.finish_reason == "error"
        if kind == "raise":
            assert failed.error == f"internal error: RuntimeError: injected fault in forward {at}"
        else:
            assert "non-finite logits (NaN or Inf)" in failed.error and failed.plan is None
        assert engine.state.length == 0 and engine.state.pending == 0   # reset, not left over
        after = service.plan(PlanRequest(TASK, id="after"), timeout=TIMEOUT)
    finally:
        service.stop()
    assert after.success and after.raw_text == reference.raw_text
    assert after.plan == reference.plan


def test_nan_weights_never_give_a_plan():
    """A checkpoint with NaN in its weights: every request fails with the reason."""
    engine = _demo_engine()
    with torch.no_grad():
        engine.model.norm.weight[0] = float("nan")
    from flash_planner.engine.generate import GenerationSettings, generate

    with pytest.raises(NonFiniteLogits, match="non-finite logits"):
        generate(engine, "hello", GenerationSettings(max_new_tokens=4))
    result = _plan_once(engine, PlanRequest(TASK))
    assert not result.success and "non-finite logits" in result.error


def _cycles_after_interrupt(service, rng, interrupt, n: int) -> list[int]:
    """For n requests, interrupt each at a random time while it runs (`interrupt(ticket)`),
    and count the decode cycles that published tokens after the interrupt was issued."""
    counts = []
    for i in range(n):
        published = []                       # monotonic times of token publications
        ticket = service.submit(PlanRequest(TASK, id=f"r{i}"),
                                on_feedback=lambda f, p=published: p.append(time.monotonic()))
        while not published and not ticket.done():
            time.sleep(0.001)
        time.sleep(rng.uniform(0.0, 0.25))
        issued = time.monotonic()
        if ticket.done():
            continue                         # finished first: no interrupt to measure
        interrupt(ticket)
        result = ticket.result(TIMEOUT)
        if result.finish_reason != "cancelled":
            continue                         # finished between the check and the interrupt
        counts.append(sum(t > issued for t in published))
    return counts


def test_cancel_and_preempt_are_honoured_within_one_cycle(engine):
    rng = random.Random(7)
    catalog = SkillCatalog.from_yaml(default_skills_path())
    service = PlannerService(engine, catalog, PlannerConfig())
    service.start()
    try:
        cancels = _cycles_after_interrupt(service, rng, lambda t: service.cancel(t.id), 25)
    finally:
        service.stop()
    preempt = PlannerService(engine, catalog, PlannerConfig(policy="preempt"))
    preempt.start()
    try:
        preempts = _cycles_after_interrupt(
            preempt, rng, lambda t: preempt.submit(PlanRequest("the newer task")), 15)
    finally:
        preempt.stop()
    assert len(cancels) >= 15 and len(preempts) >= 8, (cancels, preempts)
    assert max(cancels) <= 1 and max(preempts) <= 1, (cancels, preempts)


def test_a_deadline_mid_generation_ends_the_request_within_one_cycle(engine):
    times = []
    service = PlannerService(engine, SkillCatalog.from_yaml(default_skills_path()),
                             PlannerConfig())
    service.start()
    try:
        t0 = time.monotonic()
        result = service.plan(PlanRequest(TASK, deadline_s=0.15),
                              on_feedback=lambda _: times.append(time.monotonic()),
                              timeout=TIMEOUT)
    finally:
        service.stop()
    assert result.finish_reason == "deadline" and not result.success
    assert result.error == "deadline of 0.15 s reached during generation"
    assert result.raw_text and result.plan is None
    assert sum(t > t0 + 0.15 for t in times) <= 1, times
