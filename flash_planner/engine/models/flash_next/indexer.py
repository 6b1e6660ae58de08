"""Flash-Next's QSA token indexer: which cached keys each query of a full-attention layer reads.

The keys before and at a query (position p) fall into complete blocks of r consecutive tokens
and an incomplete tail. A block's key is the mean of its raw index keys, normed and turned to
the block's first position; a query's score for it is the sum over its index heads of
relu(q . k) / sqrt(D). The query keeps the `budget / r` best blocks and the tail; attention
then reads those keys alone. While a query has no more complete blocks than that, it keeps
them all: attention is dense and exact.

The best blocks are chosen by one function for the eager forward and the compiled one
(`selected_keys`; qsa_attention.py), in one of two ways. On a CPU as transformers' reference
does: each query's complete blocks ranked by topk, rows with as many blocks together (relu
makes equal scores, zeros, common, and topk orders those by the vector it is given). On CUDA
on static shapes, which a captured graph needs: every block of the rows read is scored, the
blocks a query has not completed rank last, and a stable sort orders the rest, equal scores
going to the earlier block.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ...config import ModelConfig
from ..qwen.context import ForwardContext
from ..qwen.layers import apply_rope, rope_cos_sin
from .hyper import GroupedRMSNorm, grouped_rms_norm


class QSAIndexer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        ix = cfg.flash_next.indexer
        self.layer_idx, self.heads, self.dim = layer_idx, ix.n_heads, ix.head_dim
        self.ratio, self.topk = ix.compress_ratio, ix.block_topk
        self.rope = cfg.rope
        self.index_qk_proj = nn.Linear(cfg.hidden_size, (ix.n_heads + 1) * ix.head_dim,
                                       bias=False)
        self.q_layernorm = GroupedRMSNorm(ix.head_dim, ix.head_dim, cfg.rms_norm_eps)
        self.k_layernorm = GroupedRMSNorm(ix.head_dim, ix.head_dim, cfg.rms_norm_eps)

    def project(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """h [B, T, H] (the attention's input) -> (index queries [B, T, heads, D], normed
        and turned; the rows' raw index keys [B, T, D])."""
        b, t, _ = h.shape
        q, k = self.index_qk_proj(h).split((self.heads * self.dim, self.dim), dim=-1)
        return apply_rope(self.q_layernorm(q.view(b, t, self.heads, self.dim)), cos, sin), k

    @staticmethod
    def store(keys: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> None:
        """The rows' raw index keys k [B, T, D] into the state's keys [B, C, D] at
        `positions` [B, T]."""
        rows = torch.arange(k.shape[0], device=k.device)[:, None]
        keys[rows, positions] = k.to(keys.dtype)

    def select(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """h [B, T, H] -> which keys each row reads [B, 1, T, L] (the causal mask and the
        selection), writing the rows' raw keys to the state."""
        b = h.shape[0]
        q, k = self.project(h, ctx.cos, ctx.sin)
        keys = ctx.state.flash.index_keys[self.layer_idx]
        self.store(keys, k, ctx.positions)
        length = ctx.key_length
        causal = ctx.causal_mask if ctx.causal_mask.dim() == 4 else ctx.causal_mask[None, None]
        chosen = selected_keys(q, keys, ctx.positions, length, self.ratio, self.topk,
                               self.k_layernorm.weight, self.k_layernorm.eps,
                               self.rope.rotary_dim, self.rope.theta)
        if chosen is None:                      # every complete block is kept: dense
            return causal.expand(b, 1, -1, length)
        return causal & chosen[:, None]


def selected_keys(q: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, length: int,
                  ratio: int, topk: int, norm_weight: torch.Tensor, eps: float,
                  rotary_dim: int, theta: float) -> torch.Tensor | None:
    """Of the first `length` rows of the raw index keys [B, C, D], those each query (q [B,
    T, heads, D] at positions [B, T]) keeps: [B, T, length] (its best blocks and its tail;
    the causal mask is the caller's), or None where no query can have more complete blocks
    than it keeps (dense)."""
    b, t, _, dim = q.shape
    blocks = length // ratio
    if blocks <= topk:
        return None
    raw = keys[:, :blocks * ratio].view(b, blocks, ratio, dim)
    pooled = grouped_rms_norm(raw.float().mean(dim=2).to(raw.dtype), norm_weight, dim, eps)
    starts = torch.arange(blocks, device=q.device) * ratio
    cos, sin = rope_cos_sin(starts.expand(b, -1), rotary_dim, theta, pooled.dtype)
    pooled = apply_rope(pooled[:, :, None], cos, sin)[:, :, 0]                   # [B, N, D]
    scores = torch.relu(torch.matmul(q.float(), pooled.float().transpose(-1, -2)[:, None]))
    scores = scores.sum(dim=-2) / math.sqrt(dim)                                 # [B, T, N]
    complete = (positions + 1) // ratio                                          # [B, T]
    block = torch.arange(blocks, device=q.device)
    if q.device.type == "cuda":
        done = block < complete[..., None]
        ranked = torch.where(done, scores, torch.full_like(scores, -math.inf))
        best = ranked.sort(dim=-1, descending=True, stable=True).indices[..., :topk]
        chosen = torch.zeros_like(done).scatter_(-1, best, True) & done
    else:
        chosen = torch.zeros(b, t, blocks, dtype=torch.bool, device=q.device)
        for n in complete.unique().tolist():
            if n == 0:
                continue
            rows = complete == n
            best = scores[rows][:, :n].topk(min(topk, n), dim=-1).indices
            chosen[rows] = torch.zeros(best.shape[0], blocks, dtype=torch.bool,
                                       device=q.device).scatter_(1, best, True)
    key_pos = torch.arange(length, device=q.device)
    in_block = chosen.gather(-1, (key_pos // ratio).clamp_max(blocks - 1).expand(b, t, -1))
    edge = (complete * ratio)[..., None]
    return in_block & (key_pos < edge) | (key_pos >= edge)
