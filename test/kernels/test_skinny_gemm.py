"""The skinny weight-only GEMMs (M <= 16, split along K) and the fused gate/up projection.

Every configuration path runs against the formats' references: the FMA path (1, 2, 4 rows)
and the tensor-core path (16), K whole in one program or split over 2-4 programs that meet
through the tile counters, K a multiple of the step (unmasked rows) or not, an N off the
tiles; the gated kernels against `*_gate_up` references; the launchers' choice for 1-16 rows
and the prefill path of the fused projection. The counted configurations are checked for
what the kernels need of them, and the measured table is read back.
"""

from __future__ import annotations

import inspect
import json

import pytest
import torch
from test_weight_gemm import _close, _on, fp8_args, int4_args, nvfp4_args

from flash_planner.kernels import dispatch
from flash_planner.kernels.gemm import configs, context, ops, reference
from flash_planner.kernels.gemm.configs import RowsConfig
from flash_planner.kernels.gemm.tune import skinny_launch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROWS = {fmt: lambda x, *args, fmt=fmt, gated=False, config=None: skinny_launch(
    fmt, x, args, gated, config) for fmt in ("fp8", "nvfp4", "int4")}
GEMM = {"fp8": (ops.fp8_gemm, reference.fp8_gemm), "nvfp4": (ops.nvfp4_gemm, reference.nvfp4_gemm),
        "int4": (ops.int4_gemm, reference.int4_gemm)}
GATE_UP = {"fp8": (ops.fp8_gate_up, reference.fp8_gate_up),
           "nvfp4": (ops.nvfp4_gate_up, reference.nvfp4_gate_up),
           "int4": (ops.int4_gate_up, reference.int4_gate_up)}
# name -> (format, K, weight arguments from a generator, rows of the weight)
SHAPES = {
    "fp8-even": ("fp8", 512, lambda g, n: fp8_args(n, 512, 8, 128, g)),
    "fp8-ragged": ("fp8", 300, lambda g, n: fp8_args(n, 300, 8, 128, g)),
    "nvfp4-even": ("nvfp4", 512, lambda g, n: nvfp4_args(n, 512, g)),
    "nvfp4-ragged": ("nvfp4", 272, lambda g, n: nvfp4_args(n, 272, g)),
    "int4-even": ("int4", 512, lambda g, n: int4_args(n, 512, 128, g)),
    "int4-odd": ("int4", 301, lambda g, n: int4_args(n, 301, 64, g)),
}
# (rows, BLOCK_M, BLOCK_N, K step in values, split): FMA and tensor-core paths, whole and split
CONFIGS = [(1, 1, 32, 64, 1), (2, 2, 16, 64, 3), (3, 4, 32, 64, 4), (16, 16, 32, 64, 1),
           (9, 16, 16, 64, 2), (16, 16, 64, 32, 4)]


def _gated_args(fmt, make, gen, i):
    """Weight arguments of a fused [2I, K] projection: nvfp4 with a global scale per half."""
    args = list(make(gen, 2 * i))
    if fmt == "nvfp4":
        args[2] = torch.tensor([0.0173, 0.0311])
    return args


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "M{}-BM{}-BN{}-BK{}-S{}".format(*c))
@pytest.mark.parametrize("shape", SHAPES)
def test_every_path_matches_the_reference(shape, config, dtype):
    fmt, k, make = SHAPES[shape]
    m, *tiles = config
    gen = torch.Generator().manual_seed(m)
    args = _on(DEVICE, make(gen, 45))
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    out = ROWS[fmt](x, *args, config=RowsConfig(*tiles))
    _close(out, GEMM[fmt][1](x, *args))
    assert int(context.context(x.device).counters(1).abs().sum()) == 0   # each split tile reset it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[2], CONFIGS[4]],
                         ids=lambda c: "M{}-BM{}-BN{}-BK{}-S{}".format(*c))
@pytest.mark.parametrize("shape", ["fp8-even", "nvfp4-ragged", "int4-odd"])
def test_gated_paths_match_the_reference(shape, config, dtype):
    fmt, k, make = SHAPES[shape]
    m, *tiles = config
    gen = torch.Generator().manual_seed(m)
    args = _on(DEVICE, _gated_args(fmt, make, gen, 24))
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    out = ROWS[fmt](x, *args, gated=True, config=RowsConfig(*tiles))
    assert out.shape == (m, 24)
    _close(out, GATE_UP[fmt][1](x, *args))
    assert int(context.context(x.device).counters(1).abs().sum()) == 0


