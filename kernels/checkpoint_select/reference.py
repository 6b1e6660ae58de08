"""Plain-torch rollback of the GDN recurrent and conv state to an accepted step.

Shapes: state [L, B, Hv, Dk, Dv]; step_states [L, B, S, Hv, Dk, Dv] (state after each step);
conv_state [L, B, K-1, C]; conv_rows [L, B, K-1+S, C] = the conv window before the block
followed by the block's S pre-conv rows; step [B] int64 = index of the last kept step.
"""

from __future__ import annotations

import torch


def checkpoint_select(
    state: torch.Tensor,
    step_states: torch.Tensor,
    conv_state: torch.Tensor,
    conv_rows: torch.Tensor,
    step: torch.Tensor,
    num_steps: int,
) -> None:
    """Roll every layer's live state back to step[b] of a `num_steps` block, in place.

    Sequences with step[b] == num_steps - 1 accepted every step: their live state already is
    the final one and is left untouched.
    """
    k1 = conv_state.shape[2]
    for b in range(step.shape[0]):
        n = int(step[b])
        if not 0 <= n < num_steps:
            raise ValueError(f"step {n} outside a block of {num_steps} steps")
        if n == num_steps - 1:
            continue
        state[:, b].copy_(step_states[:, b, n])
        # Window after step n = the K-1 rows ending at block row n.
        conv_state[:, b].copy_(conv_rows[:, b, n + 1:n + 1 + k1])
