"""Bytes of weights a module holds, and the bytes one forward reads (decode is bound by it).

A forward reads every weight once, except an untied input embedding, of which it reads only
the rows of its tokens (counted as none), and the expert stacks of a mixture of experts, of
which it reads the experts its rows chose (`experts_read` per stack: top-k for one row; a
verify block of n rows reads the union of its rows' choices). Works on the meta device, so a
27B-shaped model can be counted without its data.
"""

from __future__ import annotations

from torch import nn


def module_bytes(module: nn.Module) -> int:
    return (sum(p.nbytes for p in module.parameters())
            + sum(b.nbytes for b in module.buffers()))


def expert_stacks(model: nn.Module) -> list[nn.Module]:
    """The modules holding E experts' weights of one projection (`expert_count` > 0)."""
    return [m for m in model.modules() if getattr(m, "expert_count", 0)]


def bytes_per_forward(model: nn.Module, experts_read: float | None = None) -> int:
    """Bytes one forward reads; `experts_read`: experts read per stack (None: all)."""
    total = module_bytes(model)
    embed = getattr(model, "embed_tokens", None)
    if embed is not None and getattr(model, "lm_head", None) is not None:
        total -= embed.weight.nbytes
    if experts_read is not None:
        for stack in expert_stacks(model):
            count = stack.expert_count
            total -= module_bytes(stack) * (1 - min(experts_read, count) / count)
    return int(total)
