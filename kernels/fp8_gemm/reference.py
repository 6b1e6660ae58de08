"""Plain-torch y = x @ W.T for FP8 e4m3 weights with one scale per (block_n x block_k) block.

Layout (the engine's, whatever the checkpoint's): `weight` uint8 [N, K] holding e4m3 bit
patterns (uint8 because CPU torch cannot index float8 tensors everywhere, and so both sides
take one pointer type); `scale` float32 [ceil(N / block_n), ceil(K / block_k)], a
multiplier: W[n, k] = e4m3(weight[n, k]) * scale[n // block_n, k // block_k]. Per-channel
scales are block_n = 1. Accumulation is float32; y has x's dtype.
"""

from __future__ import annotations

import torch

from ..gate_up import swiglu


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block_n: int,
                   block_k: int) -> torch.Tensor:
    """The float32 weight [N, K]."""
    n, k = weight.shape
    s = scale.float().repeat_interleave(block_n, 0)[:n].repeat_interleave(block_k, 1)[:, :k]
    return weight.view(torch.float8_e4m3fn).float() * s


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int,
             block_k: int) -> torch.Tensor:
    """x [..., K] -> [..., N]."""
    w = dequantize_fp8(weight, scale, block_n, block_k)
    return (x.float() @ w.T).to(x.dtype)


def fp8_gate_up(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int,
                block_k: int) -> torch.Tensor:
    """x [..., K] -> silu(x @ gate.T) * (x @ up.T) [..., I]; weight [2I, K]: gate rows, then
    up rows (I a multiple of block_n)."""
    return swiglu(x, dequantize_fp8(weight, scale, block_n, block_k))
