"""The planner service on a real tiny engine: queue policies, cancel, deadlines, failures.

The tiny model has random weights, so its answers are never valid plans: every finished
request here fails plan validation with a precise error, which is itself the path under
test. The policy tests run one request at a time (max_batch 1): the scheduler is held busy
by a feedback callback that waits on an event. The batching tests run several at once.
"""

from __future__ import annotations

import json
import threading

import pytest

from flash_planner.planning import service as service_module
from flash_planner.planning.presets import default_skills_path
from flash_planner.planning.request import PlanRequest
from flash_planner.planning.service import PlannerConfig, PlannerService, UnknownRequestError
from flash_planner.planning.skills import SkillCatalog

TIMEOUT = 60


@pytest.fixture(scope="module")
def engines(hybrid_dir, make_engine):
    """max_batch -> an engine decoding that many requests at once."""
    made = {}

    def get(max_batch: int):
        if max_batch not in made:
            made[max_batch] = make_engine(hybrid_dir, max_context=1024, max_batch=max_batch)
        return made[max_batch]

    return get


@pytest.fixture
def engine(engines):
    return engines(1)


@pytest.fixture
def make_service(engines):
    services = []

    def make(max_batch: int = 1, **config):
        service = PlannerService(engines(max_batch),
                                 SkillCatalog.from_yaml(default_skills_path()),
                                 PlannerConfig(**{"max_new_tokens": 24, **config}))
        service.start()
        services.append(service)
        return service

    yield make
    for service in services:
        service.stop()


class Gate:
    """A feedback callback that holds the worker until released."""

    def __init__(self):
        self.entered, self.release, self.events = threading.Event(), threading.Event(), []

    def __call__(self, feedback):
        self.events.append(feedback)
        self.entered.set()
        assert self.release.wait(TIMEOUT)


def test_random_model_output_is_reported_as_no_valid_plan(make_service):
    service = make_service(constrain=False)
    result = service.plan(PlanRequest("pick up the red cup", id="a"), timeout=TIMEOUT)
    assert not result.success and result.plan is None
    assert result.error  # a precise parse/validation error
    assert result.raw_text
    assert result.telemetry["new_tokens"] > 0 and result.telemetry["request_id"] == "a"
    assert result.telemetry["ttft_ms"] > 0 and "queue_wait_ms" in result.telemetry


def test_bad_requests_fail_and_the_service_keeps_serving(make_service):
    service = make_service()
    bad = service.plan(PlanRequest("   "), timeout=TIMEOUT)
    assert not bad.success and bad.error == "invalid request: task is empty"
    ok = service.plan(PlanRequest("open the fridge"), timeout=TIMEOUT)
    assert ok.telemetry.get("new_tokens", 0) > 0


def test_feedback_streams_the_generated_text(make_service):
    service = make_service()
    events = []
    result = service.plan(PlanRequest("open the fridge", max_new_tokens=12),
                          on_feedback=events.append, timeout=TIMEOUT)
    assert events and "".join(e.delta_text for e in events) == result.raw_text
    assert events[-1].tokens_so_far == result.telemetry["new_tokens"]


def test_reject_policy_and_full_queue(make_service):
    service = make_service(policy="reject")
    gate = Gate()
    running = service.submit(PlanRequest("task one", id="one"), on_feedback=gate)
    assert gate.entered.wait(TIMEOUT)
    refused = service.submit(PlanRequest("task two", id="two")).result(TIMEOUT)
    assert not refused.success and "busy with request one" in refused.error
    assert "max_batch 1" in refused.error
    gate.release.set()
    running.result(TIMEOUT)

    service = make_service(policy="queue", queue_depth=1)
    gate = Gate()
    first = service.submit(PlanRequest("task one", id="q1"), on_feedback=gate)
    assert gate.entered.wait(TIMEOUT)
    second = service.submit(PlanRequest("task two", id="q2"))
    third = service.submit(PlanRequest("task three", id="q3")).result(TIMEOUT)
    assert "queue full (1 requests waiting, 1 running)" in third.error
    assert service.queue_depth == 1
    dup = service.submit(PlanRequest("again", id="q2")).result(TIMEOUT)
    assert "already queued or running" in dup.error
    gate.release.set()
    assert first.result(TIMEOUT).telemetry["new_tokens"] > 0
    assert second.result(TIMEOUT).telemetry["new_tokens"] > 0   # served after the first


