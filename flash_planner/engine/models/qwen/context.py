"""What one forward pass shares across its layers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...config import RopeConfig
from ...state.cache import InferenceState
from .layers import mrope_cos_sin, rope_cos_sin


@dataclass(frozen=True)
class ForwardContext:
    state: InferenceState
    positions: torch.Tensor    # [B, T] absolute positions
    cos: torch.Tensor          # [B, T, rotary_dim]
    sin: torch.Tensor
    record_steps: bool         # a verify: GDN rows kept for the commit, the state not advanced
    # key position <= query position: [T, L] when every row starts at one position, else
    # [B, 1, T, L] (a batch of requests, each at its own length)
    causal_mask: torch.Tensor
    key_length: int            # L: the cache rows attention reads (the furthest row's end)

    @classmethod
    def open(cls, state: InferenceState, batch: int, rows: int, rope: RopeConfig,
             dtype: torch.dtype, device: torch.device, record_steps: bool = False,
             rope_positions: torch.Tensor | None = None) -> ForwardContext:
        """Open a forward over `rows` rows at the state's next positions (`state.begin`:
        one start for every row, or, for a batch of slots, one start per row). The rotary
        positions are the rows' shifted by the state's `rope_shift`, or `rope_positions`
        [3, rows] (t, h, w) of one sequence whose rows hold image tokens (mRoPE)."""
        start: int | Sequence[int] = state.begin(rows, record_steps)
        block = torch.arange(rows, device=device)
        if isinstance(start, int):
            positions = (block + start).expand(batch, rows)
            length = start + rows
            mask = torch.arange(length, device=device)[None, :] <= positions[0, :, None]
        else:
            positions = torch.tensor(start, device=device)[:, None] + block
            length = max(start) + rows
            key_pos = torch.arange(length, device=device)
            mask = (key_pos[None, None, :] <= positions[:, :, None])[:, None]
        if rope_positions is not None:
            if rope.mrope_section is None or batch != 1:
                raise ValueError("per-axis rotary positions need an mRoPE target and one "
                                 "sequence")
            cos, sin = mrope_cos_sin(rope_positions[:, None].to(device), rope.rotary_dim,
                                     rope.theta, rope.mrope_section, dtype)
        else:
            shift = state.rope_shift         # one per slot of a batch; 0 without images
            if isinstance(shift, list):
                shift = torch.tensor(shift, device=device)[:, None] if any(shift) else 0
            turned = positions + shift if not isinstance(shift, int) or shift else positions
            cos, sin = rope_cos_sin(turned, rope.rotary_dim, rope.theta, dtype)
        return cls(state, positions, cos, sin, record_steps, mask, length)
