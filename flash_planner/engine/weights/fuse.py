"""After loading: each MLP's gate and up projections stacked into one module.

SwiGLU reads x twice (gate and up) and writes two [M, I] results only to multiply them. With
both in one quantized layout, their packed buffers stacked row-wise (gate rows first) make
one weight [2I, K] whose GEMM (kernels/<format>_gemm: `*_gate_up`) reads x once and applies
silu(gate) * up in its epilogue: one launch instead of three, and no [M, 2I] round trip
through memory. A mixture of experts' gate and up stacks, quantized or in full precision,
stack per expert the same way ([E, 2I, K]; kernels/moe_gemm with `gated`). The stacked module
is the gate's, with `gated` set, at `gate_up`; the two originals are dropped (the stacked
buffers are copies, so memory does not double). Dense projections in full precision (torch's
GEMM and inductor's fusion serve them), projections in two formats, or whose FP8 scale
blocks would straddle the seam stay as they are.
"""

from __future__ import annotations

import torch
from torch import nn

from .experts import ExpertLinear
from .linear import QuantLinear


def stack_gate_up(gate: nn.Module, up: nn.Module) -> nn.Module:
    """The gate module, turned into the gated one over [gate; up], per expert for stacks
    (the caller checked that they stack: `stackable`)."""
    dim = 1 if gate.expert_count else 0                 # an expert stack's N is its dim 1
    if isinstance(gate, ExpertLinear):
        gate.weight = nn.Parameter(torch.cat((gate.weight, up.weight), dim).detach(),
                                   requires_grad=gate.weight.requires_grad)
    else:
        for name in gate.packed_specs():
            gate.register_buffer(name, torch.cat((getattr(gate, name), getattr(up, name)),
                                                 dim))
    gate.out_features *= 2
    gate.gated = True
    return gate


def stackable(gate: nn.Module | None, up: nn.Module | None) -> bool:
    """Whether gate and up stack into one weight (one format and its parameters)."""
    if isinstance(gate, QuantLinear) and isinstance(up, QuantLinear):
        return gate.stacks_with(up)
    return (isinstance(gate, ExpertLinear) and isinstance(up, ExpertLinear)
            and not (gate.gated or up.gated) and gate.weight.shape == up.weight.shape
            and gate.weight.dtype == up.weight.dtype)


def fuse_gate_up(module: nn.Module) -> int:
    """Stack every MLP's (and every mixture of experts') gate and up projections under
    `module` where they stack (a module with `gate_proj`, `up_proj` and a `gate_up` slot);
    returns how many."""
    count = 0
    for mlp in list(module.modules()):
        gate, up = getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)
        if not (hasattr(mlp, "gate_up") and stackable(gate, up)):
            continue
        mlp.gate_up = stack_gate_up(gate, up)
        del mlp.gate_proj, mlp.up_proj
        count += 1
    return count
