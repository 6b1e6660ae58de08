"""Plain-torch y = x @ W.T for int4 weights with a scale and a zero point per group along K.

Layout (the engine's; AWQ, GPTQ and compressed-tensors checkpoints are repacked into it at
load): `packed` uint8 [N, ceil(K / 2)], element 2j in the low nibble, values 0..15;
`scale` float32 [N, ceil(K / group)]; `zero` uint8 [N, ceil(K / group)], values 0..15
(8 for symmetric schemes): W[n, k] = (q[n, k] - zero[n, k // group]) * scale[n, k // group].
The last group may be partial. Accumulation is float32; y has x's dtype.
"""

from __future__ import annotations

import torch

from ..gate_up import swiglu


def unpack_int4(packed: torch.Tensor, k: int) -> torch.Tensor:
    """uint8 [N, ceil(K / 2)] -> uint8 [N, K], low nibble first."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)[:, :k]


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    group: int, k: int) -> torch.Tensor:
    """The float32 weight [N, K]."""
    q = unpack_int4(packed, k).float()
    s = scale.float().repeat_interleave(group, 1)[:, :k]
    z = zero.float().repeat_interleave(group, 1)[:, :k]
    return (q - z) * s


def int4_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
              group: int) -> torch.Tensor:
    """x [..., K] -> [..., N]."""
    w = dequantize_int4(packed, scale, zero, group, x.shape[-1])
    return (x.float() @ w.T).to(x.dtype)


def int4_gate_up(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                 zero: torch.Tensor, group: int) -> torch.Tensor:
    """x [..., K] -> silu(x @ gate.T) * (x @ up.T) [..., I]; packed, scale and zero: gate
    rows, then up rows."""
    return swiglu(x, dequantize_int4(packed, scale, zero, group, x.shape[-1]))
