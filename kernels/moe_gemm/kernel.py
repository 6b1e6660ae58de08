"""Triton mixture-of-experts grouped GEMM: y[m, j] = x[m, j or 0] @ W[topk_ids[m, j]].T.

Contract and layouts as in reference.py: x [M, S, K] (S == 1: gate and up projections, every
chosen expert reads the row; S == k: the down projection, slot j reads x[m, j]), topk_ids
[M, k], expert weights stacked E first in the 2-D GEMMs' layouts, y [M, k, N] in x's dtype.

Grid (M tiles, N tiles, E). Program (i, n, e) loads the [BLOCK_M, k] ids of its rows and exits
at once when none chose expert e: most programs at decode and verify sizes (a row chooses 8 of
Qwen3.6-35B-A3B's 256 experts). Otherwise each row that chose e finds its slot j, loads
x[m, j or 0] (the other rows read as 0), and the program walks K decoding each
[BLOCK_N, BLOCK_K] weight tile of expert e once for all those rows, with the 2-D kernels'
tile decoders (kernels/weight_tiles.py: `fp8_tile`, `nvfp4_tile`, `int4_tile`) and
`dot_xwt`, and stores y[m, j, n] for those rows only: a chosen expert's weights are read
once per block of rows, whatever the number of rows that chose it. Tiles are the tiled 2-D
GEMMs' (`gemm_meta`): 16 rows up to M = 16, 64 for prefill chunks (NVFP4 steps K by 32
here: NVFP4_BLOCK_K).

No host sync: the grid covers all E experts (a compacted list of the chosen ones would need
its length on the host) and the idle programs cost one ids tile each. The launcher checks the
id values (range, distinct per row) on CPU tensors only: on CUDA that is a host sync, and an
id out of range leaves its y[m, j] unwritten. Tile offsets are int32 (checked per expert);
each expert's base offset is one int64 scalar, so the stacked weights may pass 2^31 elements.

Each kernel repeats its prologue (ids tile, early exit, then the N tile and x offsets) on
purpose: one shared helper computing the N tile and offsets before the exit took the bf16
M <= 16 float and fp8 kernels from 40 and 56 registers to 74 and 87 (kernels/report.py).

Float weights are x's dtype: bf16 and fp16 ones are exact in themselves and go through
`dot_xwt`; fp32 ones (the fp32 demo) through tl.dot in tf32x3 (three tf32 products, about
fp32's precision, on tensor cores).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..fp8_gemm.kernel import BLOCK_K as FP8_BLOCK_K
from ..fp8_gemm.kernel import BLOCK_N, gemm_meta
from ..gate_up import swiglu_halves
from ..gemm_configs import skinny
from ..int4_gemm.kernel import BLOCK_K as INT4_BLOCK_K
from ..specs import Spec, aligned, launch
from ..weight_tiles import check_operand, dot_xwt, fp8_tile, int4_tile, nvfp4_tile
from .reference import check_float, check_fp8, check_int4, check_nvfp4
from .skinny import moe_rows
from .tiles import dot_float, routed_rows, store_chosen

FLOAT_BLOCK_K = 32
# NVFP4 steps K by 32 here (16 bytes of each packed row, 2 scales), not the 2-D kernel's 64:
# with 64 the fp32 demo's 16-row tiles took 128 registers and spilled (kernels/report.py).
NVFP4_BLOCK_K = 32


@triton.jit
def _moe_gemm_kernel(x, topk_ids, weight, out, M, N, K, topk, stride_xm, stride_xs,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     TOPK: tl.constexpr):
    expert = tl.program_id(2)
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    slot, y_row = routed_rows(topk_ids, expert, rm, M, topk, TOPK)
    if tl.max(y_row, axis=0) < 0:                         # no row of the block chose it
        return
    chosen = y_row >= 0
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = rn < N
    x_off = rm[:, None] * stride_xm + slot[:, None] * stride_xs      # x[m, j or 0]
    weight += expert.to(tl.int64) * N * K
    w_off = rn[:, None] * K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = tl.arange(0, BLOCK_K)
        mk = rk < K - k0
        xt = tl.load(x + k0 + x_off + rk[None, :], mask=chosen[:, None] & mk[None, :],
                     other=0.0)
        w = tl.load(weight + k0 + w_off + rk[None, :], mask=mn[:, None] & mk[None, :],
                    other=0.0)
        acc += dot_float(xt, w)
    store_chosen(out, acc, y_row, rn, N)


@triton.jit
def _moe_fp8_kernel(x, topk_ids, weight, scale, out, M, N, K, topk, stride_xm, stride_xs,
                    block_n, block_k, scale_cols, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TOPK: tl.constexpr):
    expert = tl.program_id(2)
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    slot, y_row = routed_rows(topk_ids, expert, rm, M, topk, TOPK)
    if tl.max(y_row, axis=0) < 0:
        return
    chosen = y_row >= 0
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = rn < N
    x_off = rm[:, None] * stride_xm + slot[:, None] * stride_xs
    weight += expert.to(tl.int64) * N * K
    scale += expert.to(tl.int64) * tl.cdiv(N, block_n) * scale_cols
    w_off = rn[:, None] * K
    s_rows = scale + (rn // block_n) * scale_cols
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = tl.arange(0, BLOCK_K)
        mk = rk < K - k0
        xt = tl.load(x + k0 + x_off + rk[None, :], mask=chosen[:, None] & mk[None, :],
                     other=0.0)
        w, s = fp8_tile(weight, w_off, s_rows, mn, mk, k0, block_k, BLOCK_K)
        acc += dot_xwt(xt, w) * s[None, :]
    store_chosen(out, acc, y_row, rn, N)


@triton.jit
def _moe_nvfp4_kernel(x, topk_ids, packed, scale, global_scale, out, M, N, K, topk,
                      stride_xm, stride_xs, gs_cols, half, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TOPK: tl.constexpr):
    HALF: tl.constexpr = BLOCK_K // 2
    expert = tl.program_id(2)
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    slot, y_row = routed_rows(topk_ids, expert, rm, M, topk, TOPK)
    if tl.max(y_row, axis=0) < 0:
        return
    chosen = y_row >= 0
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = rn < N
    x_off = rm[:, None] * stride_xm + slot[:, None] * stride_xs
    packed += expert.to(tl.int64) * N * (K // 2)
    scale += expert.to(tl.int64) * N * (K // 16)
    p_off = rn[:, None] * (K // 2)
    s_off = rn[:, None] * (K // 16)
    rj = tl.arange(0, HALF)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w_even, w_odd = nvfp4_tile(packed, p_off, scale, s_off, mn, k0, K, BLOCK_N, BLOCK_K,
                                   False)
        xk = x + k0 + x_off + 2 * rj[None, :]                         # x at k0 + 2j
        xm = chosen[:, None] & (rj < (K - k0) // 2)[None, :]
        acc += dot_xwt(tl.load(xk, mask=xm, other=0.0), w_even)
        acc += dot_xwt(tl.load(xk + 1, mask=xm, other=0.0), w_odd)
    # an expert's global scale per row: gs_cols of them, the second from row `half` on (a
    # gated stack's up rows; half = N when the expert has one)
    gs = tl.load(global_scale + expert * gs_cols + (rn >= half).to(tl.int32), mask=mn,
                 other=0.0)
    acc = acc * gs[None, :]
    store_chosen(out, acc, y_row, rn, N)


@triton.jit
def _moe_int4_kernel(x, topk_ids, packed, scale, zero, out, M, N, K, topk, stride_xm,
                     stride_xs, packed_cols, group, groups, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TOPK: tl.constexpr):
    HALF: tl.constexpr = BLOCK_K // 2
    expert = tl.program_id(2)
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    slot, y_row = routed_rows(topk_ids, expert, rm, M, topk, TOPK)
    if tl.max(y_row, axis=0) < 0:
        return
    chosen = y_row >= 0
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = rn < N
    x_off = rm[:, None] * stride_xm + slot[:, None] * stride_xs
    packed += expert.to(tl.int64) * N * packed_cols
    scale += expert.to(tl.int64) * N * groups
    zero += expert.to(tl.int64) * N * groups
    p_off = rn[:, None] * packed_cols
    g_rows = rn * groups
    rj = tl.arange(0, HALF)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        even = 2 * rj < K - k0                      # k0 + 2j < K: byte j holds a value
        odd = 2 * rj + 1 < K - k0                   # its high nibble too (not past odd K)
        w_even, w_odd, s = int4_tile(packed, p_off, scale, zero, g_rows, mn, even, k0, group,
                                     BLOCK_K)
        xk = x + k0 + x_off + 2 * rj[None, :]
        part = dot_xwt(tl.load(xk, mask=chosen[:, None] & even[None, :], other=0.0), w_even)
        part += dot_xwt(tl.load(xk + 1, mask=chosen[:, None] & odd[None, :], other=0.0), w_odd)
        acc += part * s[None, :]
    store_chosen(out, acc, y_row, rn, N)


def _run(op: str, kernel, x: torch.Tensor, topk_ids: torch.Tensor, experts: int, n: int,
         weights: dict[str, torch.Tensor], scalars: dict[str, int], block_k: int,
         rows_kernel: tuple[str, dict[str, int], int], gated: bool):
    """y [M, k, N] (gated: silu(gate) * up, [M, k, N / 2]) from `kernel` over (M tiles,
    N tiles, E), or up to 16 rows from skinny.py's kernel (`rows_kernel`: its format, integer
    arguments and K alignment), once the operands' dtypes and shapes are checked: here their
    memory (contiguous, on x's device) and offset sizes."""
    ids = topk_ids.to(torch.int32).contiguous()                      # a no-op from int32
    for name, tensor in {"topk_ids": ids, **weights}.items():
        check_operand(op, name, tensor, tensor.dtype, tensor.shape, x.device)
    if x.stride(2) != 1:
        x = x.contiguous()
    m, s, k = x.shape
    topk = ids.shape[1]
    width = n // 2 if gated else n
    if m * topk * n == 0:
        return torch.empty(m, topk, width, dtype=x.dtype, device=x.device)
    x_span = sum((size - 1) * stride for size, stride in zip(x.shape, x.stride())) + 1
    per_expert = next(iter(weights.values())).numel() // max(experts, 1)
    if max(x_span, per_expert, m * topk * n) >= 2**31:
        raise ValueError(f"{op}: x, one expert's weight or the output span 2^31 elements or "
                         "more")
    if skinny(m):
        fmt, ints, k_align = rows_kernel
        return moe_rows(fmt, x, ids, experts, width, weights, ints, k_align, gated=gated)
    # a prefill chunk: the tiled kernel over every row; a gated stack's sums stay float32 for
    # the activation
    out = torch.empty(m, topk, n, dtype=torch.float32 if gated else x.dtype, device=x.device)
    options = meta(m, topk, block_k)
    args = dict(x=x, topk_ids=ids, **weights, out=out, M=m, N=n, K=k, topk=topk,
                stride_xm=x.stride(0), stride_xs=x.stride(1) if s > 1 else 0, **scalars)
    grid = (triton.cdiv(m, options["BLOCK_M"]), triton.cdiv(n, BLOCK_N), experts)
    launch(kernel, grid, args, options)
    return swiglu_halves(out).to(x.dtype) if gated else out


def moe_gemm(x: torch.Tensor, topk_ids: torch.Tensor, weight: torch.Tensor,
             gated: bool = False) -> torch.Tensor:
    """Same contract as the reference: x [M, S, K] -> y [M, k, N]."""
    e, n, _ = check_float("moe_gemm", x, topk_ids, weight, values=not x.is_cuda, gated=gated)
    return _run("moe_gemm", _moe_gemm_kernel, x, topk_ids, e, n, {"weight": weight}, {},
                FLOAT_BLOCK_K, ("float", {}, 16), gated)


def moe_fp8_gemm(x: torch.Tensor, topk_ids: torch.Tensor, weight: torch.Tensor,
                 scale: torch.Tensor, block_n: int, block_k: int, gated: bool = False
                 ) -> torch.Tensor:
    """Same contract as the reference: x [M, S, K] -> y [M, k, N]."""
    op = "moe_fp8_gemm"
    e, n, _ = check_fp8(op, x, topk_ids, weight, scale, block_n, block_k, values=not x.is_cuda,
                        gated=gated)
    if block_k % FP8_BLOCK_K:
        raise ValueError(f"{op}: block_k must be a multiple of {FP8_BLOCK_K} (the kernel's K "
                         f"tile), got {block_k}")
    ints = {"block_n": block_n, "block_k": block_k, "scale_cols": scale.shape[2]}
    return _run(op, _moe_fp8_kernel, x, topk_ids, e, n, {"weight": weight, "scale": scale},
                ints, FP8_BLOCK_K, ("fp8", ints, block_k), gated)


def moe_nvfp4_gemm(x: torch.Tensor, topk_ids: torch.Tensor, packed: torch.Tensor,
                   scale: torch.Tensor, global_scale: torch.Tensor, gated: bool = False
                   ) -> torch.Tensor:
    """Same contract as the reference: x [M, S, K] -> y [M, k, N]."""
    op = "moe_nvfp4_gemm"
    e, n, _ = check_nvfp4(op, x, topk_ids, packed, scale, global_scale, values=not x.is_cuda,
                          gated=gated)
    weights = {"packed": packed, "scale": scale, "global_scale": global_scale}
    ints = {"stride_p": packed.shape[2], "stride_s": scale.shape[2]}
    scales = {"gs_cols": 2 if gated else 1, "half": n // 2 if gated else n}
    return _run(op, _moe_nvfp4_kernel, x, topk_ids, e, n, weights, scales, NVFP4_BLOCK_K,
                ("nvfp4", ints, 16), gated)


def moe_int4_gemm(x: torch.Tensor, topk_ids: torch.Tensor, packed: torch.Tensor,
                  scale: torch.Tensor, zero: torch.Tensor, group: int, gated: bool = False
                  ) -> torch.Tensor:
    """Same contract as the reference: x [M, S, K] -> y [M, k, N]."""
    op = "moe_int4_gemm"
    e, n, _ = check_int4(op, x, topk_ids, packed, scale, zero, group, values=not x.is_cuda,
                         gated=gated)
    if group % INT4_BLOCK_K:
        raise ValueError(f"{op}: group must be a multiple of {INT4_BLOCK_K} (the kernel's K "
                         f"tile), got {group}")
    weights = {"packed": packed, "scale": scale, "zero": zero}
    scalars = {"packed_cols": packed.shape[2], "group": group, "groups": scale.shape[2]}
    return _run(op, _moe_int4_kernel, x, topk_ids, e, n, weights, scalars, INT4_BLOCK_K,
                ("int4", scalars, group), gated)


def meta(m: int, topk: int, block_k: int) -> dict:
    """The 2-D GEMMs' tiles and launch options, and the ids tile's width (k to a power of 2)."""
    return {**gemm_meta(m, block_k), "TOPK": triton.next_power_of_2(topk)}


INTS = ("M", "N", "K", "topk", "stride_xm", "stride_xs")
# format -> (kernel, its weight operands' types (None: x's), its other int arguments, K step)
FORMATS = {
    "float": (_moe_gemm_kernel, {"weight": None}, (), FLOAT_BLOCK_K),
    "fp8": (_moe_fp8_kernel, {"weight": "*u8", "scale": "*fp32"},
            ("block_n", "block_k", "scale_cols"), FP8_BLOCK_K),
    "nvfp4": (_moe_nvfp4_kernel, {"packed": "*u8", "scale": "*u8", "global_scale": "*fp32"},
              ("gs_cols", "half"), NVFP4_BLOCK_K),
    "int4": (_moe_int4_kernel, {"packed": "*u8", "scale": "*fp32", "zero": "*u8"},
             ("packed_cols", "group", "groups"), INT4_BLOCK_K),
}


def _spec(fmt: str, model: str, act: str, topk: int, m: int, out: str = "") -> Spec:
    kernel, weights, ints, block_k = FORMATS[fmt]
    types = {"x": act, "topk_ids": "*i32", **{k: v or act for k, v in weights.items()},
             "out": out or act, **dict.fromkeys(INTS + ints, "i32")}
    label = f"{fmt} {model} {act[1:]} M{'<=16' if m <= 16 else '>16'}{' -> fp32' if out else ''}"
    return Spec.from_meta(kernel, label, types, meta(m, topk, block_k), per_cycle=m <= 16,
                          shape_constexprs=("TOPK",), aligned=aligned(types))


# Qwen3.6-35B-A3B's experts (hidden 2048, moe_intermediate_size 512, 256 experts, top 8) with
# bf16 activations on Thor, in each format (float bf16, FP8 128 x 128 blocks, NVFP4, int4
# group 128); gate/up (K 2048 -> N 512, S = 1) and down (K 512 -> N 2048, S = k) are one
# specialization (the shapes are runtime ints). The demo-sized fp32 variant (8 experts, top
# 2) is what the CPU tests launch; Qwen3.8-Flash-Next's top 10 of 512 experts is the ids tile
# of 16. Prefill chunks (M > 16) only: up to 16 rows (decode and verify blocks) run
# skinny.py's kernels. A gated stack's prefill keeps the 35B-A3B's sums in fp32 (-> fp32).
SPECS = tuple(_spec(fmt, model, act, topk, 64, out) for fmt in FORMATS
              for model, act, topk, out in (("35B-A3B", "*bf16", 8, ""), ("demo", "*fp32", 2, ""),
                                            ("35B-A3B", "*bf16", 8, "*fp32"),
                                            ("Flash-Next", "*bf16", 10, "")))
