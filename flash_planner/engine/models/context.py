"""What one forward pass shares across its layers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache import InferenceState
from ..config import RopeConfig
from .layers import rope_cos_sin


@dataclass(frozen=True)
class ForwardContext:
    state: InferenceState
    start: int                 # absolute position of the block's first row
    positions: torch.Tensor    # [B, T] absolute positions
    cos: torch.Tensor          # [B, T, rotary_dim]
    sin: torch.Tensor
    record_steps: bool         # keep per-step GDN checkpoints for a later partial commit
    causal_mask: torch.Tensor  # [T, start+T]: key position <= query position (all layers)

    @classmethod
    def open(cls, state: InferenceState, batch: int, rows: int, rope: RopeConfig,
             dtype: torch.dtype, device: torch.device, record_steps: bool = False
             ) -> ForwardContext:
        """Open a forward over `rows` rows at the state's next positions (`state.begin`)."""
        start = state.begin(rows, record_steps)
        positions = torch.arange(start, start + rows, device=device).expand(batch, rows)
        cos, sin = rope_cos_sin(positions, rope.rotary_dim, rope.theta, dtype)
        key_pos = torch.arange(start + rows, device=device)
        mask = key_pos[None, :] <= positions[0, :, None]
        return cls(state, start, positions, cos, sin, record_steps, mask)
