"""Plain-torch KV append and read, for full-precision and FP8 e4m3 caches.

Cache layout per layer: [B, C, H, D] (C = capacity). An FP8 cache is stored as uint8 (the
e4m3 bit pattern: CPU torch cannot index_copy_ into float8 tensors) with one float32 scale per
kv head; stored = e4m3(clamp(x / scale, -448, 448)) with round-to-nearest-even.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0


def _per_head(scale: torch.Tensor) -> torch.Tensor:
    """A scale [H] or, one per sequence, [B, H] -> broadcastable over [B, T, H, D]."""
    return scale[:, None] if scale.dim() == 1 else scale[:, None, :, None]


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., H, D] (or [B, T, H, D] with scale [B, H]) -> uint8 e4m3 bit patterns, scale
    [H] float32."""
    scaled = (x.float() / _per_head(scale)).clamp_(-FP8_MAX, FP8_MAX)
    return scaled.to(torch.float8_e4m3fn).view(torch.uint8)


def dequantize_fp8(bits: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 e4m3 bit patterns [..., H, D] (or [B, L, H, D] with scale [B, H]) -> dtype,
    multiplied back by scale [H]."""
    return (bits.view(torch.float8_e4m3fn).float() * _per_head(scale)).to(dtype)


def kv_append(
    cache: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    scale: torch.Tensor | None = None,
) -> None:
    """Write rows [B, T, H, D] into cache [B, C, H, D] at positions [B, T] (negative: skip;
    under torch.compile every position must be a real one).

    With a uint8 cache, rows are quantized to FP8 e4m3 with per-head `scale` [H], or [B, H]
    where each sequence has its own (batched requests: each calibrated on its own prompt).
    """
    if cache.dtype == torch.uint8:
        if scale is None:
            raise ValueError("an FP8 (uint8) cache needs per-head scales")
        data = quantize_fp8(rows, scale)
    else:
        data = rows.to(cache.dtype)
    b, t = positions.shape
    if torch.compiler.is_compiling() or b > 1 and bool((positions >= 0).all()):
        # A compiled (static-shape) forward writes every row at a real position (the boolean
        # selection below would give the graph a shape that depends on data), as one
        # index_put_ on the cache itself: inductor writes that in place, where an index_copy_
        # or a write through a view becomes two copies of the whole cache per call. Eager,
        # a batch of sequences whose rows are all real takes the same one call.
        rows_of = torch.arange(b, device=cache.device)[:, None].expand(b, t)
        cache.index_put_((rows_of, positions), data)
        return
    for bi in range(b):
        keep = positions[bi] >= 0
        cache[bi].index_copy_(0, positions[bi][keep], data[bi][keep])


def kv_read(
    cache: torch.Tensor, length: int, scale: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """The first `length` rows of cache [B, C, H, D] as dtype [B, length, H, D]."""
    rows = cache[:, :length]
    if cache.dtype == torch.uint8:
        return dequantize_fp8(rows, scale, dtype)
    return rows.to(dtype)
