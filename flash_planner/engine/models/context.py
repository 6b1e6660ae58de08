"""What one forward pass shares across its layers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache import InferenceState


@dataclass(frozen=True)
class ForwardContext:
    state: InferenceState
    start: int                 # absolute position of the block's first row
    positions: torch.Tensor    # [B, T] absolute positions
    cos: torch.Tensor          # [B, T, rotary_dim]
    sin: torch.Tensor
    record_steps: bool         # keep per-step GDN checkpoints for a later partial commit
    causal_mask: torch.Tensor  # [T, start+T]: key position <= query position (all layers)
