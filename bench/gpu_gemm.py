"""bench/gpu.py's weight-only GEMM parts: the engine's layouts against bf16 and the vendor
GEMMs at the 27B's and 35B-A3B's shapes, the fused gate/up against two GEMMs, the routed
(MoE) GEMMs; the ceilings they are measured against."""

from __future__ import annotations

import statistics

import torch
from gpu_common import (
    FORMATS,
    GRAPH_LAUNCHES,
    ROTATE_BYTES,
    ROWS,
    SHAPES,
    copy_bandwidth,
    graph_ms,
    timed_ms,
)
from slices import expert_stack, quantize_layout


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


