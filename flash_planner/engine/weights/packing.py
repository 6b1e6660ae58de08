"""Integer helpers shared by the packed formats: ceil division and 4-bit nibble packing."""

from __future__ import annotations

import torch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [N, K] -> [N, ceil(K / 2)], element 2j in the low nibble."""
    if q.shape[1] % 2:
        q = torch.cat((q, q.new_zeros(q.shape[0], 1)), dim=1)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def word_nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, W] -> uint8 [R, 8 W]: nibble p of word w at column 8 w + p."""
    shifts = torch.arange(0, 32, 4, device=words.device, dtype=torch.int32)
    return ((words[..., None] >> shifts) & 0xF).to(torch.uint8).flatten(-2)
