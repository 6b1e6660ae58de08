"""Triton y = x @ W.T over FP8 e4m3 weights with one float32 scale per (block_n x block_k).

Layout as in reference.py: x [..., K] (fp32, bf16 or fp16; leading dims flattened to M rows),
`weight` uint8 [N, K] of e4m3 bit patterns, `scale` float32 [ceil(N / block_n),
ceil(K / block_k)], a multiplier; y [..., N] in x's dtype. Grid (M tiles, N tiles): each
program walks K in BLOCK_K steps, decodes its [BLOCK_N, BLOCK_K] weight tile in registers and
accumulates in float32 with tl.dot. The tile sizes are fixed (not the model's N or K); only
BLOCK_M follows M: 16 rows for decode and verify blocks (the least tl.dot takes), 64 for
prefill chunks, where 16-row tiles would decode every weight tile M / 16 times.

The dot sees the weights unscaled: e4m3 values are exact in bf16 and fp16, so the
tensor-core products are exact and the block scale, constant over a K tile (block_k is a
multiple of BLOCK_K), multiplies the partial sum. Offsets are int32 (the launcher checks the
sizes): 64-bit offset tiles cost registers every program keeps. The tile decode and the
dot are kernels/weight_tiles.py's, shared with the skinny and mixture-of-experts kernels.
Up to 16 rows (decode, verify) the launcher hands over to skinny.py's split-K kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..specs import Spec, aligned, launch
from ..weight_tiles import by_rows, check_operand, dot_xwt, flatten_rows, fp8_tile, int32_sizes
from .skinny import fp8_rows

# Tiles and warps, from kernels/report.py: 64 x 64 weight tiles with 4 warps took 212-255
# registers and spilled in the 64-row prefill tiles when the report compiled without Triton's
# 16-byte alignment specialization; K steps of 32 with 8 warps hold 47-142 registers and no
# stack across the three formats, compiled as launched (aligned at the model shapes).
BLOCK_N = 64
BLOCK_K = 32
NUM_WARPS = 8


@triton.jit
def _fp8_gemm_kernel(x, weight, scale, out, M, N, K, stride_xm, block_n, block_k, scale_cols,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mm = rm < M
    mn = rn < N
    x_off = rm[:, None] * stride_xm
    w_off = rn[:, None] * K
    s_rows = scale + (rn // block_n) * scale_cols
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = tl.arange(0, BLOCK_K)
        mk = rk < K - k0
        xt = tl.load(x + k0 + x_off + rk[None, :], mask=mm[:, None] & mk[None, :], other=0.0)
        w, s = fp8_tile(weight, w_off, s_rows, mn, mk, k0, block_k, BLOCK_K)
        acc += dot_xwt(xt, w) * s[None, :]
    dst = out + rm[:, None] * N + rn[None, :]
    tl.store(dst, acc.to(out.dtype.element_ty), mask=mm[:, None] & mn[None, :])


def _operands(op: str, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
              block_n: int, block_k: int, halves: int) -> torch.Tensor:
    """x's rows [M, K], once every operand is checked (`halves` weights stacked)."""
    rows = flatten_rows(op, x)
    if weight.dim() != 2 or weight.shape[0] % halves:
        what = "[2 I, K] (gate rows, then up rows)" if halves == 2 else "[N, K]"
        raise ValueError(f"{op}: weight must be uint8 {what}, got {tuple(weight.shape)}")
    n, k = weight.shape
    check_operand(op, "weight", weight, torch.uint8, (n, rows.shape[1]), x.device)
    if block_n < 1 or block_k < 1 or block_k % BLOCK_K:
        raise ValueError(f"{op}: block_n must be >= 1 and block_k a multiple of {BLOCK_K} "
                         f"(the kernel's K tile), got ({block_n}, {block_k})")
    if halves == 2 and (n // 2) % block_n:
        raise ValueError(f"{op}: I = {n // 2} rows per half must be a multiple of block_n "
                         f"{block_n} (no scale block may straddle gate and up)")
    check_operand(op, "scale", scale, torch.float32,
                  (triton.cdiv(n, block_n), triton.cdiv(k, block_k)), x.device)
    int32_sizes(op, rows, weight, n)
    return rows


def tiled_gemm(rows: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int,
               block_k: int, fp32_out: bool = False) -> torch.Tensor:
    """The tiled kernel; fp32_out: sums stored unrounded (the fused projection's prefill
    applies its activation to them)."""
    m, k = rows.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=torch.float32 if fp32_out else rows.dtype,
                      device=rows.device)
    options = meta(m)
    args = dict(x=rows, weight=weight, scale=scale, out=out, M=m, N=n, K=k,
                stride_xm=rows.stride(0), block_n=block_n, block_k=block_k,
                scale_cols=scale.shape[1])
    grid = (triton.cdiv(m, options["BLOCK_M"]), triton.cdiv(n, BLOCK_N))
    launch(_fp8_gemm_kernel, grid, args, options)
    return out


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int,
             block_k: int) -> torch.Tensor:
    """Same contract as the reference: x [..., K] -> [..., N]."""
    rows = _operands("fp8_gemm", x, weight, scale, block_n, block_k, 1)
    return by_rows(x, rows, weight.shape[0],
                   lambda: fp8_rows(rows, weight, scale, block_n, block_k),
                   lambda: tiled_gemm(rows, weight, scale, block_n, block_k), False)


def fp8_gate_up(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int,
                block_k: int) -> torch.Tensor:
    """Same contract as the reference: x [..., K] -> silu(x @ gate.T) * (x @ up.T) [..., I]."""
    rows = _operands("fp8_gate_up", x, weight, scale, block_n, block_k, 2)
    return by_rows(x, rows, weight.shape[0] // 2,
                   lambda: fp8_rows(rows, weight, scale, block_n, block_k, gated=True),
                   lambda: tiled_gemm(rows, weight, scale, block_n, block_k, fp32_out=True),
                   True)


def gemm_meta(m: int, block_k: int) -> dict:
    """Constexprs and launch options of the three GEMMs: fixed N and K tiles; 16 rows up to
    M = 16, else 64."""
    return {"BLOCK_M": 16 if m <= 16 else 64, "BLOCK_N": BLOCK_N, "BLOCK_K": block_k,
            "num_warps": NUM_WARPS, "num_stages": 3}


def meta(m: int) -> dict:
    return gemm_meta(m, BLOCK_K)


def _spec(model: str, act: str, out: str = "") -> Spec:
    types = {"x": act, "weight": "*u8", "scale": "*fp32", "out": out or act,
             **dict.fromkeys(("M", "N", "K", "stride_xm", "block_n", "block_k", "scale_cols"),
                             "i32")}
    label = f"fp8 {model} {act[1:]} M>16{' -> fp32' if out else ''}"
    return Spec.from_meta(_fp8_gemm_kernel, label, types, meta(64), aligned=aligned(types))


# Qwen3.6-27B's FP8 layers (q/k/v/o, GDN in_proj_qkv/z/out_proj, MLP: K 5120 to 17408, block
# scales 128 x 128) with bf16 activations on Thor; the demo (hidden 192, MLP 512) in fp32. The
# tiles are the same at every shape: a spec per activation dtype, for prefill chunks (M > 16;
# up to 16 rows run skinny.py's kernel).
# The fused gate/up projection's prefill keeps the 27B's bf16 sums in fp32 (-> fp32).
SPECS = (_spec("27B", "*bf16"), _spec("demo", "*fp32"), _spec("27B", "*bf16", "*fp32"))
