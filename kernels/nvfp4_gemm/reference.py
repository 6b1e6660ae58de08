"""Plain-torch y = x @ W.T for NVFP4 weights (E2M1 values, an e4m3 scale per 16, fp32 scale).

Layout: `packed` uint8 [N, K / 2], element 2j in the low nibble and 2j + 1 in the high one
(ModelOpt's and compressed-tensors' order); `scale` uint8 [N, K / 16] holding e4m3 bit
patterns; `global_scale` float32 with one element, a multiplier (ModelOpt's weight_scale_2;
the reciprocal of compressed-tensors' weight_global_scale):
W[n, k] = E2M1[nibble(n, k)] * e4m3(scale[n, k // 16]) * global_scale. K is a multiple of 16.
Accumulation is float32; y has x's dtype.
"""

from __future__ import annotations

import torch

from ..gate_up import swiglu

GROUP = 16
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K / 2] -> uint8 [N, K], low nibble first."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def dequantize_nvfp4(packed: torch.Tensor, scale: torch.Tensor,
                     global_scale: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K]. `global_scale` holds one scale, or one per equal run of rows
    (a gate and up projection stacked: [2], gate's then up's)."""
    table = torch.tensor(E2M1, dtype=torch.float32, device=packed.device)
    values = table[unpack_nibbles(packed).long()]
    s = scale.view(torch.float8_e4m3fn).float().repeat_interleave(GROUP, 1)
    per_run = global_scale.float().reshape(-1)
    return values * s * per_run.repeat_interleave(packed.shape[0] // per_run.numel())[:, None]


def nvfp4_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
               global_scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> [..., N]."""
    w = dequantize_nvfp4(packed, scale, global_scale)
    return (x.float() @ w.T).to(x.dtype)


def nvfp4_gate_up(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                  global_scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> silu(x @ gate.T) * (x @ up.T) [..., I]; packed [2I, K / 2]: gate rows,
    then up rows; global_scale [2]: gate's, then up's."""
    return swiglu(x, dequantize_nvfp4(packed, scale, global_scale))
