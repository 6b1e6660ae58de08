"""What the weight-only GEMMs share: the tile decoders, the exact dot, the launchers' checks
and their route between the skinny and the tiled kernel.

Used by the tiled kernels (fp8_gemm, nvfp4_gemm, int4_gemm: any M), the skinny ones beside
them (M <= 16, split along K) and the mixture-of-experts kernels (moe_gemm), so one decode of
each format serves every kernel that reads it.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from .gate_up import swiglu_halves
from .gemm_configs import skinny

ACTIVATIONS = (torch.float32, torch.bfloat16, torch.float16)
# The CPU interpreter stores bf16 as raw uint16 and multiplies those integers in tl.dot: under
# it every dot runs in fp32 (read at import; tests set the variable before importing kernels).
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def e4m3_to_float(bits):
    """uint8 e4m3fn bit patterns -> float32, exactly (NaN codes 0x7F / 0xFF never occur).

    Sign, exponent and mantissa moved into fp16's places: e4m3 (bias 7) read as fp16 (bias
    15) is the value times 2^-8, subnormals included (fp16's go down to 2^-24), so a shift and
    one power-of-two multiply decode it with no table and no branch.
    """
    b = bits.to(tl.int32)
    half = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return half.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def dot_xwt(x, w):
    """x [BM, BK] as loaded @ w [BN, BK]^T -> float32 [BM, BN], on tensor cores.

    `w` is float32 holding values exact in bf16 and fp16 (e4m3, E2M1 x e4m3, q - z), so the
    dot multiplies exactly and accumulates in fp32. fp32 x is split into three bf16 pieces
    (8 significant bits each: all 24 of x), three bf16 dots: exact products again, where
    tf32 would round x to 11 bits and IEEE fp32 would leave the tensor cores idle.
    """
    if INTERPRETED:
        acc = tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
    elif x.dtype == tl.float32:
        wt = tl.trans(w.to(tl.bfloat16))
        hi = x.to(tl.bfloat16)
        rest = x - hi.to(tl.float32)
        mid = rest.to(tl.bfloat16)
        lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
        acc = tl.dot(hi, wt, tl.dot(mid, wt, tl.dot(lo, wt)))     # smallest terms first
    else:
        acc = tl.dot(x, tl.trans(w.to(x.dtype)))
    return acc


@triton.jit
def fp8_tile(weight, w_off, s_rows, mn, mk, k0, block_k, BLOCK_K: tl.constexpr):
    """The weight tile at K offset k0: e4m3 decoded to float32 [BN, BK] (unscaled) and the
    block scale [BN] of each of its rows. w_off holds each row's offset in `weight` [BN, 1],
    s_rows points at each row's scale row [BN]; mn and mk mask rows and columns."""
    rk = tl.arange(0, BLOCK_K)
    wq = tl.load(weight + k0 + w_off + rk[None, :], mask=mn[:, None] & mk[None, :], other=0)
    s = tl.load(s_rows + k0 // block_k, mask=mn, other=0.0)          # [BN], one K block
    return e4m3_to_float(wq), s


def check_operand(op: str, name: str, tensor: torch.Tensor, dtype: torch.dtype,
                  shape: tuple[int, ...], device: torch.device) -> None:
    """ValueError naming `name` unless it is a contiguous `dtype` tensor of `shape` on
    `device` (the kernels index weights as dense row-major arrays)."""
    if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{op}: {name} must be {dtype} {tuple(shape)}, got {tensor.dtype} "
                         f"{tuple(tensor.shape)}")
    if not tensor.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous")
    if tensor.device != device:
        raise ValueError(f"{op}: {name} is on {tensor.device}, x on {device}")


def flatten_rows(op: str, x: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> [M, K] with unit stride along K (a view when x allows it)."""
    if x.dtype not in ACTIVATIONS or x.dim() == 0:
        raise ValueError(f"{op}: x must be [..., K] in float32, bfloat16 or float16, got "
                         f"{x.dtype} {tuple(x.shape)}")
    rows = x.reshape(-1, x.shape[-1])                                  # [M, K]
    return rows if rows.stride(1) == 1 or rows.shape[1] == 1 else rows.contiguous()


def int32_sizes(op: str, rows: torch.Tensor, weight: torch.Tensor, n: int) -> None:
    """ValueError unless every offset the kernels form fits in int32."""
    if max(rows.shape[0] * rows.stride(0), weight.numel(), rows.shape[0] * n) >= 2**31:
        raise ValueError(f"{op}: x, weight or the output span 2^31 elements or more")


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
               BLOCK_K: tl.constexpr, EVEN: tl.constexpr):
    """The weight tile at K offset k0, decoded and group-scaled to float32: its even-k and
    odd-k columns, [BN, BK / 2] each. p_off and s_off hold each row's offset in `packed` and
    `scale` [BN, 1]; mn masks rows; K bounds the columns unless EVEN (the whole tile lies
    before K: masks constant along a row, so the loads can be 16-byte vectors)."""
    HALF: tl.constexpr = BLOCK_K // 2
    GROUPS: tl.constexpr = BLOCK_K // 16
    rj = tl.arange(0, HALF)
    rg = tl.arange(0, GROUPS)
    if EVEN:
        byte_mask = mn[:, None]                       # broadcast along the row by tl.load
        group_mask = mn[:, None]
    else:
        byte_mask = mn[:, None] & (rj < (K - k0) // 2)[None, :]      # bytes left in a row
        group_mask = mn[:, None] & (rg < (K - k0) // 16)[None, :]
    byte = tl.load(packed + k0 // 2 + p_off + rj[None, :], mask=byte_mask, other=0)
    sb = tl.load(scale + k0 // 16 + s_off + rg[None, :], mask=group_mask, other=0)
    s = e4m3_to_float(sb)                                             # [BN, GROUPS]
    # one scale per 8 bytes (16 values): [BN, GROUPS] -> [BN, GROUPS, 8] -> [BN, HALF]
    s = tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, GROUPS, 8)), (BLOCK_N, HALF))
    return e2m1_to_float(byte & 0xF) * s, e2m1_to_float(byte >> 4) * s


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


def by_rows(x: torch.Tensor, rows: torch.Tensor, width: int, skinny_fn: Callable,
            tiled_fn: Callable, gated: bool) -> torch.Tensor:
    """The launchers' one route: y [..., width] for x [..., K] (rows: its [M, K]) from the
    skinny kernel up to 16 rows (`skinny_fn()`: y [M, width]), else the tiled kernel
    (`tiled_fn()`: y [M, width], or for a gated weight its float32 sums [M, 2 width], to
    which SwiGLU is applied here)."""
    m = rows.shape[0]
    if m * width == 0:
        y = torch.empty(m, width, dtype=x.dtype, device=x.device)
    elif skinny(m):
        y = skinny_fn()
    else:
        y = swiglu_halves(tiled_fn()).to(x.dtype) if gated else tiled_fn()
    return y.reshape(*x.shape[:-1], width)
