"""The tiled GEMM kernel: prefill chunks (M > 16 rows) of every format, 2-D or routed.

Grid (M tiles, N tiles, E or 1): each program walks K in BLOCK_K steps, decodes its
[BLOCK_N, BLOCK_K] weight tile in registers once for its BLOCK_M rows and accumulates in
float32 (tiles.weight_dot: the dot sees exact decoded values; a block or group scale,
constant over a step, multiplies the step's partial sum; nvfp4's global scale the total).
Offsets are int32 (the launchers check the sizes): 64-bit offset tiles cost registers every
program keeps.

ROUTED (experts): program (i, n, e) loads the ids of its rows and exits at once when none
chose expert e (most programs at decode sizes: a row chooses 8 of Qwen3.6-35B-A3B's 256);
otherwise each row that chose e reads x[m, j or 0], and y[m, j] is stored for those rows
only, so a chosen expert's weights are read once per block of rows. No host sync: the grid
covers all E (a compacted list of the chosen ones would need its length on the host). The
prologue is the kernel's own, before the exit: a shared helper computing the N tile first
took the bf16 float and fp8 experts from 40 and 56 registers to 74 and 87.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..specs import Spec, aligned, launch
from .configs import DECLARED, DECLARED_MOE, tiled_meta
from .formats import DECLARED_INTS, FORMATS, SLOT_TYPES
from .tiles import NVFP4_UNSCALE, expert_bases, k_step, routed_rows, row_offsets


@triton.jit
def _gemm_tiles_kernel(x, topk_ids, w, s, z, out, M, N, K, topk, stride_xm, stride_xs, i0, i1,
                       i2, FORMAT: tl.constexpr, ROUTED: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TOPK: tl.constexpr):
    BITS4: tl.constexpr = FORMAT == "nvfp4" or FORMAT == "int4"
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    if ROUTED:
        expert = tl.program_id(2)
        slot, y_row = routed_rows(topk_ids, expert, rm, M, topk, TOPK)
        if tl.max(y_row, axis=0) < 0:                     # no row of the block chose it
            return
        rows = y_row >= 0
        x_off = rm[:, None] * stride_xm + slot[:, None] * stride_xs      # x[m, j or 0]
        w, s, z = expert_bases(w, s, z, expert, N, K, i0, i1, i2, FORMAT)
    else:
        expert = 0
        rows = rm < M
        y_row = rm
        x_off = rm[:, None] * stride_xm
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = rn < N
    w_off, s_off = row_offsets(rn, K, i0, i1, i2, FORMAT)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        acc, _ = k_step(acc, acc, x, x_off, rows, w, s, z, w_off, s_off, w_off, s_off, mn, k0,
                        K, i1, FORMAT, BLOCK_N, BLOCK_K, False, True, True, BITS4, False)
    if FORMAT == "nvfp4":
        # each row's global scale: the second one from row i2 on (a stacked gate and up
        # projection's up rows; i2 = N for a weight with one), an expert's 1 or 2 of them
        z += expert * tl.where(i2 < N, 2, 1) + (rn >= i2).to(tl.int32)
        acc = acc * (tl.load(z, mask=mn, other=0.0) * NVFP4_UNSCALE)[None, :]
    dst = out + y_row[:, None] * N + rn[None, :]
    tl.store(dst, acc.to(out.dtype.element_ty), mask=rows[:, None] & mn[None, :])


def tiled_gemm(fmt: str, x: torch.Tensor, tensors: tuple, ints: tuple[int, int, int],
               n: int, fp32_out: bool = False, topk_ids: torch.Tensor | None = None,
               experts: int = 1) -> torch.Tensor:
    """y of the weight's n rows for rows x [M, K] (2-D), or x [M, S, K] routed by int32
    topk_ids [M, k] to `experts` stacked experts (y [M, k, n]); fp32_out: sums stored
    unrounded (a fused gate and up projection applies its activation to them)."""
    routed = topk_ids is not None
    m, k = x.shape[0], x.shape[-1]
    topk = topk_ids.shape[1] if routed else 1
    out = torch.empty(m, *(topk,) * routed, n, dtype=torch.float32 if fp32_out else x.dtype,
                      device=x.device)
    meta = tiled_meta(fmt, m, routed, topk)
    w, s, z = FORMATS[fmt].slots(tensors)
    args = dict(x=x, topk_ids=topk_ids if routed else out, w=w, s=s, z=z, out=out, M=m, N=n,
                K=k, topk=topk, stride_xm=x.stride(0),
                stride_xs=x.stride(1) if routed and x.shape[1] > 1 else 0,
                i0=ints[0], i1=ints[1], i2=ints[2])
    grid = (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]), experts)
    launch(_gemm_tiles_kernel, grid, args, meta)
    return out


def spec_types(kernel, fmt: str, act: str, out: str, routed: bool) -> dict[str, str]:
    """A specialization's argument types, in `kernel`'s order (2-D launches pass `out` as
    the ids they do not read)."""
    slots = dict(zip(("w", "s", "z"), (t or act for t in SLOT_TYPES[fmt])))
    types = {"x": act, "topk_ids": "*i32" if routed else out, **slots, "out": out,
             "part": "*fp32", "counts": "*i32",
             **dict.fromkeys(("M", "N", "K", "topk", "stride_xm", "stride_xs", "i0", "i1",
                              "i2", "steps"), "i32")}
    return {name: types[name] for name in kernel.arg_names if name in types}


def _specs() -> tuple[Spec, ...]:
    """Prefill chunks (M > 16) at the declared shapes: the 27B's layers with bf16 rows (and
    a fused gate/up projection's fp32 sums) and the demo's in fp32; the experts of
    configs.DECLARED_MOE with bf16 rows (fp32 sums too) and the demo MoE in fp32. The
    shapes are runtime integers: a spec per format, dtype and ids tile."""
    shapes = [(f"{fmt} {model}", fmt, act, n, k, 1, False) for fmt in ("fp8", "nvfp4", "int4")
              for model, act, proj, n, k, _ in DECLARED[:2] + DECLARED[3:4]]
    shapes += [(f"{fmt} moe {model}", fmt, act, n, k, topk, True) for fmt in FORMATS
               for model, act, proj, n, k, _, topk, _ in DECLARED_MOE[::2]]
    out: dict[tuple, Spec] = {}
    for label, fmt, act, n, k, topk, routed in shapes:
        for sums in (("", "*fp32") if act == "*bf16" else ("",)):
            types = spec_types(_gemm_tiles_kernel, fmt, act, sums or act, routed)
            values = dict(zip(("N", "K", "stride_xm", "i0", "i1", "i2"),
                              (n, k, k, *DECLARED_INTS[fmt](n, k))))
            meta = tiled_meta(fmt, 64, routed, topk)
            key = (fmt, act, sums, routed, meta["TOPK"])
            out.setdefault(key, Spec.from_meta(
                _gemm_tiles_kernel, f"{label} {act[1:]} M>16{' -> fp32' if sums else ''}",
                types, meta, shape_constexprs=("TOPK",), aligned=aligned(types, values)))
    return tuple(out.values())


SPECS = _specs()
