"""Gated DeltaNet (linear attention) layer of the Qwen3.5/3.6 hybrid.

Split for segment export: `pre` (projections, beta and g, dense), `mix` (causal depthwise
conv over the conv window + the gated delta recurrence; a verify keeps its rows for the
commit instead of advancing the state), `post` (gated RMSNorm + out_proj, dense).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ....kernels import dispatch
from ...config import ModelConfig
from .context import ForwardContext
from .layers import GatedRMSNorm


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.kernel = cfg.linear_conv_kernel
        value_dim = self.hv * self.dv
        self.conv_dim = cfg.gdn_conv_dim
        self.in_proj_qkv = nn.Linear(cfg.hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(cfg.hidden_size, value_dim, bias=False)
        self.in_proj_b = nn.Linear(cfg.hidden_size, self.hv, bias=False)
        self.in_proj_a = nn.Linear(cfg.hidden_size, self.hv, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, bias=False,
                                groups=self.conv_dim)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps, cfg.flash_next.output_gate
                                 if cfg.flash_next is not None else "silu")
        self.out_proj = nn.Linear(value_dim, cfg.hidden_size, bias=False)

    def pre(self, h: torch.Tensor):
        """h [B, T, hidden] -> mixer inputs (qkv [B,T,conv_dim], g [B,T,Hv], beta [B,T,Hv])
        and post inputs (z [B,T,Hv*Dv],)."""
        beta = torch.sigmoid(self.in_proj_b(h))
        # float32 so that exp(A_log) cannot overflow in half precision
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(h).float() + self.dt_bias)
        return (self.in_proj_qkv(h), g, beta), (self.in_proj_z(h),)

    def mix(self, inputs: tuple[torch.Tensor, ...], ctx: ForwardContext) -> torch.Tensor:
        """Conv + gated delta rule over the block -> o [B, T, Hv, Dv]."""
        gdn = ctx.state.gdn
        slot = gdn.slot[self.layer_idx]
        kept = gdn.kept(slot) if ctx.record_steps else ()
        return self.recur(inputs, gdn.state[slot], gdn.conv[slot], *kept)

    def mix_static(self, inputs: tuple[torch.Tensor, ...], valid: torch.Tensor,
                   window_rows: torch.Tensor, cache: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """`mix` with static shapes (compiled.py) over a block padded past its real rows:
        valid [B, T] marks them. Padding rows get g = 0 and beta = 0, so they leave the
        recurrent state as it was (S = S * e^0 + 0), and each row's conv window takes the
        last real rows of its [window, block] (`window_rows` [B, K-1]: a padding row of a
        batch keeps its window, rows 0..K-2). cache: this layer's (state, conv window), then
        its kept rows (k, delta, g, conv rows) when recording."""
        qkv, g, beta = inputs
        real = valid[:, :, None]
        g = torch.where(real, g, torch.zeros_like(g))
        beta = torch.where(real, beta, torch.zeros_like(beta))
        return self.recur((qkv, g, beta), *cache, window_rows=window_rows)

    def recur(self, inputs: tuple[torch.Tensor, ...], state: torch.Tensor,
              window: torch.Tensor, k_rows: torch.Tensor | None = None,
              delta_rows: torch.Tensor | None = None, g_rows: torch.Tensor | None = None,
              conv_rows: torch.Tensor | None = None,
              window_rows: torch.Tensor | None = None) -> torch.Tensor:
        """The block through the conv window [B, K-1, C], updated in place, and the
        recurrent state [B, Hv, Dk, Dv]: updated in place, or, with the kept-row buffers
        (cache.GDNState.kept), left as it was while the block's rows are kept for the commit.
        window_rows [B, K-1]: which rows of each row's [window, block] its window keeps
        (default: the last K-1)."""
        qkv, g, beta = inputs
        b, t, _ = qkv.shape
        k1 = window.shape[1]
        x = qkv.float()
        if conv_rows is not None:
            conv_rows[:, :k1] = window
            conv_rows[:, k1:k1 + t] = x
        full = torch.cat((window, x), dim=1)                          # [B, K-1+T, C]
        # causal depthwise conv as one windowed product in the [B, T, C] layout: on a CPU,
        # cheaper than conv1d with its transposes (plain decode of the demo model: +19%)
        taps = full.unfold(1, self.kernel, 1)                         # [B, T, C, K]
        conv = (taps * self.conv1d.weight[:, 0].float()).sum(dim=-1)  # [B, T, C]
        conv = F.silu(conv).to(qkv.dtype)
        if k1:
            window.copy_(full[:, -k1:] if window_rows is None else full.gather(
                1, window_rows[:, :, None].expand(-1, -1, full.shape[2])))
        key_dim = self.hk * self.dk
        q, k, v = conv.split((key_dim, key_dim, self.hv * self.dv), dim=-1)
        q = q.reshape(b, t, self.hk, self.dk)
        k = k.reshape(b, t, self.hk, self.dk)
        v = v.reshape(b, t, self.hv, self.dv)
        rows = None if delta_rows is None else (k_rows, delta_rows, g_rows)
        return dispatch.gdn_steps(q, k, v, g, beta, state, rows)

    def post(self, core: torch.Tensor, post: tuple[torch.Tensor, ...]) -> torch.Tensor:
        b, t = core.shape[:2]
        z = post[0].reshape(b, t, self.hv, self.dv)
        return self.out_proj(self.norm(core, z).reshape(b, t, self.hv * self.dv))
