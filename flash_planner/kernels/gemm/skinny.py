"""The skinny GEMM kernel: decode and verify (M <= 16 rows) of every format, 2-D or routed,
split along K.

A decode GEMM reads N x K weights for a handful of rows: its speed is how fast the weights
stream in, so the grid must keep every SM loading. N / BLOCK_N tiles are too few where N is
small against K (the 27B's MLP down: 80 tiles of 64 rows, 132 SMs on an H100), so K is split
too: grid (N tiles, SPLIT, E or 1), each program sums its share of K. The sums meet without a
second launch: each program stores its fp32 partial tile, counts itself in at its tile's
counter (one atomic, acquire-release), and the program that arrives last adds the SPLIT
partials in split order (so the result does not depend on which one arrives last: the same
bits every run, eager or in a CUDA graph), runs the epilogue, stores y and puts the counter
back to 0. Counters therefore rest at zero between launches: the stream's own buffer
(GemmContext.counters) needs no memset.

A K step reads 64 bytes of every weight row, unmasked along the row where the step lies
inside K (EVEN), so the loads can be 16-byte vectors; the inner product runs on tensor cores
(a 16-row tile, padding rows and all) or, for a BLOCK_M of 1-4, as fp32 FMAs (only the
measured table chooses that: configs.py). GATED: the weight holds a gate projection's rows,
then an up projection's; a program decodes both tiles at the same K offsets and writes
silu(gate) * up, so x is read once and y stored once. ROUTED: as in tiled.py, a program whose
rows did not choose its expert exits at once; the partials of (m, j) land where y[m, j] will
(each (m, j) belongs to one expert, so a split's partials never collide); one counter per
(expert, N tile).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..specs import Spec, aligned, launch
from .configs import DECLARED, DECLARED_MOE, RowsConfig, heuristic
from .context import GemmContext
from .formats import DECLARED_ALIGN, DECLARED_INTS, FORMATS
from .tiled import spec_types
from .tiles import NVFP4_UNSCALE, expert_bases, k_step, routed_rows, row_offsets

# constexprs that follow the shape (a tiny test model launches other tiles than the 27B)
SHAPE_CONSTEXPRS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT", "EVEN", "TOPK")


@triton.jit
def silu_mul(gate, up):
    """silu(gate) * up; the sigmoid from exp(-|gate|), which never overflows."""
    e = tl.exp(-tl.abs(gate))
    sigmoid = tl.where(gate >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    return gate * sigmoid * up


@triton.jit
def partial_sum(part, offs, mask, stride, SPLIT: tl.constexpr):
    """The SPLIT partial tiles, `stride` apart, added in split order, read from L2 (.cg:
    never a line an SM's L1 kept)."""
    total = tl.load(part + offs, mask=mask, other=0.0, cache_modifier=".cg")
    for s in tl.static_range(1, SPLIT):
        total += tl.load(part + s * stride + offs, mask=mask, other=0.0, cache_modifier=".cg")
    return total


@triton.jit
def store_rows(out, offs, mask, acc, up, GATED: tl.constexpr):
    if GATED:
        acc = silu_mul(acc, up)
    tl.store(out + offs, acc.to(out.dtype.element_ty), mask=mask)


@triton.jit
def finish(acc, up, out, part, counts, tile, pid_k, offs, mask, tile_elems,
           SPLIT: tl.constexpr, GATED: tl.constexpr):
    """Store y for this program's tile (offs and mask: [BM, BN] into out); split: store the
    partial sums (acc, and up when GATED; `tile_elems` apart) and let the last of the SPLIT
    programs of tile `tile` add them, store y and reset the counter."""
    if SPLIT == 1:
        store_rows(out, offs, mask, acc, up, GATED)
    else:
        halves: tl.constexpr = 2 if GATED else 1
        mine = part + pid_k * halves * tile_elems
        tl.store(mine + offs, acc, mask=mask)
        if GATED:
            tl.store(mine + tile_elems + offs, up, mask=mask)
        tl.debug_barrier()             # every thread's partial stored before the count
        if tl.atomic_add(counts + tile, 1, sem="acq_rel") == SPLIT - 1:
            acc = partial_sum(part, offs, mask, halves * tile_elems, SPLIT)
            if GATED:
                up = partial_sum(part + tile_elems, offs, mask, halves * tile_elems, SPLIT)
            store_rows(out, offs, mask, acc, up, GATED)
            tl.store(counts + tile, 0)


@triton.jit
def _gemm_rows_kernel(x, topk_ids, w, s, z, out, part, counts, M, N, K, topk, stride_xm,
                      stride_xs, i0, i1, i2, steps, FORMAT: tl.constexpr, ROUTED: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      SPLIT: tl.constexpr, TOPK: tl.constexpr, EVEN: tl.constexpr,
                      GATED: tl.constexpr):
    USE_DOT: tl.constexpr = BLOCK_M >= 16
    rm = tl.arange(0, BLOCK_M)
    if ROUTED:
        expert = tl.program_id(2)
        slot, y_row = routed_rows(topk_ids, expert, rm, M, topk, TOPK)
        if tl.max(y_row, axis=0) < 0:                     # no row chose this expert
            return
        rows = y_row >= 0
        x_off = rm[:, None] * stride_xm + slot[:, None] * stride_xs      # x[m, j or 0]
        w, s, z = expert_bases(w, s, z, expert, (2 * N if GATED else N), K, i0, i1, i2,
                               FORMAT)
        tile = expert * tl.num_programs(0) + tl.program_id(0)
    else:
        expert = 0
        rows = rm < M
        y_row = rm
        x_off = rm[:, None] * stride_xm
        tile = tl.program_id(0)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = rn < N
    k_lo = tl.program_id(1) * steps * BLOCK_K     # a multiple of BLOCK_K the compiler can see
    k_hi = tl.minimum(K, k_lo + steps * BLOCK_K)
    w_off, s_off = row_offsets(rn, K, i0, i1, i2, FORMAT)
    u_off, t_off = row_offsets(rn + N, K, i0, i1, i2, FORMAT)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        acc, up = k_step(acc, up, x, x_off, rows, w, s, z, w_off, s_off, u_off, t_off, mn, k0,
                         k_hi, i1, FORMAT, BLOCK_N, BLOCK_K, EVEN, USE_DOT, False,
                         ROUTED and (FORMAT == "nvfp4" or FORMAT == "int4"), GATED)
    if FORMAT == "nvfp4":
        z += expert * (2 if GATED else 1)
        acc = acc * (tl.load(z) * NVFP4_UNSCALE)
        if GATED:
            up = up * (tl.load(z + 1) * NVFP4_UNSCALE)
    finish(acc, up, out, part, counts, tile, tl.program_id(1), y_row[:, None] * N + rn[None, :],
           rows[:, None] & mn[None, :], M * topk * N, SPLIT, GATED)


def rows_gemm(context: GemmContext, fmt: str, x: torch.Tensor, tensors: tuple,
              ints: tuple[int, int, int], n: int, k_align: int, gated: bool,
              config: RowsConfig | None = None, topk_ids: torch.Tensor | None = None,
              experts: int = 1) -> torch.Tensor:
    """y [M, n] for rows x [M <= 16, K], or y [M, k, n] for x [M, S, K] routed by int32
    topk_ids [M, k] to `experts` stacked experts (operands checked by the caller); n the
    output width (I when gated). `config` overrides the context's choice."""
    routed = topk_ids is not None
    m, k = x.shape[0], x.shape[-1]
    topk = topk_ids.shape[1] if routed else 1
    fp32 = x.dtype == torch.float32
    if config is None and routed:      # counted: the experts a step reads change every step
        config = heuristic(fmt, n * min(experts, m * topk), k, m, context.sms, k_align, gated,
                           fp32)
    elif config is None:
        config = context.choose(fmt, n, k, m, k_align, gated, fp32)
    if config.block_m < m:
        raise ValueError(f"{fmt} skinny GEMM: BLOCK_M {config.block_m} < {m} rows")
    tiles, steps, split = config.grid(n, k, experts)
    out = torch.empty(m, *(topk,) * routed, n, dtype=x.dtype, device=x.device)
    w, s, z = FORMATS[fmt].slots(tensors)
    args = dict(x=x, topk_ids=topk_ids if routed else out, w=w, s=s, z=z, out=out,
                part=workspace(split, 2 if gated else 1, m * topk, n, x.device),
                counts=context.counters(experts * tiles), M=m, N=n, K=k, topk=topk,
                stride_xm=x.stride(0), stride_xs=x.stride(1) if routed and x.shape[1] > 1 else 0,
                i0=ints[0], i1=ints[1], i2=ints[2], steps=steps)
    meta = {"FORMAT": fmt, "ROUTED": routed, **config.meta(), "SPLIT": split,
            "TOPK": 1 << (topk - 1).bit_length(), "EVEN": k % config.block_k == 0,
            "GATED": gated}
    launch(_gemm_rows_kernel, (tiles, split, experts), args, meta)
    return out


def workspace(split: int, halves: int, m: int, n: int, device: torch.device) -> torch.Tensor:
    """Room for the partial tiles: [split, halves, m, n] float32 (a 1-element dummy when the
    kernel does not split, so every launch has the same argument types)."""
    if split == 1:
        return torch.empty(1, dtype=torch.float32, device=device)
    return torch.empty(split, halves, m, n, dtype=torch.float32, device=device)


def _specs() -> tuple[Spec, ...]:
    """The declared shapes (configs.DECLARED: 2-D formats; DECLARED_MOE: every format
    routed) at one row (FMA path and tensor cores) and 16, each distinct configuration once."""
    shapes = [(fmt, model, act, proj, n, k, sms, 1, 1) for fmt in ("fp8", "nvfp4", "int4")
              for model, act, proj, n, k, sms in DECLARED]
    shapes += [(fmt, model, act, proj, n, k, sms, experts, topk) for fmt in FORMATS
               for model, act, proj, n, k, experts, topk, sms in DECLARED_MOE]
    out: dict[tuple, Spec] = {}
    for fmt, model, act, proj, n, k, sms, experts, topk in shapes:
        routed = experts > 1
        gated = proj in ("gate_up", "up")
        for rows, fma in ((1, True), (1, False), (16, False)):
            wide = n * min(experts, rows * topk)
            config = heuristic(fmt, wide, k, rows, sms, DECLARED_ALIGN[fmt], gated,
                               act == "*fp32", fma)
            even = k % config.block_k == 0
            meta = {"FORMAT": fmt, "ROUTED": routed, **config.meta(), "TOPK":
                    1 << (topk - 1).bit_length(), "EVEN": even, "GATED": gated}
            types = spec_types(_gemm_rows_kernel, fmt, act, act, routed)
            slots = topk if routed and proj == "down" else 1       # x [M, S, K]: S
            values = dict(zip(("N", "K", "stride_xm", "stride_xs", "i0", "i1", "i2", "steps"),
                              (n, k, slots * k, k if slots > 1 else 0, *DECLARED_INTS[fmt](n, k),
                               config.grid(n, k)[1])))
            label = (f"{fmt} rows {'moe ' * routed}{model} {act[1:]} "
                     f"{'gate_up' if gated else proj} M{rows} {sms} SMs")
            key = (fmt, routed, act, config, even, gated, meta["TOPK"])
            out.setdefault(key, Spec.from_meta(_gemm_rows_kernel, label, types, meta,
                                               shape_constexprs=SHAPE_CONSTEXPRS,
                                               aligned=aligned(types, values)))
    return tuple(out.values())


SPECS = _specs()