@pytest.mark.parametrize("m", [1, 5, 16, 37], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("fmt", GATE_UP)
def test_gate_up_launcher_matches_the_reference(fmt, m):
    """The public launcher: the skinny kernel's own choice up to 16 rows, the tiled kernel
    and the activation beside it for a prefill chunk."""
    shape = {"fp8": "fp8-even", "nvfp4": "nvfp4-even", "int4": "int4-odd"}[fmt]
    _, k, make = SHAPES[shape]
    gen = torch.Generator().manual_seed(m)
    args = _on(DEVICE, _gated_args(fmt, make, gen, 40))
    x = torch.randn(2, m, k, generator=gen).to(torch.bfloat16).to(DEVICE)[:, :m]
    kernel, reference = GATE_UP[fmt]
    out = kernel(x, *args)
    assert out.shape == (2, m, 40)
    _close(out, reference(x, *args))
    assert inspect.signature(kernel) == inspect.signature(reference)
    assert list(inspect.signature(getattr(dispatch, f"{fmt}_gate_up")).parameters) == list(
        inspect.signature(reference).parameters)


def test_gate_up_is_the_two_projections_with_swiglu():
    """The reference itself: silu of the gate rows' product times the up rows' product."""
    gen = torch.Generator().manual_seed(3)
    w, s, _, _ = fp8_args(32, 256, 8, 128, gen)
    x = torch.randn(3, 256, generator=gen)
    gate = reference.fp8_gemm(x, w[:16], s[:2], 8, 128)
    up = reference.fp8_gemm(x, w[16:], s[2:], 8, 128)
    want = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(reference.fp8_gate_up(x, w, s, 8, 128), want, rtol=1e-5, atol=1e-5)


def _bad_gate_up():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 256)
    w, s, _, _ = fp8_args(40, 256, 8, 128, gen)
    p, e, _ = nvfp4_args(40, 256, gen)
    q, f, z, _ = int4_args(41, 256, 32, gen)
    return {
        "fp8-straddles": (ops.fp8_gate_up, (x, w[:36], s[:5], 8, 128), "block_n"),
        "nvfp4-one-global": (ops.nvfp4_gate_up, (x, p, e, torch.ones(1)), "global_scale"),
        "int4-odd-rows": (ops.int4_gate_up, (x, q, f, z, 32), "gate rows"),
    }


BAD = _bad_gate_up()


@pytest.mark.parametrize("case", BAD)
def test_bad_gate_up_operands_raise_naming_what(case):
    fn, args, what = BAD[case]
    with pytest.raises(ValueError, match=what):
        fn(*_on(DEVICE, args))


def test_a_tile_too_short_for_the_rows_is_refused():
    gen = torch.Generator().manual_seed(0)
    args = _on(DEVICE, nvfp4_args(20, 256, gen))
    x = torch.randn(5, 256).to(DEVICE)
    with pytest.raises(ValueError, match="BLOCK_M 4 < 5 rows"):
        ROWS["nvfp4"](x, *args, config=RowsConfig(4, 32, 128, 1))


# ---- configurations

SHAPES_27B = [(17408, 5120), (5120, 17408), (12288, 5120), (248320, 5120), (1024, 2048)]


@pytest.mark.parametrize("sms", [20, 132])
@pytest.mark.parametrize("family,k_align", [("fp8", 128), ("nvfp4", 16), ("int4", 128),
                                            ("int4", 32)])
def test_counted_configurations_are_launchable(family, k_align, sms):
    for n, k in SHAPES_27B:
        for rows in range(1, 17):
            for gated, fp32 in ((False, False), (True, True)):
                c = configs.heuristic(family, n, k, rows, sms, k_align, gated, fp32)
                assert c.block_m >= rows and (c.block_m >= 16) == c.use_dot
                assert c.split in (1, 2, 4, 8, 16)
                if family == "nvfp4":
                    assert c.block_k % 16 == 0
                else:
                    assert k_align % c.block_k == 0          # one scale block / group a step
                tiles, steps, split = c.grid(n, k)
                assert split <= c.split and (split - 1) * steps * c.block_k < k
                if split > 1:
                    assert steps >= 2                        # every split keeps two K steps


def test_down_projection_splits_until_four_programs_an_sm():
    """The 27B's MLP down projection in FP8 has 80 tiles of 64 rows: under 4 per SM on an
    H100's 132 SMs, so K is split; on Thor's 20 SMs the tiles alone fill them. NVFP4's 16-row
    tiles hold 128 rows (configs.heuristic): 40 tiles, so Thor splits K in two."""
    for fmt, align, tiles, thor_split in (("fp8", 128, 80, 1), ("nvfp4", 16, 40, 2)):
        h100 = configs.heuristic(fmt, 5120, 17408, 1, 132, align)
        thor = configs.heuristic(fmt, 5120, 17408, 1, 20, align)
        assert h100.grid(5120, 17408)[0] == tiles == thor.grid(5120, 17408)[0]
        assert h100.split > 1 and tiles * h100.split >= 4 * 132
        assert thor.split == thor_split and tiles * thor.split >= 4 * 20


