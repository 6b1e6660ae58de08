"""Bytes of weights a module holds, and the bytes one forward reads (decode is bound by it).

A forward reads every weight once, except an untied input embedding, of which it reads only
the rows of its tokens (counted as none). Works on the meta device, so a 27B-shaped model
can be counted without its data.
"""

from __future__ import annotations

from torch import nn


def module_bytes(module: nn.Module) -> int:
    return (sum(p.nbytes for p in module.parameters())
            + sum(b.nbytes for b in module.buffers()))


def bytes_per_forward(model: nn.Module) -> int:
    total = module_bytes(model)
    embed = getattr(model, "embed_tokens", None)
    if embed is not None and getattr(model, "lm_head", None) is not None:
        total -= embed.weight.nbytes
    return total
