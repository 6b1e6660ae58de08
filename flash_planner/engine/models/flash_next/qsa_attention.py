"""Attention over the first rows of a full-attention layer's KV cache, reading only the keys
Flash-Next's QSA indexer keeps, as one op that a compiled graph calls.

As qwen/cache_attention.py (whose docstring says why an op): the graph's shapes stay static
and the op reads how many cache rows to attend over from a host tensor each time it runs (on
CUDA when a graph is captured: one graph per key bucket). The indexer's choice among those
rows (indexer.selected_keys) runs inside it on the rows read, as the eager forward runs it.
"""

from __future__ import annotations

import torch

from ..qwen.cache_attention import attend_rows
from .indexer import selected_keys


@torch.library.custom_op("flash_planner::qsa_cache_attention", mutates_args=())
def qsa_cache_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        index_q: torch.Tensor, index_keys: torch.Tensor,
                        positions: torch.Tensor, rows: torch.Tensor,
                        k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                        scale: float, norm_weight: torch.Tensor, eps: float, ratio: int,
                        topk: int, rotary_dim: int, theta: float) -> torch.Tensor:
    """q [B, T, H, D] at positions [B, T] over the first `rows` (a host int64 [1]) rows of
    k_cache, v_cache [B, C, Hkv, D], each row over the cache rows at or before its position
    that the indexer keeps for it (index_q [B, T, heads, Di], the raw index keys [B, C, Di]
    with this block's already written; the k norm's weight and eps, the block ratio and
    count, the rotary dims and theta) -> [B, T, H, D] (contiguous)."""
    n = int(rows[0])
    chosen = selected_keys(index_q, index_keys, positions, n, ratio, topk, norm_weight, eps,
                           rotary_dim, theta)
    return attend_rows(q, k_cache, v_cache, positions, n, k_scale, v_scale, scale, chosen)


@qsa_cache_attention.register_fake
def _(q, k_cache, v_cache, index_q, index_keys, positions, rows, k_scale, v_scale, scale,
      norm_weight, eps, ratio, topk, rotary_dim, theta):
    return torch.empty_like(q, memory_format=torch.contiguous_format)