def test_the_measured_table_is_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASH_PLANNER_CACHE", str(tmp_path))
    cpu = torch.device("cpu")
    gemm = context.GemmContext(cpu)                  # the choices made here end with it
    monkeypatch.setitem(context._contexts, cpu, gemm)
    key = context.shape_key(cpu, "nvfp4", 77, 512, 16, 3, False, True)
    measured = RowsConfig(4, 16, 128, 2, num_warps=8)
    gemm.record(key, measured)
    gemm = context.GemmContext(cpu)                  # a new process reads it
    monkeypatch.setitem(context._contexts, cpu, gemm)
    assert gemm.choose("nvfp4", 77, 512, 4, 16, False, True) == measured
    assert gemm.choose("nvfp4", 77, 512, 4, 16, True, True) == (
        configs.heuristic("nvfp4", 77, 512, 4, 4, 16, True, True))
    assert json.loads(context.table_path().read_text())[key]["num_warps"] == 8
    gen = torch.Generator().manual_seed(0)
    args = _on(DEVICE, nvfp4_args(77, 512, gen))
    x = torch.randn(3, 512, generator=gen).to(DEVICE)
    if DEVICE == "cpu":                               # the table's entry is the one launched
        from flash_planner.kernels.specs import record_launches

        with record_launches() as launches:
            ops.nvfp4_gemm(x, *args)
        assert launches[0].num_warps == 8 and launches[0].constexprs["BLOCK_N"] == 16
    _close(ops.nvfp4_gemm(x, *args), reference.nvfp4_gemm(x, *args))


def test_an_unreadable_table_falls_back_to_counting(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("FLASH_PLANNER_CACHE", str(tmp_path))
    context.table_path().write_text("{not json")
    gemm = context.GemmContext(torch.device("cpu"))
    with caplog.at_level("WARNING"):
        got = gemm.choose("fp8", 64, 256, 1, 128, False, False)
    assert got == configs.heuristic("fp8", 64, 256, 1, 4, 128)
    assert "unreadable" in caplog.text


def test_no_kernel_module_reads_the_disk_or_the_device_at_import(tmp_path):
    """A fresh interpreter imports every GEMM module with the table's file unreadable and no
    context made: nothing is read until a launch asks."""
    import subprocess
    import sys

    (tmp_path / "gemm_configs.json").write_text("{not json")
    code = ("import logging, flash_planner.kernels.dispatch, flash_planner.kernels.report; "
            "from flash_planner.kernels.gemm import context, ops, tiled, skinny, tune; "
            "assert context._contexts == {}, context._contexts; print('ok')")
    env = {**__import__("os").environ, "FLASH_PLANNER_CACHE": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode == 0 and "unreadable" not in run.stderr, run.stderr
    assert run.stdout.strip() == "ok"


def test_the_launch_path_traces_into_a_compiled_graph_without_a_break(monkeypatch):
    """Compiled forwards (fullgraph) trace the launchers' host side: choosing the
    configuration, the counters and the workspace must not read files, remember anything
    or make a module-level tensor inside the trace."""
    from flash_planner.kernels.gemm.skinny import workspace

    cpu = torch.device("cpu")
    gemm = context.GemmContext(cpu)
    monkeypatch.setitem(context._contexts, cpu, gemm)

    def host(x):
        ctx = context.context(x.device)
        config = ctx.choose("nvfp4", 5120, 17408, x.shape[0], 16, False,
                            x.dtype == torch.float32)
        tiles, steps, split = config.grid(5120, 17408)
        part = workspace(split, 1, x.shape[0], 5120, x.device)
        return x * steps + ctx.counters(tiles).sum() + part.numel()

    x = torch.ones(3, 4)
    traced = torch.compile(host, fullgraph=True, backend="eager")(x)
    assert gemm.chosen == {}                                 # the trace remembered nothing
    assert torch.equal(traced, host(x))
    assert set(gemm.chosen) == {                             # the eager call did
        ("nvfp4", 5120, 17408, 4, 16, False, True)}


def test_tuning_measures_on_a_gpu_only(monkeypatch):
    from flash_planner.engine.weights import tuning
    from flash_planner.kernels.gemm.tune import tune

    gen = torch.Generator().manual_seed(0)
    args = nvfp4_args(32, 256, gen)
    with pytest.raises(ValueError, match="tuning measures on a CUDA GPU"):
        tune("nvfp4", args, 32, 256, False, torch.float32)
    monkeypatch.setenv(tuning.ENV, "1")
    assert tuning.wanted(torch.device("cuda")) and not tuning.wanted(torch.device("cpu"))
    monkeypatch.setenv(tuning.ENV, "0")
    assert not tuning.wanted(torch.device("cuda"))


@pytest.mark.parametrize("env", [{"FLASH_PLANNER_CACHE": "/tmp/fp-cache"},
                                 {"XDG_CACHE_HOME": "/tmp/xdg"}, {}])
def test_the_table_lives_under_the_engines_cache_root(monkeypatch, env):
    from flash_planner.engine.config import cache_home

    for name in ("FLASH_PLANNER_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert context.table_path() == cache_home() / "gemm_configs.json"
