"""After loading: each MLP's quantized gate and up projections stacked into one module.

SwiGLU reads x twice (gate and up) and writes two [M, I] results only to multiply them. With
both in one quantized layout, their packed buffers stacked row-wise (gate rows first) make
one weight [2I, K] whose GEMM (kernels/<format>_gemm: `*_gate_up`) reads x once and applies
silu(gate) * up in its epilogue: one launch instead of three, and no [M, 2I] round trip
through memory. The stacked module is the gate's family with `gated` set, at `mlp.gate_up`;
the two originals are dropped (the stacked buffers are copies, so memory does not double).
Projections in full precision, in two formats, or whose FP8 scale blocks would straddle the
seam stay as they are.
"""

from __future__ import annotations

import torch
from torch import nn

from .linear import QuantLinear


def stack_gate_up(gate: QuantLinear, up: QuantLinear) -> QuantLinear:
    """The gate module, turned into the gated one over [gate; up] (the caller checked
    `gate.stacks_with(up)`)."""
    for name in gate.packed_specs():
        gate.register_buffer(name, torch.cat((getattr(gate, name), getattr(up, name))))
    gate.out_features *= 2
    gate.gated = True
    return gate


def fuse_gate_up(module: nn.Module) -> int:
    """Stack every MLP's gate and up projections under `module` where they stack (an MLP is
    a module with `gate_proj`, `up_proj` and a `gate_up` slot); returns how many."""
    count = 0
    for mlp in list(module.modules()):
        gate, up = getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)
        if not (hasattr(mlp, "gate_up") and isinstance(gate, QuantLinear)
                and isinstance(up, QuantLinear) and gate.stacks_with(up)):
            continue
        mlp.gate_up = stack_gate_up(gate, up)
        del mlp.gate_proj, mlp.up_proj
        count += 1
    return count