def test_requests_run_at_once_up_to_max_batch_then_queue(make_service, engines):
    """Two slots: two requests decode in the same cycles (their feedback interleaves, each
    request's text its own), a third waits in the queue, a fourth finds it full; under
    'reject' a third is refused at once. Each result equals the request decoded alone."""
    service = make_service(max_batch=2, queue_depth=1, max_new_tokens=40)
    order = []
    tasks = {"a": "pick up the red cup", "b": "open the fridge", "c": "go to the sink"}
    tickets = {rid: service.submit(PlanRequest(task, id=rid),
                                   on_feedback=lambda fb: order.append(fb.request_id))
               for rid, task in tasks.items()}
    full = service.submit(PlanRequest("wave", id="d")).result(TIMEOUT)
    assert "queue full (1 requests waiting, 2 running)" in full.error
    results = {rid: t.result(TIMEOUT) for rid, t in tickets.items()}
    first_b = order.index("b")
    assert "a" in order[first_b:], "a and b decoded in the same cycles"
    alone = make_service(max_batch=1, max_new_tokens=40)
    for rid, task in tasks.items():
        assert results[rid].raw_text == alone.plan(PlanRequest(task), timeout=TIMEOUT).raw_text
        assert results[rid].telemetry["new_tokens"] > 0
    assert service.load_report()["max_batch"] == 2
    assert service.load_report()["tokens"] >= sum(r.telemetry["new_tokens"]
                                                  for r in results.values()) - 3
    strict = make_service(max_batch=2, policy="reject", max_new_tokens=40)
    held = [strict.submit(PlanRequest(task, id=rid)) for rid, task in list(tasks.items())[:2]]
    refused = strict.submit(PlanRequest("go", id="late")).result(TIMEOUT)
    assert not refused.success and "max_batch 2" in refused.error
    assert all(t.result(TIMEOUT).telemetry["new_tokens"] > 0 for t in held)


def test_preempt_policy_cancels_the_running_request(make_service):
    service = make_service(policy="preempt", max_new_tokens=200)
    gate = Gate()
    old = service.submit(PlanRequest("old task", id="old"), on_feedback=gate)
    assert gate.entered.wait(TIMEOUT)
    middle = service.submit(PlanRequest("queued task", id="middle"))
    new = service.submit(PlanRequest("new task", id="new"))
    gate.release.set()
    # Running or still queued, the same outcome, naming the request that preempted it.
    for ticket, by in ((old, "middle"), (middle, "new")):
        result = ticket.result(TIMEOUT)
        assert not result.success and result.error == f"preempted by request {by}"
        assert result.finish_reason == "cancelled"
    assert new.result(TIMEOUT).telemetry["new_tokens"] > 0


def test_cancel_running_queued_and_unknown(make_service):
    service = make_service(max_new_tokens=200)
    gate = Gate()
    running = service.submit(PlanRequest("long task", id="run"), on_feedback=gate)
    assert gate.entered.wait(TIMEOUT)
    queued = service.submit(PlanRequest("waiting task", id="wait"))
    service.cancel("wait")
    assert queued.result(TIMEOUT).error == "cancelled while queued"
    with pytest.raises(UnknownRequestError, match="no queued or running request with id 'x'"):
        service.cancel("x")
    service.cancel("run")
    gate.release.set()
    result = running.result(TIMEOUT)
    assert result.finish_reason == "cancelled" and result.error == "cancelled"
    assert result.telemetry["new_tokens"] < 200


