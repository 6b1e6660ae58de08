"""Triton y = x @ W.T over int4 weights with a float32 scale and a zero point per group along K.

Layout as in reference.py: x [..., K] (fp32, bf16 or fp16; leading dims flattened to M rows),
`packed` uint8 [N, ceil(K / 2)] (k = 2j in the low nibble of byte j, 2j + 1 in the high one),
`scale` float32 and `zero` uint8 [N, ceil(K / group)]: W[n, k] = (q - zero) * scale per group;
the last group may be partial, K may be odd. y [..., N] in x's dtype. Grid (M tiles, N tiles),
tiles fixed as in the FP8 kernel; even-k and odd-k nibbles are dotted with the even and odd
columns of x as in the NVFP4 kernel.

q - zero is an integer in [-15, 15], exact in bf16 and fp16, so the tensor-core products are
exact; the group scale, constant over a K tile (group is a multiple of BLOCK_K), multiplies
the partial sum, as the FP8 kernel's block scale does. The tile decode, `int4_tile`, lives in
kernels/weight_tiles.py. Up to 16 rows the launcher hands over to skinny.py's split-K kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..fp8_gemm.kernel import BLOCK_N, gemm_meta
from ..specs import Spec, aligned, launch
from ..weight_tiles import by_rows, check_operand, dot_xwt, flatten_rows, int4_tile, int32_sizes
from .skinny import int4_rows

BLOCK_K = 32      # K elements per step: 16 bytes of each packed row; groups of 32 and up


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


def _operands(op: str, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
              zero: torch.Tensor, group: int, halves: int) -> torch.Tensor:
    """x's rows [M, K], once every operand is checked (`halves` weights stacked)."""
    rows = flatten_rows(op, x)
    k = rows.shape[1]
    if group < 1 or group % BLOCK_K:
        raise ValueError(f"{op}: group must be a multiple of {BLOCK_K} (the kernel's K "
                         f"tile), got {group}")
    if packed.dim() != 2 or packed.shape[0] % halves:
        what = "[2 I, ceil(K / 2)] (gate rows, then up rows)" if halves == 2 else \
            "[N, ceil(K / 2)]"
        raise ValueError(f"{op}: packed must be uint8 {what}, got {tuple(packed.shape)}")
    n = packed.shape[0]
    groups = triton.cdiv(k, group)
    check_operand(op, "packed", packed, torch.uint8, (n, triton.cdiv(k, 2)), x.device)
    check_operand(op, "scale", scale, torch.float32, (n, groups), x.device)
    check_operand(op, "zero", zero, torch.uint8, (n, groups), x.device)
    int32_sizes(op, rows, packed, n)
    return rows


def tiled_gemm(rows: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
               group: int, fp32_out: bool = False) -> torch.Tensor:
    """The tiled kernel; fp32_out: sums stored unrounded (the fused projection's prefill
    applies its activation to them)."""
    m, k = rows.shape
    n = packed.shape[0]
    out = torch.empty(m, n, dtype=torch.float32 if fp32_out else rows.dtype,
                      device=rows.device)
    options = meta(m)
    args = dict(x=rows, packed=packed, scale=scale, zero=zero, out=out, M=m, N=n, K=k,
                stride_xm=rows.stride(0), packed_cols=packed.shape[1], group=group,
                groups=scale.shape[1])
    grid = (triton.cdiv(m, options["BLOCK_M"]), triton.cdiv(n, BLOCK_N))
    launch(_int4_gemm_kernel, grid, args, options)
    return out


def int4_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
              group: int) -> torch.Tensor:
    """Same contract as the reference: x [..., K] -> [..., N]."""
    rows = _operands("int4_gemm", x, packed, scale, zero, group, 1)
    return by_rows(x, rows, packed.shape[0],
                   lambda: int4_rows(rows, packed, scale, zero, group),
                   lambda: tiled_gemm(rows, packed, scale, zero, group), False)


def int4_gate_up(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                 zero: torch.Tensor, group: int) -> torch.Tensor:
    """Same contract as the reference: x [..., K] -> silu(x @ gate.T) * (x @ up.T) [..., I]."""
    rows = _operands("int4_gate_up", x, packed, scale, zero, group, 2)
    return by_rows(x, rows, packed.shape[0] // 2,
                   lambda: int4_rows(rows, packed, scale, zero, group, gated=True),
                   lambda: tiled_gemm(rows, packed, scale, zero, group, fp32_out=True), True)


def meta(m: int) -> dict:
    return gemm_meta(m, BLOCK_K)


def _spec(model: str, act: str, out: str = "") -> Spec:
    types = {"x": act, "packed": "*u8", "scale": "*fp32", "zero": "*u8", "out": out or act,
             **dict.fromkeys(("M", "N", "K", "stride_xm", "packed_cols", "group", "groups"),
                             "i32")}
    label = f"int4 {model} {act[1:]} M>16{' -> fp32' if out else ''}"
    return Spec.from_meta(_int4_gemm_kernel, label, types, meta(64), aligned=aligned(types))


# Qwen3.6-27B layers in W4A16 (AWQ / GPTQ / compressed-tensors repacked; K 5120 to 17408,
# group 128) with bf16 activations on Thor; the demo (hidden 192, MLP 512) in fp32. A spec per
# activation dtype, for prefill chunks (M > 16; up to 16 rows run skinny.py's kernel).
# The fused gate/up projection's prefill keeps the 27B's bf16 sums in fp32 (-> fp32).
SPECS = (_spec("27B", "*bf16"), _spec("demo", "*fp32"), _spec("27B", "*bf16", "*fp32"))
