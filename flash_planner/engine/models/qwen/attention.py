"""Full (softmax) attention layer: Qwen3 plain, or Qwen3.5 gated with partial RoPE.

Split for segment export: `pre` (projections + per-head norms, dense), `mix` (RoPE, KV cache
write, attention over the cache), `post` (output gate + o_proj, dense).
"""

from __future__ import annotations

import torch
from torch import nn

from ....kernels import dispatch
from ...config import ModelConfig
from .cache_attention import cache_attention
from .context import ForwardContext
from .layers import RMSNorm, apply_rope, attention


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.gated = cfg.attn_output_gate
        q_out = cfg.num_heads * cfg.head_dim * (2 if self.gated else 1)
        kv_out = cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_out, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_out, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_out, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.zero_centred_norm)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.zero_centred_norm)

    def pre(self, h: torch.Tensor):
        """h [B, T, hidden] -> mixer inputs (q [B,T,H,D], k, v [B,T,Hkv,D]) and post inputs
        ((gate [B,T,H*D],) when gated, else ())."""
        b, t, _ = h.shape
        q = self.q_proj(h)
        post: tuple[torch.Tensor, ...] = ()
        if self.gated:
            q, gate = q.view(b, t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
            post = (gate.reshape(b, t, self.num_heads * self.head_dim),)
        else:
            q = q.view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(h).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(h).view(b, t, self.num_kv_heads, self.head_dim)
        return (self.q_norm(q), self.k_norm(k), v), post

    def mix(self, inputs: tuple[torch.Tensor, ...], ctx: ForwardContext) -> torch.Tensor:
        """Causal attention of the block over the cached prefix and itself -> [B, T, H*D]."""
        q, k, v = inputs
        q, k = apply_rope(q, ctx.cos, ctx.sin), apply_rope(k, ctx.cos, ctx.sin)
        kv = ctx.state.kv
        kv.append(self.layer_idx, k, v, ctx.positions)
        keys, values = kv.read(self.layer_idx, ctx.key_length)          # [B, L, Hkv, D]
        return self.attend(q, keys, values, ctx.causal_mask)

    def mix_static(self, inputs: tuple[torch.Tensor, ...], cos: torch.Tensor,
                   sin: torch.Tensor, positions: torch.Tensor, key_rows: torch.Tensor,
                   cache: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """`mix` with static shapes (compiled.py): the rows are written at `positions`
        [B, T] of this layer's cache (k, v [B, C, Hkv, D], then their FP8 scales [Hkv], or
        [B, Hkv] for a batch of slots, when the cache is FP8) and attend over its first
        `key_rows` rows (a host int64 [1]: `cache_attention`), each row to the cache rows at
        or before its position (each row of a batch at its own length)."""
        q, k_scale, v_scale = self.write_static(inputs, cos, sin, positions, cache)
        b, t = q.shape[:2]
        out = cache_attention(q, cache[0], cache[1], positions, key_rows, k_scale, v_scale,
                              self.head_dim ** -0.5)
        return out.reshape(b, t, self.num_heads * self.head_dim)

    def write_static(self, inputs: tuple[torch.Tensor, ...], cos: torch.Tensor,
                     sin: torch.Tensor, positions: torch.Tensor,
                     cache: tuple[torch.Tensor, ...]):
        """`mix_static`'s first half: q and k turned, k and v written at `positions` of the
        layer's cache -> (q, the cache's k and v scales or None)."""
        q, k, v = inputs
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_cache, v_cache, *scales = cache
        k_scale, v_scale = scales or (None, None)
        dispatch.kv_append(k_cache, k, positions, k_scale)
        dispatch.kv_append(v_cache, v, positions, v_scale)
        return q, k_scale, v_scale

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
        """q [B, T, H, D] over keys, values [B, L, Hkv, D] where mask [T, L] (or per row
        [B, 1, T, L]) -> [B, T, H*D]."""
        b, t = q.shape[:2]
        out = attention(q, keys, values, mask, self.head_dim ** -0.5)   # [B, T, H, D]
        return out.reshape(b, t, self.num_heads * self.head_dim)

    def post(self, core: torch.Tensor, post: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if self.gated:
            core = core * torch.sigmoid(post[0])
        return self.o_proj(core)