def test_deadlines_while_queued_and_while_generating(make_service):
    service = make_service(max_new_tokens=400)
    gate = Gate()
    first = service.submit(PlanRequest("hold", id="h"), on_feedback=gate)
    assert gate.entered.wait(TIMEOUT)
    late = service.submit(PlanRequest("late", id="late", deadline_s=0.05))
    threading.Event().wait(0.2)
    gate.release.set()
    first.result(TIMEOUT)
    result = late.result(TIMEOUT)
    assert result.finish_reason == "deadline" and "passed while queued" in result.error

    slow = service.plan(PlanRequest("go", deadline_s=0.05, max_new_tokens=400),
                        on_feedback=lambda _: threading.Event().wait(0.1), timeout=TIMEOUT)
    assert slow.finish_reason == "deadline"
    assert slow.error == "deadline of 0.05 s reached during generation"
    assert 1 <= slow.telemetry["new_tokens"] < 400


def test_stopped_service_refuses_with_a_reason(make_service):
    service = make_service()
    service.stop()
    result = service.submit(PlanRequest("anything")).result(TIMEOUT)
    assert result.error == "the planner service is not running"


def test_load_builds_the_engine_and_warm_up_generates(hybrid_dir):
    from flash_planner.engine.engine import EngineConfig

    config = EngineConfig(model_path=str(hybrid_dir), device="cpu", dtype="fp32",
                          max_context=512)
    service = PlannerService.load(config, SkillCatalog.from_yaml(default_skills_path()),
                                  PlannerConfig(max_new_tokens=8))
    assert service.engine.config.model_path == str(hybrid_dir) and not service.busy
    # graphs deferred to the background wait for the warm-up (not beside its requests)
    assert service.engine.background_held
    assert service.warm_up() > 0 and not service.engine.background_held
    service.start()
    result = service.plan(PlanRequest("open the drawer", enable_thinking=False), timeout=TIMEOUT)
    assert result.telemetry["new_tokens"] > 0
    service.stop()
    # without a warm-up, its first request lets them go
    unwarmed = PlannerService.load(config, SkillCatalog.from_yaml(default_skills_path()),
                                   PlannerConfig(max_new_tokens=8))
    unwarmed.start()
    unwarmed.plan(PlanRequest("open the drawer", enable_thinking=False), timeout=TIMEOUT)
    assert not unwarmed.engine.background_held
    unwarmed.stop()


def test_warm_up_drafts_whole_blocks_with_every_proposer_and_auto_starts_afresh(
        monkeypatch):
    """The first request must not pay a first call: warm-up runs a full verify block with
    each loaded proposer and plain decoding, then auto forgets those cold measurements."""
    from flash_planner.engine.engine import Engine
    from flash_planner.engine.loop.mtp_proposer import MTPProposer
    from flash_planner.engine.loop.proposer import DFlashProposer
    from flash_planner.planning.presets import ModelPreset

    preset = ModelPreset.load("demo")
    engine = Engine.load(preset.engine_config(device="cpu", dtype="fp32"))
    drafted: dict[str, list[int]] = {"dflash": [], "mtp": []}
    for cls, name in ((DFlashProposer, "dflash"), (MTPProposer, "mtp")):
        def propose(self, anchor, start, num, _orig=cls.propose, _name=name):
            drafted[_name].append(num)
            return _orig(self, anchor, start, num)
        monkeypatch.setattr(cls, "propose", propose)
    service = PlannerService(engine, SkillCatalog.from_yaml(default_skills_path()),
                             PlannerConfig(refusal_hint=preset.refusal_hint))
    assert service.warm_up() > 0
    assert max(drafted["dflash"]) == engine.proposers["dflash"].block_size - 1
    assert max(drafted["mtp"]) == engine.proposers["mtp"].block_size - 1
    assert engine.proposers["auto"].estimates == {}


