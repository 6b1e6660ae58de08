"""A batch's rows as the target's dense parts see them: its real rows alone, one sequence.

A batch verifies blocks of different lengths padded to the longest ([B, T] ids). Only the
token mixers need that layout (each row's cache and recurrent state); everything between
them (segments.py: norms, projections, MLPs, lm_head) works row by row. So the eager forward
runs the dense parts on the real rows packed into [1, N] and scatters the mixers' inputs
back to [B, T] with zeros at the padding:

- on a CPU, where a dense part costs about its rows, padding is not computed (a batch's
  blocks are cut by each request's grammar and draft length, so rows differ);
- a dense backend exported for one sequence (ONNX Runtime, TensorRT: a dynamic token
  dimension, a batch of 1) runs a batch's forward as it runs one request's;
- on an MoE target the padding chooses no experts.

Zeros are harmless padding for the mixers: an attention row writes KV past its request's
length (overwritten before anything reads it), and a gated delta-net row with g = 0 and
beta = 0 leaves the recurrent state as it was (the commit rebuilds the conv window from the
rows it keeps, as for any padding).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class PackedRows:
    """Rows i*T .. i*T + real[i] - 1 of a [B, T] batch, packed as [1, N] in batch order."""

    def __init__(self, real: Sequence[int], t: int, device: torch.device):
        if any(not 0 < n <= t for n in real):
            raise ValueError(f"each batch row needs 1..{t} real rows, got {list(real)}")
        self.b, self.t = len(real), t
        self.real = [int(n) for n in real]
        self.n = sum(self.real)
        self.full = self.n == self.b * t          # nothing to drop: reshapes, no copies
        self.index = None if self.full else torch.tensor(
            [i * t + j for i, n in enumerate(self.real) for j in range(n)], device=device)

    def offsets(self) -> list[int]:
        """Where each batch row's real rows start in the packed sequence."""
        out, at = [], 0
        for n in self.real:
            out.append(at)
            at += n
        return out

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, ...] -> [1, N, ...]."""
        flat = x.reshape(self.b * self.t, *x.shape[2:])
        return (flat if self.full else flat.index_select(0, self.index))[None]

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """[1, N, ...] -> [B, T, ...], zeros at the padding."""
        if self.full:
            return x.reshape(self.b, self.t, *x.shape[2:])
        out = x.new_zeros(self.b * self.t, *x.shape[2:])
        out.index_copy_(0, self.index, x[0])
        return out.view(self.b, self.t, *x.shape[2:])
