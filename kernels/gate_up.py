"""The fused MLP input projection's reference arithmetic, shared by the formats' references.

An MLP's gate and up projections read the same x; stacked into one weight [2I, K] (gate rows
first) they run as one GEMM whose epilogue applies SwiGLU's activation: y = silu(x @ gate.T)
* (x @ up.T), in float32, rounded to x's dtype once.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F


def swiglu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K], w float32 [2I, K] (gate rows, then up rows) -> [..., I] in x's dtype."""
    h = x.float() @ w.T
    i = w.shape[0] // 2
    return (F.silu(h[..., :i]) * h[..., i:]).to(x.dtype)
