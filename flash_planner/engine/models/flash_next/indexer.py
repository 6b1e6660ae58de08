"""Flash-Next's QSA token indexer: which cached keys each query of a full-attention layer reads.

The keys before and at a query (position p) fall into complete blocks of r consecutive tokens
and an incomplete tail. A block's key is the mean of its raw index keys, normed and turned to
the block's first position; a query's score for it is the sum over its index heads of
relu(q . k) / sqrt(D). The query keeps the `budget / r` best blocks and the tail; attention
then reads those keys alone. While a query has no more complete blocks than that, it keeps
them all: attention is dense and exact.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ...config import ModelConfig
from ..qwen.context import ForwardContext
from ..qwen.layers import apply_rope, rope_cos_sin
from .hyper import GroupedRMSNorm


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

    def select(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """h [B, T, H] (the attention's input) -> which keys each row reads [B, 1, T, L]
        (the causal mask and the selection), writing the rows' raw keys to the state."""
        b, t, _ = h.shape
        q, k = self.index_qk_proj(h).split((self.heads * self.dim, self.dim), dim=-1)
        q = apply_rope(self.q_layernorm(q.view(b, t, self.heads, self.dim)), ctx.cos, ctx.sin)
        keys = ctx.state.flash.index_keys[self.layer_idx]
        keys[torch.arange(b, device=h.device)[:, None], ctx.positions] = k.to(keys.dtype)
        length = ctx.key_length
        causal = ctx.causal_mask if ctx.causal_mask.dim() == 4 else ctx.causal_mask[None, None]
        blocks = length // self.ratio
        if blocks <= self.topk:                 # every complete block is kept: dense
            return causal.expand(b, 1, t, length)
        raw = keys[:, :blocks * self.ratio].view(b, blocks, self.ratio, self.dim)
        pooled = self.k_layernorm(raw.float().mean(dim=2).to(raw.dtype))      # [B, N, D]
        starts = torch.arange(blocks, device=h.device) * self.ratio
        cos, sin = rope_cos_sin(starts.expand(b, -1), self.rope.rotary_dim, self.rope.theta,
                                pooled.dtype)
        pooled = apply_rope(pooled[:, :, None], cos, sin)[:, :, 0]
        scores = torch.relu(torch.matmul(q.float(), pooled.float().transpose(-1, -2)[:, None]))
        scores = scores.sum(dim=-2) / math.sqrt(self.dim)                       # [B, T, N]
        complete = (ctx.positions + 1) // self.ratio                           # [B, T]
        # each row's best among exactly its complete blocks: relu makes ties (0) common, and
        # topk breaks them by the vector it is given, so rows with as many blocks go together
        chosen = torch.zeros(b, t, blocks, dtype=torch.bool, device=h.device)
        for n in complete.unique().tolist():
            if n == 0:
                continue
            rows = complete == n
            best = scores[rows][:, :n].topk(min(self.topk, n), dim=-1).indices
            chosen[rows] = torch.zeros(best.shape[0], blocks, dtype=torch.bool,
                                       device=h.device).scatter_(1, best, True)
        key_pos = torch.arange(length, device=h.device)
        in_block = chosen.gather(-1, (key_pos // self.ratio).clamp_max(blocks - 1)
                                 .expand(b, t, -1))
        tail = key_pos >= (complete * self.ratio)[..., None]
        return causal & (in_block & (key_pos < (complete * self.ratio)[..., None])
                         | tail)[:, None]
