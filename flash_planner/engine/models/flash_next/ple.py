"""Flash-Next's per-layer embedding (PLE): n-gram rows gated into each residual stream.

For each token, its n-gram rows (ngram.py; one per head, concatenated) are projected to one
value [H] and one key per stream [hc * H]. A stream's gate is the normed key against the
normed stream, sqrt-compressed with its sign (sign(g) sqrt(|g|)), through a sigmoid; the
gated values [hc * H] are added to the streams together with a dilated causal depthwise conv
(kernel K, dilation n: taps t, t-n, ..., t-(K-1)n) of their norm, through SiLU.

State (flash_state.py): the conv's window, the last (K-1) n normed rows, and the n-gram
history, the last n-1 token ids; both roll back with the block's committed rows.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ...config import ModelConfig
from ..qwen.context import ForwardContext
from .hyper import GroupedRMSNorm
from .ngram import NGramHasher, NGramTable


class PLE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, ple_index: int):
        super().__init__()
        fn = cfg.flash_next
        self.layer_idx, self.hidden, self.hc = layer_idx, cfg.hidden_size, fn.hc_count
        wide = fn.hc_count * cfg.hidden_size
        self.key_proj = nn.Linear(fn.ple_embed_dim, wide, bias=False)
        self.value_proj = nn.Linear(fn.ple_embed_dim, cfg.hidden_size, bias=False)
        self.norm_key = GroupedRMSNorm(wide, cfg.hidden_size, cfg.rms_norm_eps)
        self.norm_query = GroupedRMSNorm(wide, cfg.hidden_size, cfg.rms_norm_eps)
        self.norm_conv = GroupedRMSNorm(wide, cfg.hidden_size, cfg.rms_norm_eps)
        self.dilation, self.kernel = fn.ngram_size, fn.ple_conv_kernel
        self.conv1d = nn.Conv1d(wide, wide, fn.ple_conv_kernel, groups=wide,
                                dilation=fn.ngram_size, bias=False)
        self.hasher = NGramHasher(cfg.vocab_size, fn.ngram_size, fn.heads_per_ngram,
                                  fn.ngram_vocab_base, ple_index, fn.seed, fn.eos_id)
        self.table: NGramTable | None = None      # opened at load (checkpoint.py)

    def embed(self, history: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype
              ) -> torch.Tensor:
        """The block's n-gram rows, concatenated per token: [B, T, ple_embed_dim]."""
        rows = self.table.gather(self.hasher(history, ids))     # [B, T, heads, dim]
        return rows.to(ids.device, dtype).flatten(-2)

    def forward(self, streams: torch.Tensor, ids: torch.Tensor, history: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        """What the layer adds to the streams [B, T, hc * H] for the block's ids [B, T], the
        ids before them being `history` [B, n-1]."""
        gated = self.gated(streams, self.embed(history, ids, streams.dtype))
        return gated + self.conv(self.norm_conv(gated), ctx.state.flash)

    def gated(self, streams: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """The n-gram rows emb [B, T, ple_embed_dim]'s value gated into each stream."""
        key = self.norm_key(self.key_proj(emb)).unflatten(-1, (self.hc, self.hidden))
        value = self.value_proj(emb)
        query = self.norm_query(streams).unflatten(-1, (self.hc, self.hidden))
        gate = (key * query).sum(dim=-1, keepdim=True) / math.sqrt(self.hidden)
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
        return (torch.sigmoid(gate) * value.unsqueeze(-2)).flatten(-2)

    def conv(self, x: torch.Tensor, flash) -> torch.Tensor:
        """SiLU of the dilated causal conv of x [B, T, C] over the layer's window."""
        window = flash.ple_window[self.layer_idx]                 # [B, W, C] float32
        full = torch.cat([window, x.float()], dim=1)              # [B, W + T, C]
        flash.keep_rows(self.layer_idx, full)
        window.copy_(full[:, -window.shape[1]:])
        return self.dilated(full, x.dtype)

    def dilated(self, full: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """SiLU of the conv over [window, block] rows [B, W + T, C] -> [B, T, C]."""
        # in the block's dtype, as the checkpoint's reference computes it (bf16 rounding)
        out = F.conv1d(full.to(dtype).transpose(1, 2), self.conv1d.weight.to(dtype),
                       dilation=self.dilation, groups=full.shape[2])
        return F.silu(out).transpose(1, 2)

    def forward_static(self, streams: torch.Tensor, emb: torch.Tensor, window: torch.Tensor,
                       kept: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """`forward` with static shapes (graphs/compiled_flash_next.py): emb the block's
        n-gram rows, gathered before the graph; window [B, W, C] the state's, updated in
        place; kept [B, W + T, C] receives [window, block] (FlashState.keep_rows: the
        commit's); keep [B, W] which of those rows the window keeps (past the real ones)."""
        gated = self.gated(streams, emb)
        x = self.norm_conv(gated)
        full = torch.cat([window, x.float()], dim=1)
        kept.copy_(full)
        window.copy_(full.gather(1, keep[..., None].expand(-1, -1, full.shape[2])))
        return gated + self.dilated(full, x.dtype)
