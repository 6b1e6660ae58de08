"""The state bytes a cycle moves besides the weights (engine/state/traffic.py): counted from the
engine's own buffers on the meta device at the 27B's shapes, and carried by telemetry."""

from __future__ import annotations

import torch
from weight_bytes import MODELS, QWEN3_8_FLASH_NEXT, traffic_rows

from flash_planner.engine.config import ModelConfig
from flash_planner.engine.engine import Engine
from flash_planner.engine.generate import GenerationSettings, generate
from flash_planner.engine.state.cache import InferenceState
from flash_planner.engine.state.traffic import TrafficModel
from flash_planner.planning.presets import ModelPreset

META = torch.device("meta")


def _state(raw: dict, batch: int = 1, context: int = 2048) -> InferenceState:
    return InferenceState(ModelConfig.from_hf_dict(raw), context + 16, 16, torch.bfloat16,
                          torch.bfloat16, META, batch=batch)


def test_a_27b_verify_writes_one_gdn_state_per_request_not_one_per_row():
    """48 GDN layers x 48 heads x 128 x 128 float32 = 0.15 GB a state; a 16-row verify that
    kept every row's state wrote 2.4 GB; the commit writes one state, plus kilobytes a row."""
    model = TrafficModel.of(_state(MODELS["Qwen3.6-27B"]))
    state_bytes = 48 * 48 * 128 * 128 * 4
    assert model.gdn_state == state_bytes
    t = model.cycle(16, 2048)
    gdn_written = sum(t.part(p)[1] for p in ("gdn state", "gdn rows", "conv"))
    assert gdn_written <= 0.3e9
    assert t.part("gdn state") == (2 * state_bytes, state_bytes)
    # the kept rows: k (16 heads x 128), delta (48 x 128), g (48), float32, per GDN layer
    assert model.gdn_row == 48 * (16 * 128 + 48 * 128 + 48) * 4
    # KV: bf16, 16 attention layers x 4 kv heads x 256, K and V, read over the context
    assert t.part("kv") == (2064 * 16 * 4 * 256 * 2 * 2, 16 * 16 * 4 * 256 * 2 * 2)


def test_a_plain_step_reads_and_writes_the_state_once():
    model = TrafficModel.of(_state(MODELS["Qwen3.6-27B"]))
    t = model.cycle(1, 100)
    assert t.part("gdn state") == (model.gdn_state, model.gdn_state)
    assert t.part("gdn rows") == (0, 0)


def test_a_batch_moves_each_requests_bytes_and_reads_only_accepted_rows():
    one = TrafficModel.of(_state(MODELS["Qwen3.6-35B-A3B"]))
    assert TrafficModel.of(_state(MODELS["Qwen3.6-35B-A3B"], batch=8)) == one
    t = one.cycle(16, 512, kept=3)
    assert t.times(8).read == 8 * t.read and t.times(8).written == 8 * t.written
    assert t.part("gdn rows") == (3 * one.gdn_row, 16 * one.gdn_row)
    # an attention-only target moves no GDN bytes; Flash-Next adds its windows and keys
    assert [p for p, _, _ in TrafficModel.of(_state(MODELS["Qwen3-4B"])).cycle(16, 10).parts] \
        == ["kv"]
    flash = TrafficModel.of(_state(QWEN3_8_FLASH_NEXT)).cycle(16, 2048)
    assert flash.part("flash")[0] > 0 and flash.part("flash")[1] > 0


def test_the_bench_prints_every_model_at_batch_1_and_8():
    rows = traffic_rows()
    assert {(r["model"], r["batch"]) for r in rows} == {
        (m, b) for m in ("Qwen3.6-27B", "Qwen3.6-35B-A3B", "Qwen3.8-Flash-Next") for b in (1, 8)}
    by = {(r["model"], r["batch"]): r for r in rows}
    assert by["Qwen3.6-27B", 1]["gdn_written_gb"] <= 0.3
    assert by["Qwen3.6-27B", 8]["written_gb"] == 8 * by["Qwen3.6-27B", 1]["written_gb"]


def test_telemetry_carries_the_cycles_state_bytes():
    engine = Engine.load(ModelPreset.load("demo").engine_config(device="cpu", dtype="fp32",
                                                                method="dflash"))
    prompt = engine.tokenizer.encode("pick up the red cup", add_special_tokens=False)
    stats = generate(engine, prompt, GenerationSettings(max_new_tokens=24)).stats
    t = stats.as_dict()
    per_cycle = t["state_bytes_per_cycle"]
    assert stats.cycles > 0 and per_cycle["read"] > per_cycle["written"] > 0
    parts = t["state_bytes_per_cycle_by_part"]
    assert {"kv", "gdn state", "gdn rows", "conv"} <= set(parts)
    # each cycle read the state at least once and wrote it once
    assert parts["gdn state"]["written"] == engine.traffic.gdn_state
    assert parts["gdn state"]["read"] >= engine.traffic.gdn_state


def test_cycles_from_sums_equal_the_cycles_added_one_by_one():
    """Telemetry adds four integers a cycle and computes the parts once (every part is affine
    in rows, context and kept rows): the same bytes as adding each cycle's parts."""
    model = TrafficModel.of(_state(QWEN3_8_FLASH_NEXT))
    verifies = [(16, 100, 5), (9, 106, 9), (4, 116, 1)]
    one_by_one = model.cycle(*verifies[0])
    for rows, context, kept in verifies[1:]:
        one_by_one = one_by_one.plus(model.cycle(rows, context, kept))
    sums = [sum(v[i] for v in verifies) for i in range(3)]
    assert model.cycles(3, *sums, verify=True) == one_by_one
    assert model.cycles(2, 2, 230, 2, verify=False) == model.cycle(1, 110).plus(
        model.cycle(1, 120))
