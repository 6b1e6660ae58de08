"""Triton KV append: write rows at given cache positions, quantizing to FP8 e4m3 if asked.

Grid (row, kv head): each program writes one head of one row. The e4m3 bit pattern is built
with integer arithmetic on the float32 value (round to nearest even, saturate at +-448,
subnormals down to 2^-9), not with a float8 cast: the result is bit-identical to
`torch.float8_e4m3fn` conversion on GPUs and in the CPU interpreter alike (whose fp8 casts
round ties up, flush subnormals and do not saturate).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..specs import Spec, launch

# A constexpr: a plain module-level float is read by the interpreter but rejected by the GPU
# compiler ("Cannot access global variable FP8_MAX from within @jit'ed function").
FP8_MAX = tl.constexpr(448.0)


@triton.jit
def _round_half_even(x):
    """Round non-negative x < 2^22 to the nearest integer, ties to even (fp32 addition)."""
    magic = 8388608.0  # 2^23: adding it leaves no fraction bits, rounding as the FPU does
    return (x + magic) - magic


@triton.jit
def _e4m3_bits(x):
    """float32 -> e4m3fn bit pattern (int32 in 0..255)."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.minimum(tl.abs(x), FP8_MAX)
    # subnormal range: a < 2^-6 -> m * 2^-9, m in 0..8 (8 is the smallest normal, 0x08)
    sub = _round_half_even(a * 512.0).to(tl.int32)
    # normal range: a = 1.f * 2^e, keep 3 fraction bits
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    scale = ((127 - e) << 23).to(tl.float32, bitcast=True)          # 2^-e
    q = _round_half_even((a * scale - 1.0) * 8.0).to(tl.int32)
    e = tl.where(q == 8, e + 1, e)
    q = tl.where(q == 8, 0, q)
    normal = ((e + 7) << 3) | q
    return sign | tl.where(a < 0.015625, sub, normal)


@triton.jit
def _append_kernel(cache, rows, positions, scale, scale_seq_stride, rows_per_seq, capacity,
                   heads, dim, QUANT: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0)            # b * T + t
    h = tl.program_id(1)
    pos = tl.load(positions + r)
    if pos >= 0:
        b = r // rows_per_seq
        d = tl.arange(0, BLOCK_D)
        keep = d < dim
        x = tl.load(rows + (r * heads + h) * dim + d, mask=keep, other=0.0)
        dst = cache + ((b.to(tl.int64) * capacity + pos) * heads + h) * dim + d
        if QUANT:
            x = x.to(tl.float32) / tl.load(scale + b * scale_seq_stride + h)
            tl.store(dst, _e4m3_bits(x).to(tl.uint8), mask=keep)
        else:  # a copy; a no-op cast when rows already have the cache's dtype
            tl.store(dst, x.to(cache.dtype.element_ty), mask=keep)


def kv_append(
    cache: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    scale: torch.Tensor | None = None,
) -> None:
    """Same contract as the reference: rows [B, T, H, D] into cache [B, C, H, D] at
    positions [B, T] (negative: skip); a uint8 cache stores e4m3 with per-head `scale` [H]
    or one per sequence [B, H]."""
    b, t, h, d = rows.shape
    if cache.shape[0] != b or tuple(cache.shape[2:]) != (h, d):
        raise ValueError(f"kv_append: rows {tuple(rows.shape)} do not fit cache "
                         f"{tuple(cache.shape)}")
    if not cache.is_contiguous():
        raise ValueError("kv_append: the cache must be contiguous")
    quant = cache.dtype == torch.uint8
    if quant and scale is None:
        raise ValueError("an FP8 (uint8) cache needs per-head scales")
    if quant and tuple(scale.shape) not in ((h,), (b, h)):
        raise ValueError(f"kv_append: scale {tuple(scale.shape)} is neither [{h}] nor "
                         f"[{b}, {h}]")
    if b * t == 0:
        return
    rows = rows.contiguous()
    per_seq = quant and scale.dim() == 2
    args = dict(cache=cache, rows=rows, positions=positions.to(torch.int64).contiguous(),
                scale=scale.float().contiguous() if quant else rows,  # unused unless quant
                scale_seq_stride=h if per_seq else 0, rows_per_seq=t, capacity=cache.shape[1],
                heads=h, dim=d)
    launch(_append_kernel, (b * t, h), args, meta(d, quant))


def meta(head_dim: int, quant: bool) -> dict:
    """Constexprs and launch options: one program writes one head of one row."""
    return {"QUANT": quant, "BLOCK_D": triton.next_power_of_2(head_dim), "num_warps": 4,
            "num_stages": 3}


def _spec(model: str, head_dim: int, rows: str, cache: str) -> Spec:
    quant = cache == "*u8"
    types = {"cache": cache, "rows": rows, "positions": "*i64",
             "scale": "*fp32" if quant else rows, "scale_seq_stride": "i32",
             "rows_per_seq": "i32", "capacity": "i32",
             "heads": "i32", "dim": "i32"}
    label = f"{model} {rows[1:]} rows -> {'fp8' if quant else cache[1:]} cache"
    return Spec.from_meta(_append_kernel, label, types, meta(head_dim, quant),
                          shape_constexprs=("BLOCK_D",))


# Qwen3.6-27B attention head_dim 256 (bf16 on Thor), the demo's 48 (fp32 on CPU or GPU).
SPECS = (_spec("27B", 256, "*bf16", "*bf16"), _spec("27B", 256, "*bf16", "*u8"),
         _spec("demo", 48, "*fp32", "*fp32"), _spec("demo", 48, "*fp32", "*u8"))
