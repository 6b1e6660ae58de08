"""Triton y = x @ W.T over NVFP4 weights: E2M1 nibbles, an e4m3 scale per 16, one fp32 scale.

Layout as in reference.py: x [..., K] (fp32, bf16 or fp16; leading dims flattened to M rows),
`packed` uint8 [N, K / 2] (k = 2j in the low nibble of byte j, 2j + 1 in the high one),
`scale` uint8 [N, K / 16] of e4m3 bit patterns, `global_scale` float32 [1], a multiplier;
y [..., N] in x's dtype; K % 16 == 0. Grid (M tiles, N tiles), tiles fixed as in the FP8
kernel. Each K step loads a [BLOCK_N, BLOCK_K / 2] byte tile once and splits it into the
even-k (low nibble) and odd-k (high nibble) halves, each dotted with the matching even or odd
columns of x: no interleaving of nibbles in registers.

E2M1 times an e4m3 scale has at most 5 significant bits and lies in [2^-10, 2688], so the
scaled weight is exact in bf16 and fp16: the tensor-core products are exact, and the global
scale multiplies the fp32 sum once at the end. The tile decode, `nvfp4_tile`, lives in
kernels/weight_tiles.py. Up to 16 rows the launcher hands over to skinny.py's split-K kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..fp8_gemm.kernel import BLOCK_N, gemm_meta
from ..specs import Spec, aligned, launch
from ..weight_tiles import by_rows, check_operand, dot_xwt, flatten_rows, int32_sizes, nvfp4_tile
from .reference import GROUP
from .skinny import nvfp4_rows

BLOCK_K = 64      # K elements per step: 32 bytes of each packed row, 4 scales


@triton.jit
def _nvfp4_gemm_kernel(x, packed, scale, global_scale, out, M, N, K, stride_xm, half,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    HALF: tl.constexpr = BLOCK_K // 2
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mm = rm < M
    mn = rn < N
    x_off = rm[:, None] * stride_xm
    p_off = rn[:, None] * (K // 2)
    s_off = rn[:, None] * (K // 16)
    rj = tl.arange(0, HALF)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w_even, w_odd = nvfp4_tile(packed, p_off, scale, s_off, mn, k0, K, BLOCK_N, BLOCK_K,
                                   False)
        xk = x + k0 + x_off + 2 * rj[None, :]                         # x at k0 + 2j
        xm = mm[:, None] & (rj < (K - k0) // 2)[None, :]
        x_even = tl.load(xk, mask=xm, other=0.0)
        x_odd = tl.load(xk + 1, mask=xm, other=0.0)
        acc += dot_xwt(x_even, w_even)
        acc += dot_xwt(x_odd, w_odd)
    # the global scale of each row: the second one from row `half` on (a stacked gate and up
    # projection's up rows; half = N for a weight with one)
    acc = acc * tl.load(global_scale + (rn >= half).to(tl.int32), mask=mn, other=0.0)[None, :]
    dst = out + rm[:, None] * N + rn[None, :]
    tl.store(dst, acc.to(out.dtype.element_ty), mask=mm[:, None] & mn[None, :])


def _operands(op: str, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
              global_scale: torch.Tensor, halves: int) -> torch.Tensor:
    """x's rows [M, K], once every operand is checked (`halves` weights stacked in packed,
    a global scale each)."""
    rows = flatten_rows(op, x)
    k = rows.shape[1]
    if k % GROUP:
        raise ValueError(f"{op}: K (x's last dim) must be a multiple of {GROUP}, got {k}")
    if packed.dim() != 2 or packed.shape[0] % halves:
        what = "[2 I, K / 2] (gate rows, then up rows)" if halves == 2 else "[N, K / 2]"
        raise ValueError(f"{op}: packed must be uint8 {what}, got {tuple(packed.shape)}")
    n = packed.shape[0]
    check_operand(op, "packed", packed, torch.uint8, (n, k // 2), x.device)
    check_operand(op, "scale", scale, torch.uint8, (n, k // GROUP), x.device)
    check_operand(op, "global_scale", global_scale.reshape(-1), torch.float32, (halves,),
                  x.device)
    int32_sizes(op, rows, packed, n)
    return rows


def tiled_gemm(rows: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
               global_scale: torch.Tensor, fp32_out: bool = False) -> torch.Tensor:
    """The tiled kernel; global_scale [1], or [2] for a stacked gate and up projection;
    fp32_out: sums stored unrounded (the fused projection's prefill applies its activation
    to them)."""
    m, k = rows.shape
    n = packed.shape[0]
    out = torch.empty(m, n, dtype=torch.float32 if fp32_out else rows.dtype,
                      device=rows.device)
    options = meta(m)
    args = dict(x=rows, packed=packed, scale=scale, global_scale=global_scale, out=out,
                M=m, N=n, K=k, stride_xm=rows.stride(0),
                half=n // 2 if global_scale.numel() == 2 else n)
    grid = (triton.cdiv(m, options["BLOCK_M"]), triton.cdiv(n, BLOCK_N))
    launch(_nvfp4_gemm_kernel, grid, args, options)
    return out


def nvfp4_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
               global_scale: torch.Tensor) -> torch.Tensor:
    """Same contract as the reference: x [..., K] -> [..., N]."""
    rows = _operands("nvfp4_gemm", x, packed, scale, global_scale, 1)
    return by_rows(x, rows, packed.shape[0],
                   lambda: nvfp4_rows(rows, packed, scale, global_scale.reshape(-1)),
                   lambda: tiled_gemm(rows, packed, scale, global_scale), False)


def nvfp4_gate_up(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                  global_scale: torch.Tensor) -> torch.Tensor:
    """Same contract as the reference: x [..., K] -> silu(x @ gate.T) * (x @ up.T) [..., I]."""
    rows = _operands("nvfp4_gate_up", x, packed, scale, global_scale, 2)
    gs = global_scale.reshape(-1)
    return by_rows(x, rows, packed.shape[0] // 2,
                   lambda: nvfp4_rows(rows, packed, scale, gs, gated=True),
                   lambda: tiled_gemm(rows, packed, scale, gs, fp32_out=True), True)


def meta(m: int) -> dict:
    return gemm_meta(m, BLOCK_K)


def _spec(model: str, act: str, out: str = "") -> Spec:
    types = {"x": act, "packed": "*u8", "scale": "*u8", "global_scale": "*fp32", "out": out or act,
             **dict.fromkeys(("M", "N", "K", "stride_xm", "half"), "i32")}
    label = f"nvfp4 {model} {act[1:]} M>16{' -> fp32' if out else ''}"
    return Spec.from_meta(_nvfp4_gemm_kernel, label, types, meta(64), aligned=aligned(types))


# Qwen3.6-27B's NVFP4 MLP (gate/up 5120 -> 17408, down 17408 -> 5120) with bf16 activations
# on Thor; the demo (hidden 192, MLP 512) in fp32. A spec per activation dtype, for prefill
# chunks (M > 16; up to 16 rows run skinny.py's kernel).
# The fused gate/up projection's prefill keeps the 27B's bf16 sums in fp32 (-> fp32).
SPECS = (_spec("27B", "*bf16"), _spec("demo", "*fp32"), _spec("27B", "*bf16", "*fp32"))