def test_sampled_requests_from_task_json_reproduce_and_bad_settings_are_refused(make_service):
    service = make_service(constrain=False, sampling={"temperature": 0.9, "top_k": 8})
    text = json.dumps({"task": "open the fridge", "seed": 11,
                       "sampling": {"answer": {"temperature": 1.2, "top_p": 0.9}}})
    runs = [service.plan(PlanRequest.from_text(text), timeout=TIMEOUT) for _ in range(2)]
    assert runs[0].raw_text == runs[1].raw_text
    assert runs[0].telemetry["sampled"] and runs[0].telemetry["seed"] == 11
    other = service.plan(PlanRequest("open the fridge", seed=12), timeout=TIMEOUT)
    assert other.raw_text != runs[0].raw_text
    greedy = [service.plan(PlanRequest("open the fridge", sampling="greedy"), timeout=TIMEOUT)
              for _ in range(2)]
    assert greedy[0].raw_text == greedy[1].raw_text and not greedy[0].telemetry["sampled"]
    for sampling, error in [({"top_k": -3}, "sampling: top_k must be an integer >= 0"),
                            ("warm", "sampling must be one of ('greedy', 'model', 'card')"),
                            ({"answer": 3}, "sampling.answer must be a mode name or a map")]:
        bad = service.plan(PlanRequest("open the fridge", sampling=sampling), timeout=TIMEOUT)
        assert not bad.success and bad.error.startswith("invalid request: " + error), bad.error
    assert not service.plan(PlanRequest("x", seed=-1), timeout=TIMEOUT).success
    relaxed = make_service(relaxed_thinking=True)
    refused = relaxed.plan(PlanRequest("open the fridge", sampling="card"), timeout=TIMEOUT)
    assert "relaxed thinking acceptance" in refused.error


def test_eight_clients_at_once_are_all_answered_together(make_service):
    """max_batch 8: eight clients submitting at the same moment all run (none is refused,
    none waits in the queue of depth 1), and each gets the text it gets alone."""
    service = make_service(max_batch=8, queue_depth=1, max_new_tokens=16)
    tasks = [f"bring item {i} to the table" for i in range(8)]
    start = threading.Barrier(8)
    results = [None] * 8

    def client(i):
        start.wait()
        results[i] = service.plan(PlanRequest(tasks[i], id=f"c{i}"), timeout=TIMEOUT)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert all(r is not None and not r.rejected for r in results)
    assert all(r.telemetry.get("new_tokens", 0) > 0 for r in results), \
        [r.error for r in results]
    alone = make_service(max_batch=1, max_new_tokens=16)
    assert [r.raw_text for r in results] == \
        [alone.plan(PlanRequest(t), timeout=TIMEOUT).raw_text for t in tasks]


def test_queued_requests_do_not_wake_the_scheduler_while_its_slot_prepares(
        make_service, monkeypatch):
    """One slot, its request's preparation held, two more queued: the scheduler sleeps until
    the preparation ends (it spun through every queued request's preparation before, holding
    the GIL from the preparing thread: one at a time ran ~0.6x as fast once requests queued,
    docs/performance.md). Each request still runs, in order."""
    held, entered = threading.Event(), threading.Event()

    def plan_job(*args, _real=service_module.plan_job):
        if not entered.is_set():
            entered.set()
            assert held.wait(TIMEOUT)
        return _real(*args)

    monkeypatch.setattr(service_module, "plan_job", plan_job)
    service = make_service(max_batch=1, max_new_tokens=8)
    passes = []
    collect = service._collect
    monkeypatch.setattr(service, "_collect", lambda: (passes.append(1), collect())[1])
    tickets = [service.submit(PlanRequest(task, id=f"r{i}"))
               for i, task in enumerate(("open the fridge", "go to the sink", "wave"))]
    assert entered.wait(TIMEOUT)
    start = len(passes)
    # time for a spinning loop to show itself; a sleeping one makes no pass at all
    threading.Event().wait(0.3)
    during = len(passes) - start
    held.set()
    assert all(t.result(TIMEOUT).telemetry["new_tokens"] > 0 for t in tickets)
    assert during <= 2, f"the scheduler made {during} passes while its only slot prepared"
