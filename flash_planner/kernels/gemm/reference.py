"""Plain-torch weight-only GEMMs: dequantize to float32, then matmul. The launchers in ops.py
have these names and signatures.

Layouts (the engine's, whatever the checkpoint's; formats.py holds them as a table):
  fp8    `weight` uint8 [N, K] of e4m3 bits (uint8: CPU torch cannot index float8 tensors
         everywhere); `scale` float32 [ceil(N / block_n), ceil(K / block_k)], a multiplier:
         W[n, k] = e4m3(weight[n, k]) * scale[n // block_n, k // block_k]. Per-channel scales
         are block_n = 1.
  nvfp4  `packed` uint8 [N, K / 2], value 2j in the low nibble of byte j (ModelOpt's and
         compressed-tensors' order); `scale` uint8 [N, K / 16] of e4m3 bits; `global_scale`
         float32, one value (ModelOpt's weight_scale_2; the reciprocal of compressed-tensors'
         weight_global_scale): W = E2M1[nibble] * e4m3(scale[n, k // 16]) * global_scale.
  int4   `packed` uint8 [N, ceil(K / 2)], low nibble first, values 0..15; `scale` float32 and
         `zero` uint8 [N, ceil(K / group)] (zero 8 for symmetric schemes; AWQ, GPTQ and
         compressed-tensors are repacked so at load): W = (q - zero) * scale per group.
y has x's dtype, accumulated in float32.

Gate and up (`*_gate_up`, `gated=True`): an MLP's two input projections stacked [2I, K], gate
rows first (nvfp4: a global scale per half, [2]; fp8: I a multiple of block_n), one GEMM
whose epilogue is SwiGLU's: y = silu(x @ gate.T) * (x @ up.T), rounded once.

Experts (`moe_*`): y[m, j] = x[m, j or 0] @ W[topk_ids[m, j]].T with x [M, S, K] (S == 1:
every chosen expert reads the row, the gate and up projections; S == k: slot j reads x[m, j],
the down projection), topk_ids [M, k] int32 or int64 (distinct per row, in [0, E)), the
weights stacked E first (nvfp4's global_scale [E], or [E, 2] gated), y [M, k, N].
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional as F

from .checks import check_experts
from .context import tracing
from .formats import NVFP4_GROUP

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def swiglu_halves(h: torch.Tensor) -> torch.Tensor:
    """h [..., 2I] float32 sums (gate's, then up's) -> silu(gate) * up [..., I]."""
    i = h.shape[-1] // 2
    return F.silu(h[..., :i]) * h[..., i:]


def _matmul(x: torch.Tensor, w: torch.Tensor, gated: bool) -> torch.Tensor:
    y = x.float() @ w.T
    return (swiglu_halves(y) if gated else y).to(x.dtype)


def unpack_nibbles(packed: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """uint8 [N, ceil(K / 2)] -> uint8 [N, K], low nibble first."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)[:, :k]


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block_n: int,
                   block_k: int) -> torch.Tensor:
    """The float32 weight [N, K]."""
    n, k = weight.shape
    s = scale.float().repeat_interleave(block_n, 0)[:n].repeat_interleave(block_k, 1)[:, :k]
    return weight.view(torch.float8_e4m3fn).float() * s


