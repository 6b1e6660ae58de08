"""The shipped demo planner, end to end: tokenizer -> prompt -> speculative decode -> plan.

These run the real embedded model (flash_planner/assets/demo) on held-out tasks: combinations
of task family, objects and places of its training worlds that were never in its training
data, tasks whose names never occur in training at all, and tasks it must refuse. The
prompt names the refusal shape, as the demo preset does.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from flash_planner.cli import main
from flash_planner.engine.engine import Engine
from flash_planner.engine.generate import GenerationSettings, generate
from flash_planner.engine.inputs.grammar import JsonGrammarCompiler
from flash_planner.planning.grounding import RequestWords
from flash_planner.planning.parse import parse_plan
from flash_planner.planning.plan_grammar import PlanGrammar
from flash_planner.planning.presets import ModelPreset, asset_path, default_skills_path
from flash_planner.planning.prompt import build_messages
from flash_planner.planning.request import PlanRequest
from flash_planner.planning.service import PlannerConfig, PlannerService
from flash_planner.planning.skills import SkillCatalog
from flash_planner.train import mobile
from flash_planner.train.corpus import heldout_sets
from flash_planner.train.evaluate import grounded

HELD_OUT = heldout_sets(0, 40)
# One task of each of several families, thinking on and off, with and without a scene.
CASES = [next(ex for ex in HELD_OUT["world"] if ex.family == family)
         for family in ("fetch", "put", "go", "wait", "open", "go+say")]
# Tasks whose object, place and container names the demo never saw, and tasks to refuse.
UNSEEN, REFUSALS = HELD_OUT["unseen"][:30], HELD_OUT["inexpressible"][:20]
# The README's example: every word of its names is held out of training.
README_TASK = "bring the copper camera to the inner foyer"
# The example catalog's held-out tasks (config/catalogs/mobile_manipulator.yaml, with scene
# lists): of the training worlds and with names never seen.
EXAMPLE_HELD_OUT = mobile.heldout_examples(0, 40)
EXAMPLE_TASKS = EXAMPLE_HELD_OUT["world"][:15] + EXAMPLE_HELD_OUT["unseen"][:15]


@pytest.fixture(scope="module")
def catalog():
    return SkillCatalog.from_yaml(default_skills_path())


@pytest.fixture(scope="module")
def preset():
    return ModelPreset.load("demo")


@pytest.fixture(scope="module")
def engine(preset):
    return Engine.load(preset.engine_config(device="cpu", dtype="fp32"))


@pytest.fixture(scope="module")
def service(engine, catalog, preset):
    service = PlannerService(engine, catalog, PlannerConfig(
        max_new_tokens=320, refusal_hint=preset.refusal_hint))
    service.start()
    yield service
    service.stop()


def _request(example) -> PlanRequest:
    return PlanRequest(example.task, example.context, scene=example.scene,
                       enable_thinking=example.thinking is not None)


def test_shipped_assets_are_small_and_complete():
    root = Path(asset_path("@assets/demo"))
    files = [p for p in root.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= 20 * 2**20
    names = {p.relative_to(root).as_posix() for p in files}
    assert {"target/config.json", "target/model.safetensors", "target/tokenizer.json",
            "target/tokenizer_config.json", "drafter/config.json",
            "drafter/model.safetensors"} <= names


def test_the_demo_preset_names_the_refusal_shape(preset):
    assert preset.refusal_hint


@pytest.mark.parametrize("example", CASES, ids=[ex.family for ex in CASES])
def test_service_plans_held_out_tasks_exactly(service, example):
    result = service.plan(_request(example), timeout=120)
    assert result.success, f"{example.task!r}: {result.error}\n{result.raw_text}"
    assert result.plan == example.plan
    assert grounded(result.plan, example.task, example.context)
    assert result.telemetry["cycles"] > 0


def test_names_never_seen_are_copied_into_the_plan(service, engine, catalog, preset):
    """A floor, not the goal. Free decoding, the demo plans 80.0% of 200 such tasks exactly
    (81.5% grounded; 94.5% and 99.0% under the request's grammar, bench/grounding.py), and a
    plan naming what the task never said fails, naming the argument; under the request's
    grammar (the service's default) every plan's names are the task's words. The demo
    trained on closed worlds only planned 4.5% exactly (6% grounded), swapping in names it
    knew."""
    results = [service.plan(_request(ex), timeout=120) for ex in UNSEEN]
    exact = sum(r.success and r.plan == ex.plan for r, ex in zip(results, UNSEEN))
    for r, ex in zip(results, UNSEEN):     # the catalog's grounded arguments (not say's text)
        if r.success:
            parse_plan(r.raw_text, catalog, words=RequestWords.of(ex.task, ex.context))
    assert exact >= 0.6 * len(UNSEEN), exact
    free = PlannerService(engine, catalog, PlannerConfig(
        max_new_tokens=320, refusal_hint=preset.refusal_hint, constrain=False))
    free.start()
    try:
        unchecked = [free.plan(_request(ex), timeout=120) for ex in UNSEEN]
    finally:
        free.stop()
    invented = [r for r in unchecked if "never mention" in r.error]
    assert invented, [r.plan for r in unchecked]
    for r in invented:
        assert not r.success and re.fullmatch(
            r"step \d+ \(\w+\): argument '\w+' is '[^']*', which the task and scene never "
            r"mention", r.error), r.error
    readme = service.plan(PlanRequest(README_TASK), timeout=120)
    assert readme.plan == [
        {"skill": "navigate_to", "args": {"target": "copper camera"}},
        {"skill": "pick", "args": {"object": "copper camera"}},
        {"skill": "navigate_to", "args": {"target": "inner foyer"}},
        {"skill": "place", "args": {"object": "copper camera", "location": "inner foyer"}}]


def test_tasks_the_catalog_cannot_express_are_refused(service):
    """Refusals of actions never refused in training (94.5% of 200; the closed-world demo 0%)."""
    results = [service.plan(_request(ex), timeout=120) for ex in REFUSALS]
    refused = [r for r in results if r.refusal]
    assert len(refused) >= 0.6 * len(REFUSALS), len(refused)
    assert all(not r.success and "refused" in r.error for r in refused)


def test_speculative_decoding_is_lossless_and_accepts_many_drafts(engine, catalog):
    # tokens per cycle over all six answers: a 13-token refusal alone is too short to judge
    # drafting by. The shipped pair: DFlash 4.90 (3.8-9.5 per answer), MTP 8.19; the
    # one-layer drafter before it 2.63
    published, cycles = {"dflash": 0, "mtp": 0}, {"dflash": 0, "mtp": 0}
    for example in CASES[:3] + UNSEEN[:2] + REFUSALS[:1]:  # names copied, a refusal
        settings = dict(max_new_tokens=320, enable_thinking=example.thinking is not None)
        messages = build_messages(catalog, example.task, example.context, refusal_hint=True)
        plain = generate(engine, messages, GenerationSettings(speculative=False, **settings))
        # auto routes on measured time, so only its output is checked here
        auto = generate(engine, messages, GenerationSettings(**settings))
        assert auto.token_ids == plain.token_ids, example.task
        for method in published:
            spec = generate(engine, messages, GenerationSettings(method=method, **settings))
            assert spec.token_ids == plain.token_ids, (method, example.task)
            assert spec.stats.cycles > 0, (method, example.task)
            published[method] += spec.stats.new_tokens - 1
            cycles[method] += spec.stats.cycles
    assert all(published[m] / cycles[m] > 3.5 for m in published), (published, cycles)


def test_the_requests_grammar_keeps_speculative_decoding_lossless(engine, catalog):
    grammar = PlanGrammar(catalog, JsonGrammarCompiler.for_engine(engine))
    for example in UNSEEN[:3]:                # names the grammar takes from the task only
        settings = dict(max_new_tokens=320, enable_thinking=example.thinking is not None)
        messages = build_messages(catalog, example.task, example.context, refusal_hint=True)
        words = RequestWords.of(example.task, example.context)
        outs = {method: generate(engine, messages, GenerationSettings(
                    method=method, speculative=method != "none", **settings),
                    constraint=grammar.constraint(words=words))
                for method in ("none", "dflash", "mtp", "auto")}
        for method, out in outs.items():
            assert out.token_ids == outs["none"].token_ids, (method, example.task)
        parse_plan(outs["none"].text, catalog, words=words)   # its names are the task's


def test_cli_plans_with_the_embedded_model_by_default(capsys):
    example = CASES[0]
    args = ["plan", example.task, "--json", "--device", "cpu"]
    if example.context:
        args += ["--context", example.context]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["success"] and out["plan"] == example.plan
    assert out["telemetry"]["tokens_per_cycle"] > 1.0


def test_the_example_catalog_is_planned_like_the_default_one(engine, preset):
    """A floor, not the goal: the example catalog's held-out tasks, half of them named with
    words never seen, each with its scene list (bench/grounding.py --catalog example gives
    the figures on 200 of each set: 91.5% and 90.0% exact). Before the demo trained on this
    catalog it planned 7.5% and 9.5% of those exactly."""
    service = PlannerService(engine, mobile.catalog(), PlannerConfig(
        max_new_tokens=320, refusal_hint=preset.refusal_hint))
    service.start()
    try:
        results = [service.plan(_request(ex), timeout=120) for ex in EXAMPLE_TASKS]
    finally:
        service.stop()
    exact = sum(r.success and r.plan == ex.plan for r, ex in zip(results, EXAMPLE_TASKS))
    assert all(r.success for r in results), [r.error for r in results if not r.success]
    assert exact >= 0.8 * len(EXAMPLE_TASKS), exact


def test_the_coke_task_of_the_example_catalog(capsys):
    """The task that planned `say` and two pick_ups before the demo knew this catalog."""
    args = ["plan", "put the coke in the trash bin", "--skills",
            str(mobile.catalog_path()), "--scene", "coke can|coke", "--scene",
            "kitchen counter", "--scene", "trash bin", "--json", "--device", "cpu"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["success"], out
    assert out["plan"] == [
        {"skill": "go_to", "args": {"target": "coke can"}},
        {"skill": "pick_up", "args": {"object": "coke can"}},
        {"skill": "go_to", "args": {"target": "trash bin"}},
        {"skill": "put_down", "args": {"object": "coke can", "location": "trash bin"}}]
