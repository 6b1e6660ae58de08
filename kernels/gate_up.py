"""The fused MLP input projection's arithmetic, shared by the references and the launchers.

An MLP's gate and up projections read the same x; stacked into one weight [2I, K] (gate rows
first) they run as one GEMM whose epilogue applies SwiGLU's activation: y = silu(x @ gate.T)
* (x @ up.T), in float32, rounded to x's dtype once.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F


def swiglu_halves(h: torch.Tensor) -> torch.Tensor:
    """h [..., 2I] float32 sums (gate's, then up's) -> silu(gate) * up [..., I]."""
    i = h.shape[-1] // 2
    return F.silu(h[..., :i]) * h[..., i:]


def swiglu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K], w float32 [2I, K] (gate rows, then up rows) -> [..., I] in x's dtype."""
    return swiglu_halves(x.float() @ w.T).to(x.dtype)