def dequantize_nvfp4(packed: torch.Tensor, scale: torch.Tensor,
                     global_scale: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K]; `global_scale` holds one value, or one per equal run of
    rows (gate's and up's)."""
    table = torch.tensor(E2M1, dtype=torch.float32, device=packed.device)
    values = table[unpack_nibbles(packed).long()]
    s = scale.view(torch.float8_e4m3fn).float().repeat_interleave(NVFP4_GROUP, 1)
    per_run = global_scale.float().reshape(-1)
    return values * s * per_run.repeat_interleave(packed.shape[0] // per_run.numel())[:, None]


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    group: int, k: int) -> torch.Tensor:
    """The float32 weight [N, K]."""
    q = unpack_nibbles(packed, k).float()
    s = scale.float().repeat_interleave(group, 1)[:, :k]
    z = zero.float().repeat_interleave(group, 1)[:, :k]
    return (q - z) * s


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int,
             block_k: int) -> torch.Tensor:
    return _matmul(x, dequantize_fp8(weight, scale, block_n, block_k), False)


def fp8_gate_up(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int,
                block_k: int) -> torch.Tensor:
    return _matmul(x, dequantize_fp8(weight, scale, block_n, block_k), True)


def nvfp4_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
               global_scale: torch.Tensor) -> torch.Tensor:
    return _matmul(x, dequantize_nvfp4(packed, scale, global_scale), False)


def nvfp4_gate_up(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                  global_scale: torch.Tensor) -> torch.Tensor:
    return _matmul(x, dequantize_nvfp4(packed, scale, global_scale), True)


def int4_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
              group: int) -> torch.Tensor:
    return _matmul(x, dequantize_int4(packed, scale, zero, group, x.shape[-1]), False)


def int4_gate_up(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                 zero: torch.Tensor, group: int) -> torch.Tensor:
    return _matmul(x, dequantize_int4(packed, scale, zero, group, x.shape[-1]), True)


def grouped_gemm(x: torch.Tensor, topk_ids: torch.Tensor, n: int, num_experts: int,
                 expert_weight: Callable[[int], torch.Tensor], gated: bool = False
                 ) -> torch.Tensor:
    """y [M, k, N] (gated: [M, k, N / 2]): each chosen expert once, one matmul over the
    (m, j) pairs that chose it; expert_weight(e) is expert e's float32 weight [N, K]."""
    m, _, k = x.shape
    topk = topk_ids.shape[1]
    rows = x.float().expand(m, topk, k).reshape(m * topk, k)       # pair (m, j) -> its input
    ids = topk_ids.reshape(-1)
    if tracing():
        # Static shapes for a compiled forward: every expert's weight, gathered per pair.
        # Correct, not fast (all E are decoded); on CUDA the Triton kernel serves instead.
        weights = torch.stack([expert_weight(e) for e in range(num_experts)])
        y = torch.bmm(rows[:, None], weights[ids].transpose(1, 2))[:, 0]
    else:
        y = torch.zeros(m * topk, n, dtype=torch.float32, device=x.device)
        for e in torch.unique(ids).tolist():
            pairs = torch.nonzero(ids == e).squeeze(1)
            y[pairs] = rows[pairs] @ expert_weight(e).T
    y = y.reshape(m, topk, n)
    return (swiglu_halves(y) if gated else y).to(x.dtype)


def _experts(op: str, fmt: str, x, topk_ids, tensors: tuple, params: tuple, gated: bool,
             weight: Callable[[int], torch.Tensor]) -> torch.Tensor:
    e, n = check_experts(op, fmt, x, topk_ids, tensors, params, gated, kernel=False,
                         values=not tracing())
    return grouped_gemm(x, topk_ids, n, e, weight, gated)


def moe_gemm(x: torch.Tensor, topk_ids: torch.Tensor, weight: torch.Tensor,
             gated: bool = False) -> torch.Tensor:
    return _experts("moe_gemm", "float", x, topk_ids, (weight,), (), gated,
                    lambda i: weight[i].float())


def moe_fp8_gemm(x: torch.Tensor, topk_ids: torch.Tensor, weight: torch.Tensor,
                 scale: torch.Tensor, block_n: int, block_k: int, gated: bool = False
                 ) -> torch.Tensor:
    return _experts("moe_fp8_gemm", "fp8", x, topk_ids, (weight, scale), (block_n, block_k),
                    gated, lambda i: dequantize_fp8(weight[i], scale[i], block_n, block_k))


def moe_nvfp4_gemm(x: torch.Tensor, topk_ids: torch.Tensor, packed: torch.Tensor,
                   scale: torch.Tensor, global_scale: torch.Tensor, gated: bool = False
                   ) -> torch.Tensor:
    return _experts("moe_nvfp4_gemm", "nvfp4", x, topk_ids, (packed, scale, global_scale), (),
                    gated, lambda i: dequantize_nvfp4(packed[i], scale[i], global_scale[i]))


def moe_int4_gemm(x: torch.Tensor, topk_ids: torch.Tensor, packed: torch.Tensor,
                  scale: torch.Tensor, zero: torch.Tensor, group: int, gated: bool = False
                  ) -> torch.Tensor:
    return _experts("moe_int4_gemm", "int4", x, topk_ids, (packed, scale, zero), (group,),
                    gated, lambda i: dequantize_int4(packed[i], scale[i], zero[i], group,
                                                     x.shape[2]))
