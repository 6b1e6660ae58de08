"""Attention over the first rows of a layer's KV cache, as one op that a compiled graph calls.

Why: a static-shape forward (graphs/compiled.py) cannot slice the cache by a length known only
when it runs, so it read all `capacity` rows under a mask: at the demo's 4096 rows a batch of
8 x 16 rows spent ~7 ms of its 12 ms verify on a CPU in attention, for ~430 real rows. This op
is opaque to the compiler (a `torch.library` custom op): the graph's shapes stay static, one
graph serves every length, and the op reads how many rows to attend over from a host tensor
(`rows`, one int64) each time it runs. On CUDA that number is read when a graph is captured,
so the static forwards capture one graph per key bucket (static_graphs.key_buckets) and
replay the smallest that holds a forward's rows.
"""

from __future__ import annotations

import torch

from ....kernels import dispatch
from .layers import attention


@torch.library.custom_op("flash_planner::cache_attention", mutates_args=())
def cache_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    positions: torch.Tensor, rows: torch.Tensor, k_scale: torch.Tensor | None,
                    v_scale: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q [B, T, H, D] at positions [B, T] over the first `rows` (a host int64 [1]) rows of
    k_cache, v_cache [B, C, Hkv, D] (FP8 with their scales, or in q's dtype), each row over
    the cache rows at or before its position -> [B, T, H, D] (contiguous). Rows past `rows`
    are never read: they may hold anything."""
    return attend_rows(q, k_cache, v_cache, positions, int(rows[0]), k_scale, v_scale, scale)


def attend_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                positions: torch.Tensor, n: int, k_scale: torch.Tensor | None,
                v_scale: torch.Tensor | None, scale: float,
                keep: torch.Tensor | None = None) -> torch.Tensor:
    """The body of the cache attention ops (this one, flash_next/qsa_attention.py): q over
    the first n cache rows, causal by position, and where `keep` [B, T, n] says (the rows
    each query reads besides; None: every row)."""
    keys = dispatch.kv_read(k_cache, n, k_scale, q.dtype)
    values = dispatch.kv_read(v_cache, n, v_scale, q.dtype)
    mask = torch.arange(n, device=q.device) <= positions[:, None, :, None]   # [B, 1, T, n]
    if keep is not None:
        mask = mask & keep[:, None]
    return attention(q, keys, values, mask, scale).contiguous()


@cache_attention.register_fake
def _(q, k_cache, v_cache, positions, rows, k_scale, v_scale, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)
