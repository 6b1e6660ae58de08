"""Triton rollback: copy the state recorded after the accepted step into the live state.

One launch covers every layer: grid (sequence, layer, block of elements). Blocks below
`state_blocks` copy recurrent-state elements, the rest rebuild the conv window. A sequence
whose accepted step is the block's last (it accepted every draft), or out of range, is left
untouched. Copies only: the state and the conv window may have any dtype, but one dtype for
both (the two branches must load pointers of one type to compile for a GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..specs import Spec, launch

BLOCK = 1024


@triton.jit
def _select_kernel(state, step_states, conv, conv_rows, step, num_steps, slots, num_seqs,
                   state_numel, conv_numel, conv_row_numel, state_blocks,
                   BLOCK: tl.constexpr):
    b = tl.program_id(0)
    layer = tl.program_id(1)
    blk = tl.program_id(2)
    n = tl.load(step + b)
    if (n >= 0) & (n < num_steps - 1):
        lb = (layer * num_seqs + b).to(tl.int64)
        if blk < state_blocks:
            offs = blk * BLOCK + tl.arange(0, BLOCK)
            keep = offs < state_numel
            src = step_states + (lb * slots + n) * state_numel + offs
            tl.store(state + lb * state_numel + offs, tl.load(src, mask=keep), mask=keep)
        else:
            offs = (blk - state_blocks) * BLOCK + tl.arange(0, BLOCK)
            keep = offs < conv_numel
            # rows n+1 .. n+K-1 of [window before the block ; block rows]
            rows_base = lb * (conv_numel + slots * conv_row_numel)
            src = conv_rows + rows_base + (n + 1) * conv_row_numel + offs
            tl.store(conv + lb * conv_numel + offs, tl.load(src, mask=keep), mask=keep)


def checkpoint_select(
    state: torch.Tensor,
    step_states: torch.Tensor,
    conv_state: torch.Tensor,
    conv_rows: torch.Tensor,
    step: torch.Tensor,
    num_steps: int,
) -> None:
    """Same contract as the reference: state [L, B, Hv, Dk, Dv], step_states
    [L, B, S, Hv, Dk, Dv], conv_state [L, B, K-1, C], conv_rows [L, B, K-1+S, C], step [B]."""
    layers, seqs = state.shape[:2]
    slots = step_states.shape[2]
    for name, t in (("state", state), ("step_states", step_states), ("conv_state", conv_state),
                    ("conv_rows", conv_rows)):
        if not t.is_contiguous():
            raise ValueError(f"checkpoint_select: {name} must be contiguous")
    if len({state.dtype, step_states.dtype, conv_state.dtype, conv_rows.dtype}) != 1:
        raise ValueError("checkpoint_select: the state, the conv window and their checkpoints "
                         "must share one dtype")
    if conv_rows.shape[2] != conv_state.shape[2] + slots:
        raise ValueError("checkpoint_select: conv_rows must hold K-1 + S rows")
    if layers == 0 or seqs == 0:
        return
    state_numel = state[0, 0].numel()
    conv_numel = conv_state[0, 0].numel()
    state_blocks = triton.cdiv(state_numel, BLOCK)
    grid = (seqs, layers, state_blocks + triton.cdiv(max(conv_numel, 1), BLOCK))
    # Buffers hold `slots` steps (their allocation); the block used num_steps of them.
    args = dict(state=state, step_states=step_states, conv=conv_state, conv_rows=conv_rows,
                step=step.to(torch.int64).contiguous(), num_steps=num_steps, slots=slots,
                num_seqs=seqs, state_numel=state_numel, conv_numel=conv_numel,
                conv_row_numel=conv_state.shape[-1], state_blocks=state_blocks)
    launch(_select_kernel, grid, args, meta())


def meta() -> dict:
    """Constexprs and launch options (the same for every shape: a plain copy)."""
    return {"BLOCK": BLOCK, "num_warps": 4, "num_stages": 3}


_INTS = ("num_steps", "slots", "num_seqs", "state_numel", "conv_numel", "conv_row_numel",
         "state_blocks")
# The engine keeps the GDN state, its checkpoints and the conv window in float32.
SPECS = (
    Spec.from_meta(_select_kernel, "fp32 state and conv window",
                   {"state": "*fp32", "step_states": "*fp32", "conv": "*fp32",
                    "conv_rows": "*fp32", "step": "*i64", **dict.fromkeys(_INTS, "i32")},
                   meta()),
)
