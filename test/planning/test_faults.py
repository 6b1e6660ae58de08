"""Faults during a request, on the demo planner: an exception inside a cycle, non-finite
logits, and a deadline that expires mid-generation (cancel and preempt at random points, and
the cycles they take to act, are test_soak.py's).

Faults are injected by wrapping the engine's target model (`FaultyModel`): the Nth forward
raises or returns NaN logits. Everything else is the real engine and service.
"""

from __future__ import annotations

import time

import pytest
import torch

from flash_planner.engine.engine import Engine
from flash_planner.engine.loop.speculative import NonFiniteLogits
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


class SlowModel:
    """The target model, counting its forwards; forward number `at` first sleeps `sleep_s`."""

    def __init__(self, model, at: int = 0, sleep_s: float = 0.0):
        self.model, self.at, self.sleep_s, self.calls = model, at, sleep_s, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            time.sleep(self.sleep_s)
        return self.model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_a_deadline_mid_generation_ends_the_request_within_one_cycle(engine, monkeypatch):
    times = []
    service = PlannerService(engine, SkillCatalog.from_yaml(default_skills_path()),
                             PlannerConfig())
    service.start()
    try:
        service.plan(PlanRequest(TASK), timeout=TIMEOUT)   # the prompt's prefix is cached now
        counted = SlowModel(engine.model)
        monkeypatch.setattr(engine, "model", counted)
        t0 = time.monotonic()
        service.plan(PlanRequest(TASK), timeout=TIMEOUT)
        # twice the whole request's own duration, spent asleep in its middle forward: the
        # deadline passes mid-generation however fast or loaded the machine (timing the
        # request alone did not: a warm run took under half of a cold one's time)
        deadline = round(2 * (time.monotonic() - t0), 3)
        slow = SlowModel(counted.model, at=max(2, counted.calls // 2), sleep_s=deadline)
        monkeypatch.setattr(engine, "model", slow)
        t0 = time.monotonic()
        result = service.plan(PlanRequest(TASK, deadline_s=deadline),
                              on_feedback=lambda f: times.append((time.monotonic(),
                                                                  f.tokens_so_far)),
                              timeout=TIMEOUT)
    finally:
        service.stop()
    assert slow.calls < counted.calls       # it stopped early
    assert result.finish_reason == "deadline" and not result.success
    assert result.error == f"deadline of {deadline} s reached during generation"
    assert result.raw_text and result.plan is None
    # at most one cycle's tokens after the deadline (a last call may flush held-back text)
    assert len({tokens for t, tokens in times if t > t0 + deadline}) <= 1, times
