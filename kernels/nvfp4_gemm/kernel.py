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
scale multiplies the fp32 sum once at the end. The tile decode, `nvfp4_tile`, is shared with
the mixture-of-experts kernel (kernels/moe_gemm).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..fp8_gemm.kernel import (
    BLOCK_N,
    check_operand,
    dot_xwt,
    e4m3_to_float,
    flatten_rows,
    gemm_meta,
    int32_sizes,
)
from ..specs import Spec, launch

GROUP = 16        # K elements per e4m3 scale (the format's)
BLOCK_K = 64      # K elements per step: 32 bytes of each packed row, 4 scales


@triton.jit
def e2m1_to_float(nibble):
    """4-bit E2M1 codes (0..15, sign in bit 3) -> float32, exactly: 0, .5, 1, 1.5, 2, 3, 4, 6.

    As in e4m3_to_float, the fields moved into fp16's places (bias 1 -> 15) give the value
    times 2^-14, the subnormal 0.5 included; no table (a global list would not compile).
    """
    v = nibble.to(tl.int32)
    half = ((v & 0x8) << 12) | ((v & 0x7) << 9)
    return half.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def nvfp4_tile(packed, p_off, scale, s_off, mn, k0, K, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """The weight tile at K offset k0, decoded and group-scaled to float32: its even-k and
    odd-k columns, [BN, BK / 2] each. p_off and s_off hold each row's offset in `packed` and
    `scale` [BN, 1]; mn masks rows."""
    HALF: tl.constexpr = BLOCK_K // 2
    GROUPS: tl.constexpr = BLOCK_K // 16
    rj = tl.arange(0, HALF)
    rg = tl.arange(0, GROUPS)
    mj = rj < (K - k0) // 2                                           # bytes left in a row
    byte = tl.load(packed + k0 // 2 + p_off + rj[None, :],
                   mask=mn[:, None] & mj[None, :], other=0)          # [BN, HALF]
    sb = tl.load(scale + k0 // 16 + s_off + rg[None, :],
                 mask=mn[:, None] & (rg < (K - k0) // 16)[None, :], other=0)
    s = e4m3_to_float(sb)                                             # [BN, GROUPS]
    # one scale per 8 bytes (16 values): [BN, GROUPS] -> [BN, GROUPS, 8] -> [BN, HALF]
    s = tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, GROUPS, 8)), (BLOCK_N, HALF))
    return e2m1_to_float(byte & 0xF) * s, e2m1_to_float(byte >> 4) * s


@triton.jit
def _nvfp4_gemm_kernel(x, packed, scale, global_scale, out, M, N, K, stride_xm,
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
        w_even, w_odd = nvfp4_tile(packed, p_off, scale, s_off, mn, k0, K, BLOCK_N, BLOCK_K)
        xk = x + k0 + x_off + 2 * rj[None, :]                         # x at k0 + 2j
        xm = mm[:, None] & (rj < (K - k0) // 2)[None, :]
        x_even = tl.load(xk, mask=xm, other=0.0)
        x_odd = tl.load(xk + 1, mask=xm, other=0.0)
        acc += dot_xwt(x_even, w_even)
        acc += dot_xwt(x_odd, w_odd)
    acc = acc * tl.load(global_scale)
    dst = out + rm[:, None] * N + rn[None, :]
    tl.store(dst, acc.to(out.dtype.element_ty), mask=mm[:, None] & mn[None, :])


def nvfp4_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
               global_scale: torch.Tensor) -> torch.Tensor:
    """Same contract as the reference: x [..., K] -> [..., N]."""
    rows = flatten_rows("nvfp4_gemm", x)
    k = rows.shape[1]
    if k % GROUP:
        raise ValueError(f"nvfp4_gemm: K (x's last dim) must be a multiple of {GROUP}, got {k}")
    if packed.dim() != 2:
        raise ValueError(f"nvfp4_gemm: packed must be uint8 [N, K / 2], got "
                         f"{tuple(packed.shape)}")
    n = packed.shape[0]
    check_operand("nvfp4_gemm", "packed", packed, torch.uint8, (n, k // 2), x.device)
    check_operand("nvfp4_gemm", "scale", scale, torch.uint8, (n, k // GROUP), x.device)
    check_operand("nvfp4_gemm", "global_scale", global_scale.reshape(-1), torch.float32, (1,),
                  x.device)
    int32_sizes("nvfp4_gemm", rows, packed, n)
    m = rows.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m * n:
        options = meta(m)
        args = dict(x=rows, packed=packed, scale=scale, global_scale=global_scale, out=out,
                    M=m, N=n, K=k, stride_xm=rows.stride(0))
        grid = (triton.cdiv(m, options["BLOCK_M"]), triton.cdiv(n, BLOCK_N))
        launch(_nvfp4_gemm_kernel, grid, args, options)
    return out.reshape(*x.shape[:-1], n)


def meta(m: int) -> dict:
    return gemm_meta(m, BLOCK_K)


def _spec(model: str, act: str, m: int) -> Spec:
    types = {"x": act, "packed": "*u8", "scale": "*u8", "global_scale": "*fp32", "out": act,
             **dict.fromkeys(("M", "N", "K", "stride_xm"), "i32")}
    label = f"nvfp4 {model} {act[1:]} M{'<=16' if m <= 16 else '>16'}"
    return Spec.from_meta(_nvfp4_gemm_kernel, label, types, meta(m))


# Qwen3.6-27B's NVFP4 MLP (gate/up 5120 -> 17408, down 17408 -> 5120) with bf16 activations
# on Thor; the demo (hidden 192, MLP 512) in fp32. A spec per activation dtype and row tile.
SPECS = tuple(_spec(model, act, m) for model, act in (("27B", "*bf16"), ("demo", "*fp32"))
              for m in (16, 64))
