"""Hyper-connections (Qwen3.8-Flash-Next): a residual of `hc` streams instead of one.

Before each mixer and each MoE, `HyperMixer` reads the streams [.., hc * H] through a norm
per stream, a low-rank gate per stream and feature, and their mean: one block input [.., H].
It also gives each stream its injection gate, 2 * sigmoid(.) in [0, 2]: the block's output
goes back into stream s scaled by gate s (`inject`). The model's last mixer has no gates: its
mean of the streams is what lm_head reads (there is no final norm).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GroupedRMSNorm(nn.Module):
    """Zero-centred RMSNorm ((1 + w) x_hat, float32) over groups of `group` features: one
    norm per stream of a [.., hc * H] residual (group H), or a plain one (group = dim)."""

    def __init__(self, dim: int, group: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.group, self.eps = group, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return grouped_rms_norm(x, self.weight, self.group, self.eps)


def grouped_rms_norm(x: torch.Tensor, weight: torch.Tensor, group: int, eps: float
                     ) -> torch.Tensor:
    """GroupedRMSNorm's arithmetic on its tensors (the QSA attention op norms with it)."""
    xf = x.float().unflatten(-1, (-1, group))
    xf = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)
    return (xf * (1.0 + weight.float())).type_as(x)


class HyperMixer(nn.Module):
    def __init__(self, hidden: int, hc: int, rank: int, eps: float, gates: bool = True):
        super().__init__()
        self.hidden, self.hc = hidden, hc
        self.hc_norm = GroupedRMSNorm(hc * hidden, hidden, eps)
        self.input_mix_weight_down = nn.Linear(hc * hidden, rank, bias=False)
        self.input_mix_weight_up = nn.Linear(rank, hc * hidden, bias=False)
        self.block_inject_weight = nn.Linear(hc * hidden, hc, bias=False) if gates else None

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """streams [.., hc * H] -> (the block input [.., H], injection gates [.., hc] or None
        for the last mixer)."""
        normed = self.hc_norm(streams)
        mix = F.silu(self.input_mix_weight_down(normed) / self.hc)
        mix = torch.sigmoid(self.input_mix_weight_up(mix)).unflatten(-1, (self.hc, self.hidden))
        block_input = (mix * normed.unflatten(-1, (self.hc, self.hidden))).mean(dim=-2)
        if self.block_inject_weight is None:
            return block_input, None
        return block_input, 2 * torch.sigmoid(self.block_inject_weight(normed) / self.hc)


def inject(streams: torch.Tensor, output: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """streams [.., hc * H] + the block's output [.., H] scaled per stream by gates [.., hc]."""
    return streams + (output.unsqueeze(-2) * gates.unsqueeze(-1)).flatten(-2)
