"""The target's dense segments: everything between the token mixers, one module each.

For L layers there are L+1 segments. Segment 0 = embedding + layer 0 `pre`; segment i =
layer i-1 `post` + layer i `pre`; segment L = layer L-1 `post` + final norm + lm_head.
Every segment takes and returns flat tuples of tensors so that it exports to ONNX as is:

    segment 0:  (ids)                      -> (x, *mix_inputs, *post_inputs)
    segment i:  (x, core, *post_inputs)    -> (x, *mix_inputs, *post_inputs)
    segment L:  (x, core, *post_inputs)    -> (x, logits)

where `x` is the residual stream (after segment i it is the output of layer i-1, the tap),
`core` the previous mixer's output, `mix_inputs` what the next mixer consumes and
`post_inputs` what the next segment needs to finish that layer (an output gate or z).
The modules share the target's parameters (they are views, not copies).
"""

from __future__ import annotations

import torch
from torch import nn


def layer_arity(layer) -> tuple[int, int]:
    """(mixer inputs, post inputs) a decoder layer's pre part emits."""
    if layer.is_linear:
        return 3, 1
    return 3, int(layer.self_attn.gated)


class FirstSegment(nn.Module):
    def __init__(self, embed: nn.Embedding, layer):
        super().__init__()
        self.embed, self.layer = embed, layer

    def forward(self, ids: torch.Tensor):
        x = self.embed(ids)
        mix, post = self.layer.pre_mixer(x)
        return (x, *mix, *post)


class MiddleSegment(nn.Module):
    def __init__(self, prev, layer):
        super().__init__()
        self.prev, self.layer = prev, layer

    def forward(self, x: torch.Tensor, core: torch.Tensor, *post: torch.Tensor):
        x = self.prev.post_mixer(x, core, post)
        mix, nxt = self.layer.pre_mixer(x)
        return (x, *mix, *nxt)


class LastSegment(nn.Module):
    def __init__(self, prev, norm: nn.Module, head: nn.Module):
        super().__init__()
        self.prev, self.norm = prev, norm
        self.head = head                  # lm_head, or the embedding when they are tied

    def forward(self, x: torch.Tensor, core: torch.Tensor, *post: torch.Tensor):
        x = self.prev.post_mixer(x, core, post)
        return x, (self.norm(x) @ self.head.weight.T).float()


def build_segments(model) -> list[nn.Module]:
    layers = model.layers
    out: list[nn.Module] = [FirstSegment(model.embed_tokens, layers[0])]
    out += [MiddleSegment(layers[i - 1], layers[i]) for i in range(1, len(layers))]
    head = model.embed_tokens if model.lm_head is None else model.lm_head
    out.append(LastSegment(layers[-1], model.norm, head))
    return out
