"""Gated DeltaNet (linear attention) layer of the Qwen3.5/3.6 hybrid.

Split for segment export: `pre` (projections, beta and g, dense), `mix` (causal depthwise
conv over the conv window + the gated delta recurrence, optionally recording per-step
checkpoints), `post` (gated RMSNorm + out_proj, dense).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels import dispatch
from ..config import ModelConfig
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
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
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
        qkv, g, beta = inputs
        b, t, _ = qkv.shape
        gdn = ctx.state.gdn
        slot = gdn.slot[self.layer_idx]
        window = gdn.conv[slot]                                       # [B, K-1, C]
        k1 = window.shape[1]
        x = qkv.float()
        if ctx.record_steps:
            gdn.conv_rows[slot, :, :k1] = window
            gdn.conv_rows[slot, :, k1:k1 + t] = x
        full = torch.cat((window, x), dim=1)                          # [B, K-1+T, C]
        # causal depthwise conv as one windowed product in the [B, T, C] layout: on a CPU,
        # cheaper than conv1d with its transposes (plain decode of the demo model: +19%)
        taps = full.unfold(1, self.kernel, 1)                         # [B, T, C, K]
        conv = (taps * self.conv1d.weight[:, 0].float()).sum(dim=-1)  # [B, T, C]
        conv = F.silu(conv).to(qkv.dtype)
        if k1:
            window.copy_(full[:, -k1:])
        key_dim = self.hk * self.dk
        q, k, v = conv.split((key_dim, key_dim, self.hv * self.dv), dim=-1)
        q = q.reshape(b, t, self.hk, self.dk)
        k = k.reshape(b, t, self.hk, self.dk)
        v = v.reshape(b, t, self.hv, self.dv)
        steps = gdn.step_states[slot] if ctx.record_steps else None
        return dispatch.gdn_steps(q, k, v, g, beta, gdn.state[slot], steps)

    def post(self, core: torch.Tensor, post: tuple[torch.Tensor, ...]) -> torch.Tensor:
        b, t = core.shape[:2]
        z = post[0].reshape(b, t, self.hv, self.dv)
        return self.out_proj(self.norm(core, z).reshape(b, t, self.hv * self.dv))
