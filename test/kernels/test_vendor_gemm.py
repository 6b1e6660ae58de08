"""Vendor GEMMs as candidates beside ours (kernels/gemm/vendor.py): their numerics against
the references, the choice among measured ones, the table that records the winners, and the
engine's Linears calling a recorded winner (engine/weights/tuning.route_vendors)."""

from __future__ import annotations

import json

import pytest
import torch
from test_weight_gemm import fp8_args, int4_args

from flash_planner.engine.engine import Engine
from flash_planner.engine.generate import GenerationSettings, generate
from flash_planner.engine.inputs.chat import encode_chat
from flash_planner.engine.weights.linear import QuantLinear
from flash_planner.engine.weights.tuning import linears, route_vendors
from flash_planner.kernels.gemm import reference
from flash_planner.kernels.gemm.configs import heuristic
from flash_planner.kernels.gemm.context import VENDOR_SECTION, context, shape_key
from flash_planner.kernels.gemm.formats import FORMATS
from flash_planner.kernels.gemm.tune import BUCKETS, split_operands, tune_vendors
from flash_planner.kernels.gemm.vendor import (
    TOLERANCE,
    WEIGHT_ONLY,
    Candidate,
    rel_diff,
    routed,
    winner,
)
from flash_planner.planning.presets import ModelPreset

CPU = torch.device("cpu")


@pytest.fixture
def table(tmp_path, monkeypatch):
    """The CPU context reading a table file of this test's own; read afresh after it."""
    monkeypatch.setenv("FLASH_PLANNER_CACHE", str(tmp_path))
    gemm = context(CPU)
    gemm._table = None
    yield tmp_path / "gemm_configs.json"
    gemm._table = None


CASES = {"int4 g32": ("int4", 256, lambda g: int4_args(96, 256, 32, g)),
         "int4 g128": ("int4", 384, lambda g: int4_args(64, 384, 128, g)),
         "fp8 block": ("fp8", 256, lambda g: fp8_args(96, 256, 128, 128, g))}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("gated", [False, True])
def test_each_vendor_candidate_is_within_its_numerics_tolerance(case, gated):
    fmt, k, make = CASES[case]
    args = make(torch.Generator().manual_seed(1))
    n = args[0].shape[0]
    found = routed(fmt, args, n, k, gated)
    assert found, f"no vendor candidate runs {case} on a CPU"
    name = f"{fmt}_gate_up" if gated else f"{fmt}_gemm"
    for rows in (1, 4, 16):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        want = getattr(reference, name)(x, *args)
        for c in found.values():
            y = c.fn(x)
            assert y.shape == want.shape and y.dtype == x.dtype
            assert rel_diff(y, want) <= TOLERANCE[c.numerics], (c.name, rows)
            if c.numerics == "W4A16":       # the same weights: far inside the tolerance
                assert rel_diff(y, want) < 1e-4


def test_the_winner_is_the_fastest_admissible_candidate():
    w4 = Candidate("tinygemm int4", "W4A16", lambda x: x)
    w8 = Candidate("scaled_mm e4m3", "W8A8", lambda x: x)
    assert winner(1.0, [(w4, 0.5, 1e-5)]) == "tinygemm int4"
    assert winner(1.0, [(w4, 1.0, 1e-5)]) == ""                  # a tie keeps ours
    assert winner(1.0, [(w4, 0.5, TOLERANCE["W4A16"] * 2)]) == ""  # too far from ours
    # activation quantization only where the recipe quantizes activations
    assert winner(1.0, [(w8, 0.2, 1e-3)]) == ""
    assert winner(1.0, [(w8, 0.2, 1e-3), (w4, 0.5, 1e-5)], WEIGHT_ONLY + ("W8A8",)) == \
        "scaled_mm e4m3"
    assert winner(1.0, []) == ""


def test_the_table_keeps_vendor_winners_beside_configurations(table):
    gemm = context(CPU)
    key = shape_key(CPU, "int4", 64, 128, 128, 4, False, True)
    config = heuristic("int4", 64, 128, 4, gemm.sms, 128, False, True)
    gemm.record(key, config)
    gemm.record_vendor(key, "tinygemm int4")
    other = shape_key(CPU, "int4", 64, 128, 128, 8, False, True)
    gemm.record_vendor(other, "")
    raw = json.loads(table.read_text())
    assert raw[VENDOR_SECTION] == {key: "tinygemm int4", other: ""}
    gemm._table = None                                   # as a new process reads it
    assert gemm.table() == {key: config}
    assert gemm.vendor(key) == "tinygemm int4" and gemm.vendor(other) == ""
    assert gemm.vendor(shape_key(CPU, "int4", 64, 128, 128, 16, False, True)) == ""
    # a table written before vendors were measured still reads
    table.write_text(json.dumps({key: raw[key]}))
    gemm._table = None
    assert gemm.table() == {key: config} and gemm.vendors() == {}


def test_tuning_vendors_refuses_a_weight_off_cuda():
    args = int4_args(64, 256, 32, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="CUDA GPU; the weight is on cpu"):
        tune_vendors("int4", args, 64, 256, False, torch.float32)


def _route_everything(engine: Engine, name: str) -> list[QuantLinear]:
    """Record `name` as the winner of every quantized shape and bucket the engine holds."""
    gemm = context(CPU)
    owners = [engine.model, *engine.proposers.values()]
    for linear in linears(owners):
        n = linear.out_features // 2 if linear.gated else linear.out_features
        align = FORMATS[linear.family].k_align(split_operands(linear.family,
                                                              linear.operands())[1])
        for rows in BUCKETS:
            gemm.record_vendor(shape_key(CPU, linear.family, n, linear.in_features, align,
                                         rows, linear.gated, True), name)
    route_vendors(owners, torch.float32)
    return linears(owners)


def test_engine_linears_call_the_recorded_winner_and_stay_lossless(table):
    preset = ModelPreset.load("demo")
    spec = Engine.load(preset.engine_config(device="cpu", dtype="fp32", method="dflash",
                                            weights="int4"))
    plain = Engine.load(preset.engine_config(device="cpu", dtype="fp32", method="none",
                                             weights="int4"))
    # the planner's chat prompt, which the drafter learned (on raw text the retrained demo
    # repeats "table" and drafts nothing that lands)
    task = "pick up the red cup and put it on the table"
    prompt = encode_chat(spec.tokenizer, [{"role": "user", "content": task}])
    settings = GenerationSettings(max_new_tokens=32)
    routed_linears = _route_everything(spec, "tinygemm int4")
    _route_everything(plain, "tinygemm int4")
    took = [m for m in routed_linears if m.vendor_routes]
    assert took
    calls = []
    for m in took:
        m.vendor_routes = {b: (lambda x, fn=fn: calls.append(1) or fn(x))
                           for b, fn in m.vendor_routes.items()}
    # a routed Linear returns the vendor's product, within W4A16's tolerance of ours
    m = took[0]
    x = torch.randn(3, m.in_features)
    y_vendor = m(x)
    y_ours = m.gate_up(x) if m.gated else m.gemm(x)
    assert calls and rel_diff(y_vendor, y_ours) <= TOLERANCE["W4A16"]
    calls.clear()
    spec_out = generate(spec, prompt, settings)
    assert calls, "the speculative engine never called the routed vendor GEMM"
    assert spec_out.token_ids == generate(plain, prompt, settings).token_ids
    assert spec_out.stats.accepted > 0
