"""The GPU figures from one command: ceilings, weight-only GEMMs, and the Thor line.

Parts (each one table, all of them in one JSON file):
  ceilings  device-to-device copy bandwidth (bytes read + written) and a bf16 matmul's
            TFLOP/s, measured in this run;
  gemm      weight-only GEMMs at Qwen3.6-27B and 35B-A3B shapes, rows 1, 2, 4, 8, 16: bf16
            (torch) and the engine's fp8, nvfp4 and int4 layouts (dispatch: the Triton kernels
            on CUDA), as time and as the fraction of the copy bandwidth their weight bytes
            reach; beside each quantized row the tiled kernel (the M > 16 one, which decode
            ran before the skinny kernels) and the skinny kernel at its counted configuration
            (kernels/gemm/configs.py; the launch itself uses the measured table where it has
            the shape: `--tune` measures it first), and the speed against bf16; below each
            quantized row torch's own GEMMs on the same operands (kernels/gemm/vendor.py:
            tinygemm int4, W4A16; cuBLASLt e4m3, W8A8; FP4 block-scaled: why absent) with
            their device time and difference from ours (`--tune` also records which one
            serves each shape and bucket: the engine's Linears call it there); then the
            27B's MLP gate and up projections fused (one GEMM with SwiGLU) against the two
            GEMMs and the activation apart;
  thor      the full 27B's and 35B-A3B's bytes per forward (bench/weight_bytes.py) over Thor's
            273 GB/s at the NVFP4 GEMMs' measured fraction: ms and tok/s per token;
  demo      the demo planner through the planner service, warmed up, greedy: dtype (fp32,
            bf16) x forward (eager, compiled: CUDA graphs) x method (auto, dflash, mtp,
            none) on 12 held-out tasks: TTFT and decode tok/s (medians), tokens per cycle,
            plans equal to fp32 eager's, and the engine's first request's TTFT against the
            median of the next ones (load and warm-up times beside; for the compiled engines
            also a second start's load, in a new process reading the on-disk caches). Needs
            our planning
            dependencies too (docs/thor.md lists the wheels).
  slices    engine slices at the 27B's width (4 layers: 3 GDN + 1 attention, its vocabulary)
            and the 35B-A3B's, bf16 and NVFP4 (quantized at load, experts included; gate and
            up fused as the loader fuses them), random weights: a
            1-row decode and a 16-row verify (with its rollback), eager and through the
            compiled graphs, as ms, bytes per forward and the fraction of the copy bandwidth.
            --small: tiny widths, eager only (a cold compile on a CPU takes minutes). On
            a GPU each slice compiles its graphs (75-105 s cold at these widths; the
            on-disk cache makes a second run quick): `--parts` splits a first run.
  moe       (with gemm) the 35B-A3B's grouped expert GEMMs in each format, a decode row and
            4- and 16-row verify blocks with random routing: time beside the tiled kernel's,
            and the fraction of the copy bandwidth the distinct chosen experts' bytes reach.
  profile   where a plan's time goes in fp32 and in bf16 (the demo, eager, auto, under
            torch.profiler): the ops with the most host time and their device time, per dtype.
  vision    one image's TTFT parts at the 27B's and the 35B-A3B's dimensions (random
            weights, bf16): the vision tower per image (224, 448, 896 px; bench/vision.py's
            tower) and the prefill of its tokens and a 32-token task through a 4-layer
            slice; the TTFT estimate scales the slice to the model's depth.
            --small: a 2-block narrow tower on 32 and 64 px, tiny slices, fp32.
  batch     (by name only) 8 requests at once against one at the 27B's width slice (bf16):
            a decode step (1 row each) and a verify (16 rows each, with its rollbacks) over
            the slots of one batch state, every slot 64 tokens in, capacity 4,112 rows;
            eager and through the batch's compiled graphs (CUDA graphs, batch buckets 1
            and 8): ms of each, and the aggregate (8 x ms of one / ms of eight).
            --small: tiny widths, eager only.
bench/kernels.py has the hot-path kernels' table.

    python bench/gpu.py [--parts ceilings gemm thor] [--json-out FILE]   # a CUDA GPU
    python bench/gpu.py --small     # tiny shapes on a CPU, kernels interpreted: a smoke run

The GPU's Python needs torch, triton and transformers; our other dependencies are not used.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

SMALL = "--small" in sys.argv
if SMALL:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
# bench/kernels.py's timers, loaded under another name: a module called `kernels` would
# shadow Hugging Face's package of that name, which transformers probes for
_spec = importlib.util.spec_from_file_location("bench_kernels", HERE / "kernels.py")
_bench_kernels = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_bench_kernels)
copy_bandwidth, timed_ms = _bench_kernels.copy_bandwidth, _bench_kernels.timed_ms
graph_ms = _bench_kernels.graph_ms
from slices import TINY, expert_stack, quantize_layout, slice_model  # noqa: E402

PARTS = ("ceilings", "gemm", "thor", "slices", "demo", "profile", "vision", "batch")
# `batch` compiles 10 more graphs at the 27B's width (minutes cold): asked for by name
DEFAULT_PARTS = PARTS[:-1]
SLICES = ("27B", "35B-A3B")
DEMO_METHODS = ("auto", "dflash", "mtp", "none")
ROWS = (1, 2, 4, 8, 16)
THOR_GBPS = 273.0
# (name, N, K): the Linear shapes one decode step reads most of
SHAPES = {
    "big": [("27B MLP up", 17408, 5120), ("27B MLP down", 5120, 17408),
            ("27B attention q", 12288, 5120), ("27B lm_head", 248320, 5120),
            ("35B-A3B expert up", 1024, 2048), ("35B-A3B lm_head", 248320, 2048)],
    "small": [("tiny up", 256, 128), ("tiny down", 128, 256)],
}
FORMATS = ("bf16", "fp8", "nvfp4", "int4")
# the device-time columns rotate over copies of a weight (or routings of the experts) until
# one pass reads this many bytes: several times an H100's or H200's 50-60 MB L2, so a launch
# finds its weights in memory, not left in L2 by the launch before it
ROTATE_BYTES = 256 << 20
GRAPH_LAUNCHES = 16           # launches per captured graph at least


def weight_op(fmt: str, n: int, k: int, device: str, dtype: torch.dtype):
    """(x -> y, weight bytes, the QuantLinear or None for bf16) for one Linear [N, K] in
    `fmt`, random weights."""
    w = torch.randn(n, k, device=device, dtype=torch.float32) * 0.02
    if fmt == "bf16":
        w = w.to(dtype)
        return (lambda x: torch.nn.functional.linear(x, w)), w.nbytes, None
    layout = quantize_layout(fmt)
    module = layout.module(n, k).to_empty(device=device)
    module.set_packed(layout.convert({"weight": w}, n, k))
    nbytes = sum(b.nbytes for b in module.buffers())
    return module.gemm, nbytes, module


def ceilings(device: str, small: bool) -> dict:
    bw = copy_bandwidth(device)
    n = 256 if small else 8192
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = timed_ms(lambda: a @ b, 3 if small else 20)
    return {"copy_gbps": bw / 1e9, "matmul_tflops": 2 * n ** 3 / (ms / 1000) / 1e12,
            "matmul_n": n, "matmul_dtype": str(dtype).removeprefix("torch.")}


def gemm_rows(device: str, small: bool, bw: float, repeats: int, tune: bool) -> list[dict]:
    from flash_planner.kernels.gemm.tune import tune as tune_shape
    from flash_planner.kernels.gemm.tune import tune_vendors
    from flash_planner.kernels.gemm.vendor import candidates as vendor_candidates

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rows = ROWS[:2] if small else ROWS
    out = []
    for name, n, k in SHAPES["small" if small else "big"]:
        bf16_ms = {}
        for fmt in FORMATS:
            op, nbytes, module = weight_op(fmt, n, k, device, dtype)
            serves = {}
            if module is not None and tune:
                tune_shape(fmt, module.operands(), n, k, False, dtype, rows)
                serves = tune_vendors(fmt, module.operands(), n, k, False, dtype, rows)
            vendors = ([] if module is None else
                       vendor_candidates(fmt, module.operands(), n, k))
            ops = [op] + [weight_op(fmt, n, k, device, dtype)[0]
                          for _ in range(rotations(nbytes, small) - 1)]
            for m in rows:
                x = torch.randn(m, k, device=device, dtype=dtype)
                ms = timed_ms(lambda op=op, x=x: op(x), repeats)
                device_ms = graph_ms(launches([lambda op=o, x=x: op(x) for o in ops], small),
                                     1 if small else 5)
                row = {"shape": name, "n": n, "k": k, "format": fmt, "rows": m, "ms": ms,
                       "graph_ms": device_ms, "weight_bytes": nbytes,
                       "of_copy_bw": nbytes / (device_ms / 1000) / bw}
                if module is None:
                    bf16_ms[m] = device_ms
                else:
                    row.update(_beside(fmt, module, x, repeats),
                               over_bf16=bf16_ms[m] / device_ms,
                               vendor=_vendor(vendors, op(x), x, nbytes, bw, small))
                    if serves:
                        row["serves"] = serves[m] or "ours"
                out.append(row)
            del ops, op, module, vendors
    return out


def _vendor(vendors: list, ours: torch.Tensor, x: torch.Tensor, nbytes: int, bw: float,
            small: bool) -> list[dict]:
    from flash_planner.kernels.gemm.vendor import rel_diff

    """Each vendor candidate on the same rows (kernels/gemm/vendor.py): its device time (CUDA
    graphs; on a CPU the wall clock), the fraction of the copy bandwidth our weight's bytes
    reach in that time, the numerics it computes and its largest difference from our
    kernel's output relative to that output's largest value; or why it is not available."""
    out = []
    for c in vendors:
        row = {"name": c.name, "numerics": c.numerics}
        if c.fn is None:
            out.append({**row, "unavailable": c.why_not})
            continue
        try:
            y = c.fn(x)
            device_ms = graph_ms([lambda c=c: c.fn(x)] * (1 if small else GRAPH_LAUNCHES),
                                 1 if small else 5)
        except (RuntimeError, NotImplementedError) as exc:   # the vendor refuses the shape
            out.append({**row, "unavailable": f"{type(exc).__name__}: {str(exc)[:160]}"})
            continue
        out.append({**row, "graph_ms": device_ms, "of_copy_bw": nbytes / (device_ms / 1000) / bw,
                    "rel_diff": rel_diff(y, ours)})
    return out


def rotations(nbytes: int, small: bool) -> int:
    """Copies of an operand of `nbytes` that one pass of the device-time columns rotates
    over (ROTATE_BYTES together; one on a CPU's small run)."""
    return 1 if small else max(1, min(256, -(-ROTATE_BYTES // nbytes)))


def launches(calls: list, small: bool) -> list:
    """`calls` repeated to GRAPH_LAUNCHES at least (whole passes; once on a CPU's small
    run, where each launch is interpreted)."""
    return calls if small else calls * max(1, -(-GRAPH_LAUNCHES // len(calls)))


def _beside(fmt: str, module, x: torch.Tensor, repeats: int) -> dict:
    """The tiled kernel's time and the skinny kernel's at its counted configuration."""
    from flash_planner.kernels.gemm import configs, context
    from flash_planner.kernels.gemm.formats import FORMATS as GEMM_FORMATS
    from flash_planner.kernels.gemm.tune import skinny_launch, split_operands

    ops = module.operands()
    gemm = context.context(x.device)
    counted = configs.heuristic(fmt, module.out_features, module.in_features, x.shape[0],
                                gemm.sms, GEMM_FORMATS[fmt].k_align(split_operands(fmt, ops)[1]),
                                False, x.dtype == torch.float32)
    with gemm.tiled_only():
        tiled_ms = timed_ms(lambda: module(x), repeats)
    return {"tiled_ms": tiled_ms,
            "counted_ms": timed_ms(lambda: skinny_launch(fmt, x, ops, False, counted), repeats)}


def moe_rows(device: str, small: bool, bw: float, repeats: int) -> list[dict]:
    """The 35B-A3B's grouped expert GEMMs (256 experts, top 8; tiny: 4, top 2): gate and up
    stacked (as the loader fuses them) and down, a decode row and verify blocks with random
    distinct routing; bytes: the distinct chosen experts'."""
    from flash_planner.engine.weights.fuse import stack_gate_up
    from flash_planner.kernels.gemm.context import context

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    experts, topk = (4, 2) if small else (256, 8)
    shapes = [("tiny gate+up", 128, 64), ("tiny down", 64, 32)] if small else [
        ("35B-A3B gate+up", 512, 2048), ("35B-A3B down", 2048, 512)]
    gen = torch.Generator().manual_seed(0)
    out = []
    for name, n, k in shapes:
        slots = topk if "down" in name else 1
        for fmt in FORMATS:
            stack = expert_stack(fmt, experts, n, k, device, dtype)
            if "gate+up" in name:
                stack = stack_gate_up(stack, expert_stack(fmt, experts, n, k, device, dtype))
            per_expert = sum(b.nbytes for b in stack.buffers()) + sum(
                p.nbytes for p in stack.parameters())
            per_expert //= experts
            for m in ((1, 4) if small else (1, 4, 16)):
                def routing(m=m):
                    return torch.stack([torch.randperm(experts, generator=gen)[:topk]
                                        for _ in range(m)]).to(device=device, dtype=torch.int32)

                ids = routing()
                x = torch.randn(m, slots, k, device=device, dtype=dtype)
                ms = timed_ms(lambda x=x, ids=ids, g=stack.grouped: g(x, ids), repeats)
                with context(x.device).tiled_only():
                    tiled_ms = timed_ms(lambda x=x, ids=ids, g=stack.grouped: g(x, ids),
                                        repeats)
                nbytes = per_expert * len(set(ids.flatten().tolist()))
                # device time over other routings in turn: their experts are not in L2
                routings = [ids] + [routing() for _ in range(rotations(nbytes, small) - 1)]
                device_ms = graph_ms(launches([lambda x=x, r=r, g=stack.grouped: g(x, r)
                                               for r in routings], small), 1 if small else 5)
                mean_bytes = per_expert * statistics.mean(
                    len(set(r.flatten().tolist())) for r in routings)
                out.append({"shape": name, "format": fmt, "rows": m, "ms": ms,
                            "graph_ms": device_ms, "tiled_ms": tiled_ms,
                            "weight_bytes": mean_bytes,
                            "of_copy_bw": mean_bytes / (device_ms / 1000) / bw})
    return out


def gate_up_rows(device: str, small: bool, repeats: int) -> list[dict]:
    """The 27B's MLP input (gate and up, I 17408 from K 5120) fused against apart."""
    from flash_planner.engine.weights.fuse import stack_gate_up

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    i, k = (128, 64) if small else (17408, 5120)
    out = []
    for fmt in FORMATS[1:]:
        _, nbytes, gate = weight_op(fmt, i, k, device, dtype)
        _, _, up = weight_op(fmt, i, k, device, dtype)

        def apart(x, gate=gate, up=up):
            return torch.nn.functional.silu(gate(x)) * up(x)

        for m in (1, 16):
            x = torch.randn(m, k, device=device, dtype=dtype)
            apart_ms = timed_ms(lambda x=x: apart(x), repeats)
            out.append({"format": fmt, "rows": m, "i": i, "k": k, "apart_ms": apart_ms})
        fused = stack_gate_up(gate, up)
        for row in out[-2:]:
            x = torch.randn(row["rows"], k, device=device, dtype=dtype)
            row["fused_ms"] = timed_ms(lambda x=x, fused=fused: fused(x), repeats)
            row["weight_bytes"] = 2 * nbytes
    return out


def thor_rows(fraction: float) -> list[dict]:
    """Bytes per forward of the full models (analytic) at `fraction` of Thor's bandwidth."""
    from weight_bytes import MODELS, analytic_bytes

    out = []
    for model, raw in MODELS.items():
        if "4B" in model:
            continue
        gb = analytic_bytes(raw, "nvfp4") / 1e9
        ms = gb / (THOR_GBPS * fraction) * 1000
        out.append({"model": model, "format": "nvfp4", "gb_per_forward": gb,
                    "fraction": fraction, "ms_per_token": ms, "tok_s": 1000 / ms})
    return out


def slice_rows(device: str, small: bool, bw: float, repeats: int,
               names: tuple[str, ...] = SLICES) -> list[dict]:
    from weight_bytes import QWEN3_6_27B, QWEN3_6_35B_A3B

    from flash_planner.engine.weights.bytes import bytes_per_forward
    from flash_planner.kernels import dispatch

    if small:   # the torch references: interpreted kernels would take seconds a forward
        dispatch.set_backend("auto")

    dtype = torch.float32 if small else torch.bfloat16
    four = {"num_hidden_layers": 4, **(TINY if small else {})}
    slices = [(name, dict(raw, **four), ("bf16", "nvfp4"))
              for name, raw in (("27B", QWEN3_6_27B), ("35B-A3B", QWEN3_6_35B_A3B))
              if name in names]
    out = []
    for name, raw, formats in slices:
        for weights in formats:
            cfg, model = slice_model(raw, weights, dtype, device)
            top_k = cfg.moe.top_k if cfg.moe else None
            blocks = (1, 16)
            times = _time_slice(cfg, model, dtype, device, repeats, compiled=not small)
            for rows in blocks:
                nbytes = bytes_per_forward(model, None if top_k is None else
                                           min(cfg.moe.num_experts, top_k * rows))
                for forward, by_rows in times.items():
                    ms = by_rows[rows]
                    out.append({"slice": name, "weights": weights, "forward": forward,
                                "rows": rows, "ms": ms, "gb_per_forward": nbytes / 1e9,
                                "of_copy_bw": nbytes / (ms / 1000) / bw,
                                "over_decode": ms / by_rows[1]})
            del model
            if device == "cuda":
                torch.cuda.empty_cache()
    return out


def _time_slice(cfg, model, dtype: torch.dtype, device: str, repeats: int, compiled: bool
                ) -> dict[str, dict[int, float]]:
    """ms of a 1-row decode and a 16-row verify after a 64-token prompt: eager, and (when
    `compiled`) through StaticForward's graphs; every forward commits one row."""
    from flash_planner.engine.models.graphs.compiled import StaticForward
    from flash_planner.engine.state.cache import InferenceState

    context = 64
    state = InferenceState(cfg, capacity=context + 4 * (repeats + 2) * 16, max_steps=16,
                           kv_dtype=dtype, compute_dtype=dtype, device=torch.device(device))
    gen = torch.Generator(device="cpu").manual_seed(0)
    model(torch.randint(0, cfg.vocab_size, (1, context), generator=gen).to(device), state)
    state.commit(context)

    def step(rows: int) -> None:
        ids = torch.randint(0, cfg.vocab_size, (1, rows), generator=gen).to(device)
        model(ids, state, record_steps=rows > 1, all_logits=rows > 1)
        state.commit(1)                  # a verify keeps one row: its rollback runs too

    times = {"eager": {t: timed_ms(lambda t=t: step(t), repeats) for t in (1, 16)}}
    if compiled:
        static = StaticForward(model, state, 16)
        static.warm_up()
        model.set_static(static)
        times["graphs"] = {t: timed_ms(lambda t=t: step(t), repeats) for t in (1, 16)}
        model.set_static(None)
    return times


def batch_rows(device: str, small: bool, repeats: int, batch: int = 8,
               forwards: tuple[str, ...] | None = None) -> list[dict]:
    """The `batch` part: ms of `batch` requests' decode step and verify over slots of one
    batch state against one request's, eager and (default: not --small) through the
    compiled graphs of batch buckets 1 and `batch`; every step commits one row per slot."""
    from weight_bytes import QWEN3_6_27B

    from flash_planner.engine.models.graphs.compiled import StaticForward
    from flash_planner.engine.state.slots import SlotStates
    from flash_planner.kernels import dispatch

    if small:   # the torch references: interpreted kernels would take seconds a forward
        dispatch.set_backend("auto")
    dtype = torch.float32 if small else torch.bfloat16
    cfg, model = slice_model(dict(QWEN3_6_27B, num_hidden_layers=4, **(TINY if small else {})),
                             "bf16", dtype, device)
    context, max_block = 64, 16
    slots = SlotStates(cfg, batch + 1, 4096 + max_block, max_block, dtype, dtype,
                       torch.device(device))
    gen = torch.Generator(device="cpu").manual_seed(0)

    def ids(m: int, rows: int) -> torch.Tensor:
        return torch.randint(0, cfg.vocab_size, (m, rows), generator=gen).to(device)

    def step(m: int, rows: int) -> None:
        model(ids(m, rows), slots.rows(m), record_steps=rows > 1, all_logits=rows > 1)
        for view in slots.views[:m]:
            view.commit(1)          # a verify keeps one row: its rollback runs too

    out = []
    with torch.inference_mode():
        for view in slots.views[:batch]:
            model(ids(1, context), view)
            view.commit(context)
        for forward in forwards or (("eager",) if small else ("eager", "graphs")):
            if forward == "graphs":
                model.batch_static = StaticForward(model, slots.whole, max_block,
                                                   batches=(1, batch))
                model.batch_static.warm_up()
            for rows in (1, max_block):
                ms = {m: timed_ms(lambda m=m, t=rows: step(m, t), repeats) for m in (1, batch)}
                out.append({"slice": "27B", "forward": forward, "rows": rows, "batch": batch,
                            "ms_one": ms[1], "ms_batch": ms[batch],
                            "aggregate": batch * ms[1] / ms[batch]})
        model.batch_static = None
    return out


def demo_service(device: str, dtype: str, compile_: str, small: bool):
    """(the demo's planner service over a freshly loaded engine, its load seconds); --small
    keeps the torch references (interpreted kernels would take minutes a plan)."""
    from flash_planner.engine.engine import Engine
    from flash_planner.kernels import dispatch
    from flash_planner.planning.presets import ModelPreset, default_skills_path
    from flash_planner.planning.service import PlannerConfig, PlannerService
    from flash_planner.planning.skills import SkillCatalog

    if small:
        dispatch.set_backend("auto")
    preset = ModelPreset.load("demo")
    t0 = time.perf_counter()
    # one request at a time (max_batch 1): the single-request decode this part measures,
    # and no batch buckets to compile at load
    engine = Engine.load(preset.engine_config(device=device, dtype=dtype, compile=compile_,
                                              max_batch=1))
    load_s = time.perf_counter() - t0
    return PlannerService(engine, SkillCatalog.from_yaml(default_skills_path()), PlannerConfig(
        refusal_hint=preset.refusal_hint, sampling="greedy")), load_s


def held_out(n: int) -> list:
    from flash_planner.train.corpus import heldout_sets

    return heldout_sets(0, 40)["world"][:n]


def demo_rows(device: str, small: bool, methods: tuple[str, ...] = DEMO_METHODS,
              forwards: tuple[str, ...] = ("eager", "compiled"), tasks: int = 12
              ) -> list[dict]:
    """The demo through the planner service per (dtype, forward, method); see the module's
    docstring. --small: fp32 and bf16 eager, auto and none, 2 tasks, on the torch references
    (interpreted kernels would take minutes a plan)."""

    from flash_planner.planning.request import PlanRequest

    tasks = held_out(2 if small else tasks)
    forwards = ("off",) if small else tuple({"eager": "off", "compiled": "on"}[f]
                                            for f in forwards)
    methods = ("auto", "none") if small else methods
    rows, reference = [], {}
    for dtype in ("fp32", "bf16"):
        for compile_ in forwards:
            service, load_s = demo_service(device, dtype, compile_, small)
            service.start()
            warm_ms = service.warm_up()
            first = True
            for method in methods:
                results = [service.plan(PlanRequest(ex.task, ex.context, method=method),
                                        timeout=600) for ex in tasks]
                t = [r.telemetry for r in results]
                plans = [r.plan if r.success else None for r in results]
                reference.setdefault(method, plans)      # fp32 eager comes first
                ttft = [x["ttft_ms"] for x in t]
                rows.append({
                    "dtype": dtype, "forward": "compiled" if compile_ == "on" else "eager",
                    "method": method, "ttft_ms": statistics.median(ttft),
                    "tok_s": statistics.median(x["decode_tokens_per_s"] for x in t),
                    "tokens_per_cycle": statistics.mean(x["tokens_per_cycle"] for x in t),
                    "plans_equal": sum(a == b for a, b in zip(plans, reference[method])),
                    "tasks": len(tasks), "load_s": load_s, "warm_up_ms": warm_ms,
                    # the engine's first request after warm-up against the rest of its method
                    "first_ttft_ms": ttft[0] if first else None,
                    "next_ttft_ms": statistics.median(ttft[1:]) if first else None})
                first = False
            service.stop()
            del service
            if device == "cuda":
                torch.cuda.empty_cache()
            if compile_ == "on":   # a second start: a new process, the compiled graphs on disk
                second = second_start_s(device, dtype)
                for row in rows[-len(methods):]:
                    row["second_load_s"] = second
    return rows


def second_start_s(device: str, dtype: str) -> float:
    """Seconds a new process takes to load the demo engine compiled (imports excluded), with
    what the first start left in the on-disk caches."""
    import subprocess

    script = ("import json, time; from flash_planner.engine.engine import Engine; "
              "from flash_planner.planning.presets import ModelPreset; t0 = time.perf_counter(); "
              f"Engine.load(ModelPreset.load('demo').engine_config(device={device!r}, "
              f"dtype={dtype!r}, compile='on', max_batch=1)); "
              "print(json.dumps(time.perf_counter() - t0))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, timeout=900).stdout
    return float(out.strip().splitlines()[-1])


def profile_rows(device: str, small: bool) -> list[dict]:
    """Where a plan's time goes, fp32 against bf16: the demo through the planner service
    (eager, auto), three held-out plans under torch.profiler after warm-up; per dtype the
    ops with the most host time (self CPU) and their device time. The first GPU run found
    bf16 5x slower than fp32 when eager and in TTFT: this names the ops that differ."""
    from torch.profiler import ProfilerActivity, profile

    from flash_planner.planning.request import PlanRequest
    tasks = held_out(1 if small else 3)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    rows = []
    for dtype in ("fp32", "bf16"):
        service, _ = demo_service(device, dtype, "off", small)
        service.warm_up()
        # each request runs in this thread, not the service's worker: the profiler records
        # the ops of the thread that started it
        t0 = time.perf_counter()
        with profile(activities=activities) as prof:
            for ex in tasks:
                result = service.plan_in_this_thread(PlanRequest(ex.task, ex.context,
                                                                 method="auto"))
                assert result.success, result.error
        wall_ms = (time.perf_counter() - t0) * 1000 / len(tasks)
        events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]
        ops = [{"op": e.key, "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1000,
                "device_ms": getattr(e, "self_device_time_total",
                                     getattr(e, "self_cuda_time_total", 0)) / 1000}
               for e in events]
        rows.append({"dtype": dtype, "plan_ms": wall_ms, "plans": len(tasks), "ops": ops})
        del service
    return rows


def sdpa_rows(device: str) -> list[dict]:
    """SDPA as eager attention calls it: the demo's heads, a 16-row verify block under a
    boolean mask, a key length new at every call (as a growing context makes it), per dtype
    and backend: ms per call (mean of 16 lengths, synchronized), or why the backend refused.
    A backend that builds a plan per shape (cuDNN's graphs) pays it on every call here."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flash_planner.planning.presets import ModelPreset, asset_path

    target = Path(asset_path(ModelPreset.load("demo").target_path))
    raw = json.loads((target / "config.json").read_text())
    raw = raw.get("text_config", raw)
    heads, kv, dim = (raw["num_attention_heads"], raw["num_key_value_heads"],
                      raw.get("head_dim", raw["hidden_size"] // raw["num_attention_heads"]))
    from flash_planner.engine.models.qwen.layers import attention

    backends = {"default": None, "math": SDPBackend.MATH,
                "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                "engine": "engine"}       # models/layers.attention, as an eager forward calls it
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for name, backend in backends.items():
            times, error = [], None
            for length in range(200, 216):
                q = torch.randn(1, 16, heads, dim, device=device, dtype=dtype)
                k = torch.randn(1, length, kv, dim, device=device, dtype=dtype)
                v = torch.randn(1, length, kv, dim, device=device, dtype=dtype)
                mask = torch.ones(16, length, device=device, dtype=torch.bool).tril(length - 16)
                try:
                    if device == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    if backend == "engine":
                        attention(q, k, v, mask, dim ** -0.5)
                    else:
                        with sdpa_kernel([backend] if backend else list(backends.values())[1:5]):
                            torch.nn.functional.scaled_dot_product_attention(
                                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                attn_mask=mask, enable_gqa=heads != kv)
                    if device == "cuda":
                        torch.cuda.synchronize()
                    times.append((time.perf_counter() - t0) * 1000)
                except RuntimeError as exc:
                    error = str(exc).splitlines()[0][:60]
                    break
            rows.append({"dtype": str(dtype).removeprefix("torch."), "backend": name,
                         "ms": sum(times) / len(times) if times else None, "error": error,
                         "heads": heads, "kv_heads": kv, "head_dim": dim})
    return rows


def print_tables(report: dict) -> None:
    c = report.get("ceilings")
    if c:
        print(f"ceilings: copy {c['copy_gbps']:.0f} GB/s (read + write), {c['matmul_dtype']} "
              f"matmul {c['matmul_n']}^3 {c['matmul_tflops']:.1f} TFLOP/s")
    if report.get("gemm"):
        print(f"weight-only GEMMs (graph ms: device time of the engine's launch, CUDA-graph "
              f"replays over weights beyond L2, and of copy bw from it; eager ms: one launch "
              f"with its host cost; tiled: the M > 16 kernel, counted: the skinny kernel's "
              f"counted configuration, both eager; x bf16: bf16 graph ms / graph ms)\n"
              f"{'shape':<20}{'format':<8}{'rows':>5}{'graph ms':>10}{'eager ms':>10}"
              f"{'tiled':>9}{'counted':>9}{'weight MB':>11}{'of copy bw':>12}{'x bf16':>8}")
        for r in report["gemm"]:
            extra = ("" if "tiled_ms" not in r else
                     f"{r['tiled_ms']:>9.4f}{r['counted_ms']:>9.4f}")
            ratio = f"{r['over_bf16']:>8.2f}" if "over_bf16" in r else ""
            print(f"{r['shape']:<20}{r['format']:<8}{r['rows']:>5}{r['graph_ms']:>10.4f}"
                  f"{r['ms']:>10.4f}{extra:>18}{r['weight_bytes'] / 1e6:>11.2f}"
                  f"{100 * r['of_copy_bw']:>11.1f}%{ratio}")
            for v in r.get("vendor", ()):
                what = (f"unavailable: {v['unavailable']}" if "unavailable" in v else
                        f"{v['graph_ms']:.4f} graph ms, {100 * v['of_copy_bw']:.1f}% of copy "
                        f"bw, {v['graph_ms'] / r['graph_ms']:.2f}x ours, max diff "
                        f"{v['rel_diff']:.1e} of |y|")
                print(f"{'':28}vendor {v['name']} ({v['numerics']}): {what}")
            if "serves" in r:
                print(f"{'':28}--tune chose: {r['serves']} serves this shape at this bucket")
    if report.get("gate_up"):
        print(f"MLP gate + up, {report['gate_up'][0]['i']} x {report['gate_up'][0]['k']} each:"
              f" fused (one GEMM, SwiGLU in its epilogue) against apart (two GEMMs, silu, "
              f"multiply)\n{'format':<8}{'rows':>5}{'fused ms':>10}{'apart ms':>10}"
              f"{'apart/fused':>13}")
        for r in report["gate_up"]:
            print(f"{r['format']:<8}{r['rows']:>5}{r['fused_ms']:>10.4f}{r['apart_ms']:>10.4f}"
                  f"{r['apart_ms'] / r['fused_ms']:>13.2f}")
    if report.get("moe"):
        print(f"MoE grouped GEMMs (random routing; weight MB: the distinct experts chosen; "
              f"graph ms: device time over other routings in turn; eager ms and tiled, the "
              f"M > 16 kernel: one launch)\n{'shape':<16}{'format':<8}{'rows':>5}"
              f"{'graph ms':>10}{'eager ms':>10}{'tiled':>9}{'weight MB':>11}{'of copy bw':>12}")
        for r in report["moe"]:
            print(f"{r['shape']:<16}{r['format']:<8}{r['rows']:>5}{r['graph_ms']:>10.4f}"
                  f"{r['ms']:>10.4f}{r['tiled_ms']:>9.4f}{r['weight_bytes'] / 1e6:>11.2f}"
                  f"{100 * r['of_copy_bw']:>11.1f}%")
    if report.get("slices"):
        print(f"engine slices, 4 layers ({'fp32' if report['small'] else 'bf16'} compute; "
              f"verify = 16 rows with its rollback; GB read per forward, experts at top-k "
              f"per row):\n{'slice':<9}{'weights':<8}{'forward':<8}{'rows':>5}{'ms':>9}"
              f"{'GB':>8}{'of copy bw':>12}{'x decode':>10}")
        for r in report["slices"]:
            print(f"{r['slice']:<9}{r['weights']:<8}{r['forward']:<8}{r['rows']:>5}"
                  f"{r['ms']:>9.3f}{r['gb_per_forward']:>8.3f}{100 * r['of_copy_bw']:>11.1f}%"
                  f"{r['over_decode']:>10.2f}")
    if report.get("demo"):
        print(f"demo through the planner service (greedy; medians; plans equal to fp32 "
              f"eager's):\n{'dtype':<6}{'forward':<10}{'method':<8}{'TTFT ms':>9}{'tok/s':>8}"
              f"{'tok/cyc':>9}{'equal':>7}{'first TTFT':>12}{'next':>8}{'load s':>8}"
              f"{'2nd start s':>13}")
        for r in report["demo"]:
            first = ("" if r["first_ttft_ms"] is None else
                     f"{r['first_ttft_ms']:>12.1f}{r['next_ttft_ms']:>8.1f}")
            print(f"{r['dtype']:<6}{r['forward']:<10}{r['method']:<8}{r['ttft_ms']:>9.1f}"
                  f"{r['tok_s']:>8.0f}{r['tokens_per_cycle']:>9.2f}"
                  f"{r['plans_equal']:>4}/{r['tasks']:<2}{first:>20}{r['load_s']:>8.1f}"
                  f"{r.get('second_load_s', float('nan')):>13.1f}")
    if report.get("profile"):
        for r in report["profile"]:
            print(f"profile, {r['dtype']} eager auto: {r['plan_ms']:.1f} ms a plan over "
                  f"{r['plans']} plans (profiler on); top ops by host time\n"
                  f"  {'op':<48}{'calls':>8}{'self CPU ms':>13}{'device ms':>11}")
            for op in r["ops"]:
                print(f"  {op['op'][:47]:<48}{op['calls']:>8}{op['self_cpu_ms']:>13.2f}"
                      f"{op['device_ms']:>11.2f}")
    if report.get("sdpa"):
        s = report["sdpa"][0]
        print(f"SDPA as eager attention calls it ({s['heads']} heads, {s['kv_heads']} kv, dim "
              f"{s['head_dim']}, 16 rows, boolean mask, a new key length every call):")
        for r in report["sdpa"]:
            got = f"{r['ms']:.3f} ms" if r["ms"] is not None else f"refused: {r['error']}"
            print(f"  {r['dtype']:<9}{r['backend']:<10}{got}")
    if report.get("batch"):
        n = report["batch"][0]["batch"]
        print(f"{n} requests at once against one, the 27B's width (4 layers), slots of one "
              f"batch state\n{'forward':<9}{'rows':>5}{'ms, one':>10}{f'ms, {n}':>10}"
              f"{'aggregate':>11}")
        for r in report["batch"]:
            print(f"{r['forward']:<9}{r['rows']:>5}{r['ms_one']:>10.3f}{r['ms_batch']:>10.3f}"
                  f"{r['aggregate']:>10.2f}x")
    if report.get("vision"):
        import vision

        vision.print_vision(report["vision"])
    if report.get("thor"):
        print(f"Thor line: {THOR_GBPS:.0f} GB/s at the nvfp4 GEMMs' measured fraction "
              f"({100 * report['thor'][0]['fraction']:.0f}%, 1 row)")
        for r in report["thor"]:
            print(f"  {r['model']:<18}{r['gb_per_forward']:>7.2f} GB  {r['ms_per_token']:>8.1f} "
                  f"ms/token  {r['tok_s']:>7.1f} tok/s")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true",
                        help="tiny shapes on a CPU, kernels interpreted (default: off)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(DEFAULT_PARTS),
                        help="which tables (default: all but batch)")
    parser.add_argument("--tune", action="store_true",
                        help="measure the skinny GEMMs' configurations for the gemm part's "
                             "shapes first and use them (cached; CUDA only; default: off)")
    parser.add_argument("--json-out", type=Path, default=None,
                        help="write the report there as JSON, again after every part, so a "
                             "run stopped by a time limit keeps the parts it finished "
                             "(default: print only)")
    parser.add_argument("--slices", nargs="+", choices=SLICES, default=list(SLICES),
                        help="which engine slices the slices part times (default: all)")
    parser.add_argument("--demo-methods", nargs="+", choices=DEMO_METHODS,
                        default=list(DEMO_METHODS),
                        help="the demo part's decoding methods (default: all)")
    parser.add_argument("--demo-forwards", nargs="+", choices=("eager", "compiled"),
                        default=["eager", "compiled"],
                        help="the demo part's forwards (default: both)")
    parser.add_argument("--demo-tasks", type=int, default=12,
                        help="held-out tasks per demo row (default: 12)")
    args = parser.parse_args(argv)
    if args.demo_tasks < 2:
        parser.error("--demo-tasks must be at least 2 (the first request against the next)")
    if args.tune and args.small:
        parser.error("--tune measures on a CUDA GPU; --small runs interpreted on a CPU")
    if not args.small and not torch.cuda.is_available():
        print("bench/gpu.py needs a CUDA GPU (use --small for a CPU smoke run)",
              file=sys.stderr)
        return 2
    device = "cpu" if args.small else "cuda"
    if args.small:   # the kernels themselves, interpreted (auto would pick the references)
        from flash_planner.kernels import dispatch

        dispatch.set_backend("triton")
    t0 = time.perf_counter()
    report: dict = {"device": torch.cuda.get_device_name() if device == "cuda"
                    else "CPU (Triton interpreter)", "small": args.small}
    # interpreted on a CPU a time says nothing: one timed call after the warm-up
    repeats = 1 if args.small else 50

    def part(key: str, rows) -> None:
        report[key] = rows
        report["wall_s"] = time.perf_counter() - t0
        if args.json_out is not None:
            args.json_out.write_text(json.dumps(report, indent=1))

    ceil = ceilings(device, args.small)
    if "ceilings" in args.parts:
        part("ceilings", ceil)
    bw = ceil["copy_gbps"] * 1e9
    if "gemm" in args.parts or "thor" in args.parts:
        part("gemm", gemm_rows(device, args.small, bw, repeats, args.tune))
    if "gemm" in args.parts:
        part("gate_up", gate_up_rows(device, args.small, repeats))
        part("moe", moe_rows(device, args.small, bw, repeats))
    if "thor" in args.parts:
        one = [r["of_copy_bw"] for r in report["gemm"] if r["format"] == "nvfp4"
               and r["rows"] == 1]
        part("thor", thor_rows(max(one) if one else 0.0))
    if "slices" in args.parts:
        part("slices", slice_rows(device, args.small, bw, 3 if args.small else 20,
                                  tuple(args.slices)))
    if "demo" in args.parts:
        part("demo", demo_rows(device, args.small, tuple(args.demo_methods),
                               tuple(args.demo_forwards), args.demo_tasks))
    if "profile" in args.parts:
        part("profile", profile_rows(device, args.small))
        part("sdpa", sdpa_rows(device))
    if "vision" in args.parts:
        import vision

        part("vision", vision.vision_rows(device, args.small))
    if "batch" in args.parts:
        part("batch", batch_rows(device, args.small, 3 if args.small else 20))
    print(f"{report['device']}; wall {time.perf_counter() - t0:.0f} s")
    print_tables(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
