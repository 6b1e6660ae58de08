"""Triton y = x @ W.T over int4 weights with a float32 scale and a zero point per group along K.

Layout as in reference.py: x [..., K] (fp32, bf16 or fp16; leading dims flattened to M rows),
`packed` uint8 [N, ceil(K / 2)] (k = 2j in the low nibble of byte j, 2j + 1 in the high one),
`scale` float32 and `zero` uint8 [N, ceil(K / group)]: W[n, k] = (q - zero) * scale per group;
the last group may be partial, K may be odd. y [..., N] in x's dtype. Grid (M tiles, N tiles),
tiles fixed as in the FP8 kernel; even-k and odd-k nibbles are dotted with the even and odd
columns of x as in the NVFP4 kernel.

q - zero is an integer in [-15, 15], exact in bf16 and fp16, so the tensor-core products are
exact; the group scale, constant over a K tile (group is a multiple of BLOCK_K), multiplies
the partial sum, as the FP8 kernel's block scale does. The tile decode, `int4_tile`, is shared
with the mixture-of-experts kernel (kernels/moe_gemm).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..fp8_gemm.kernel import (
    BLOCK_N,
    check_operand,
    dot_xwt,
    flatten_rows,
    gemm_meta,
    int32_sizes,
)
from ..specs import Spec, launch

BLOCK_K = 32      # K elements per step: 16 bytes of each packed row; groups of 32 and up


@triton.jit
def int4_tile(packed, p_off, scale, zero, g_rows, mn, even, k0, group, BLOCK_K: tl.constexpr):
    """The weight tile at K offset k0: q - zero of its even-k and odd-k columns in float32,
    [BN, BK / 2] each, and the group scale [BN] of each row. p_off holds each row's offset in
    `packed` [BN, 1], g_rows in `scale` and `zero` [BN]; mn masks rows, even the bytes."""
    HALF: tl.constexpr = BLOCK_K // 2
    rj = tl.arange(0, HALF)
    byte = tl.load(packed + k0 // 2 + p_off + rj[None, :],
                   mask=mn[:, None] & even[None, :], other=0)        # [BN, HALF]
    g = k0 // group
    s = tl.load(scale + g_rows + g, mask=mn, other=0.0)               # [BN]
    z = tl.load(zero + g_rows + g, mask=mn, other=0).to(tl.float32)
    return (byte & 0xF).to(tl.float32) - z[:, None], (byte >> 4).to(tl.float32) - z[:, None], s


@triton.jit
def _int4_gemm_kernel(x, packed, scale, zero, out, M, N, K, stride_xm, packed_cols, group,
                      groups, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    HALF: tl.constexpr = BLOCK_K // 2
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mm = rm < M
    mn = rn < N
    x_off = rm[:, None] * stride_xm
    p_off = rn[:, None] * packed_cols
    g_rows = rn * groups
    rj = tl.arange(0, HALF)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        even = 2 * rj < K - k0                      # k0 + 2j < K: byte j holds a value
        odd = 2 * rj + 1 < K - k0                   # its high nibble too (not past odd K)
        w_even, w_odd, s = int4_tile(packed, p_off, scale, zero, g_rows, mn, even, k0, group,
                                     BLOCK_K)
        xk = x + k0 + x_off + 2 * rj[None, :]                         # x at k0 + 2j
        x_even = tl.load(xk, mask=mm[:, None] & even[None, :], other=0.0)
        x_odd = tl.load(xk + 1, mask=mm[:, None] & odd[None, :], other=0.0)
        part = dot_xwt(x_even, w_even)
        part += dot_xwt(x_odd, w_odd)
        acc += part * s[None, :]
    dst = out + rm[:, None] * N + rn[None, :]
    tl.store(dst, acc.to(out.dtype.element_ty), mask=mm[:, None] & mn[None, :])


def int4_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
              group: int) -> torch.Tensor:
    """Same contract as the reference: x [..., K] -> [..., N]."""
    rows = flatten_rows("int4_gemm", x)
    k = rows.shape[1]
    if group < 1 or group % BLOCK_K:
        raise ValueError(f"int4_gemm: group must be a multiple of {BLOCK_K} (the kernel's K "
                         f"tile), got {group}")
    if packed.dim() != 2:
        raise ValueError(f"int4_gemm: packed must be uint8 [N, ceil(K / 2)], got "
                         f"{tuple(packed.shape)}")
    n = packed.shape[0]
    groups = triton.cdiv(k, group)
    check_operand("int4_gemm", "packed", packed, torch.uint8, (n, triton.cdiv(k, 2)), x.device)
    check_operand("int4_gemm", "scale", scale, torch.float32, (n, groups), x.device)
    check_operand("int4_gemm", "zero", zero, torch.uint8, (n, groups), x.device)
    int32_sizes("int4_gemm", rows, packed, n)
    m = rows.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m * n:
        options = meta(m)
        args = dict(x=rows, packed=packed, scale=scale, zero=zero, out=out, M=m, N=n, K=k,
                    stride_xm=rows.stride(0), packed_cols=packed.shape[1], group=group,
                    groups=groups)
        grid = (triton.cdiv(m, options["BLOCK_M"]), triton.cdiv(n, BLOCK_N))
        launch(_int4_gemm_kernel, grid, args, options)
    return out.reshape(*x.shape[:-1], n)


def meta(m: int) -> dict:
    return gemm_meta(m, BLOCK_K)


def _spec(model: str, act: str, m: int) -> Spec:
    types = {"x": act, "packed": "*u8", "scale": "*fp32", "zero": "*u8", "out": act,
             **dict.fromkeys(("M", "N", "K", "stride_xm", "packed_cols", "group", "groups"),
                             "i32")}
    label = f"int4 {model} {act[1:]} M{'<=16' if m <= 16 else '>16'}"
    return Spec.from_meta(_int4_gemm_kernel, label, types, meta(m))


# Qwen3.6-27B layers in W4A16 (AWQ / GPTQ / compressed-tensors repacked; K 5120 to 17408,
# group 128) with bf16 activations on Thor; the demo (hidden 192, MLP 512) in fp32. A spec per
# activation dtype and row tile.
SPECS = tuple(_spec(model, act, m) for model, act in (("27B", "*bf16"), ("demo", "*fp32"))
              for m in (16, 64))
