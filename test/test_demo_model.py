"""The shipped demo planner, end to end: tokenizer -> prompt -> speculative decode -> plan.

These run the real embedded model (flash_planner/assets/demo) on held-out tasks, i.e.
combinations of task family, objects and places that were never in its training data.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flash_planner.cli import main
from flash_planner.engine.engine import Engine
from flash_planner.engine.generate import GenerationSettings, generate
from flash_planner.planning.presets import ModelPreset, asset_path, default_skills_path
from flash_planner.planning.prompt import build_messages
from flash_planner.planning.request import PlanRequest
from flash_planner.planning.service import PlannerConfig, PlannerService
from flash_planner.planning.skills import SkillCatalog
from flash_planner.train.corpus import make_corpus

HELD_OUT = make_corpus(0, n_train=0, n_heldout=40)[1]
# One task of each of several families, thinking on and off, with and without a scene.
CASES = [next(ex for ex in HELD_OUT if ex.family == family)
         for family in ("fetch", "put", "go", "wait", "open", "go+say")
         if any(ex.family == family for ex in HELD_OUT)]


@pytest.fixture(scope="module")
def catalog():
    return SkillCatalog.from_yaml(default_skills_path())


@pytest.fixture(scope="module")
def engine():
    return Engine.load(ModelPreset.load("demo").engine_config(device="cpu", dtype="fp32"))


def test_shipped_assets_are_small_and_complete():
    root = Path(asset_path("@assets/demo"))
    files = [p for p in root.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= 20 * 2**20
    names = {p.relative_to(root).as_posix() for p in files}
    assert {"target/config.json", "target/model.safetensors", "target/tokenizer.json",
            "target/tokenizer_config.json", "drafter/config.json",
            "drafter/model.safetensors"} <= names


@pytest.mark.parametrize("example", CASES, ids=[ex.family for ex in CASES])
def test_service_plans_held_out_tasks_exactly(engine, catalog, example):
    service = PlannerService(engine, catalog, PlannerConfig(max_new_tokens=320))
    service.start()
    try:
        result = service.plan(PlanRequest(example.task, example.context,
                                          enable_thinking=example.thinking is not None),
                              timeout=120)
    finally:
        service.stop()
    assert result.success, f"{example.task!r}: {result.error}\n{result.raw_text}"
    assert result.plan == example.plan
    assert result.telemetry["cycles"] > 0


def test_speculative_decoding_is_lossless_and_accepts_many_drafts(engine, catalog):
    for example in CASES:
        settings = dict(max_new_tokens=320, enable_thinking=example.thinking is not None)
        messages = build_messages(catalog, example.task, example.context)
        plain = generate(engine, messages, GenerationSettings(speculative=False, **settings))
        # auto routes on measured time, so only its output is checked here
        auto = generate(engine, messages, GenerationSettings(**settings))
        assert auto.token_ids == plain.token_ids, example.task
        for method in ("dflash", "mtp"):
            spec = generate(engine, messages, GenerationSettings(method=method, **settings))
            assert spec.token_ids == plain.token_ids, (method, example.task)
            assert spec.stats.tokens_per_cycle > 2.0, (method, example.task,
                                                       spec.stats.as_dict())


def test_cli_plans_with_the_embedded_model_by_default(capsys):
    example = CASES[0]
    args = ["plan", example.task, "--json", "--device", "cpu"]
    if example.context:
        args += ["--context", example.context]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["success"] and out["plan"] == example.plan
    assert out["telemetry"]["tokens_per_cycle"] > 1.0
