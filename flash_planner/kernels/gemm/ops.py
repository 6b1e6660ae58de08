"""The Triton GEMMs' launchers, with the references' names and signatures (reference.py).

Each checks its operands (checks.py), then routes: up to 16 rows the skinny kernel
(skinny.py, split along K, the fused gate/up epilogue inside), more the tiled kernel
(tiled.py; a fused projection's sums in fp32, SwiGLU beside it). Expert launchers check the
id values on CPU tensors only: on CUDA that is a host sync, and an id out of range leaves
its y[m, j] unwritten.
"""

from __future__ import annotations

import torch

from .checks import check_experts, check_int32, check_memory, check_weights, flatten_rows
from .context import context
from .formats import FORMATS
from .reference import swiglu_halves
from .skinny import rows_gemm
from .tiled import tiled_gemm


def _ints(fmt: str, tensors: tuple, params: tuple, rows: int, gated: bool) -> tuple:
    return FORMATS[fmt].ints(tensors, params, rows // 2 if gated else rows)


def linear(op: str, fmt: str, x: torch.Tensor, tensors: tuple, params: tuple,
           gated: bool) -> torch.Tensor:
    """y [..., N] (gated: silu(gate) * up, [..., N / 2]) for x [..., K]."""
    rows = flatten_rows(op, x)
    n = check_weights(op, fmt, x.dtype, rows.shape[1], tensors, params, gated, kernel=True)
    check_memory(op, dict(zip(FORMATS[fmt].tensors, tensors)), x.device)
    check_int32(op, rows.shape[0] * rows.stride(0), tensors[0].numel(), rows.shape[0] * n,
                "weight")
    width = n // 2 if gated else n
    m = rows.shape[0]
    gemm = context(x.device)
    if m * width == 0:
        y = torch.empty(m, width, dtype=x.dtype, device=x.device)
    elif gemm.skinny(m):
        y = rows_gemm(gemm, fmt, rows, tensors, _ints(fmt, tensors, params, n, gated), width,
                      FORMATS[fmt].k_align(params), gated)
    else:
        y = tiled_gemm(fmt, rows, tensors, _ints(fmt, tensors, params, n, gated), n,
                       fp32_out=gated)
        y = swiglu_halves(y).to(x.dtype) if gated else y
    return y.reshape(*x.shape[:-1], width)


def experts(op: str, fmt: str, x: torch.Tensor, topk_ids: torch.Tensor, tensors: tuple,
            params: tuple, gated: bool) -> torch.Tensor:
    """y [M, k, N] (gated: [M, k, N / 2]) for x [M, S, K] routed by topk_ids [M, k]."""
    e, n = check_experts(op, fmt, x, topk_ids, tensors, params, gated, kernel=True,
                         values=not x.is_cuda)
    ids = topk_ids.to(torch.int32).contiguous()                      # a no-op from int32
    check_memory(op, {"topk_ids": ids, **dict(zip(FORMATS[fmt].tensors, tensors))}, x.device)
    if x.stride(2) != 1:
        x = x.contiguous()
    m, topk = x.shape[0], ids.shape[1]
    width = n // 2 if gated else n
    if m * topk * n == 0:
        return torch.empty(m, topk, width, dtype=x.dtype, device=x.device)
    x_span = sum((size - 1) * stride for size, stride in zip(x.shape, x.stride())) + 1
    check_int32(op, x_span, tensors[0].numel() // max(e, 1), m * topk * n, "one expert's weight")
    gemm = context(x.device)
    ints = _ints(fmt, tensors, params, n, gated)
    if gemm.skinny(m):
        return rows_gemm(gemm, fmt, x, tensors, ints, width, FORMATS[fmt].k_align(params),
                         gated, topk_ids=ids, experts=e)
    y = tiled_gemm(fmt, x, tensors, ints, n, fp32_out=gated, topk_ids=ids, experts=e)
    return swiglu_halves(y).to(x.dtype) if gated else y


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int,
             block_k: int) -> torch.Tensor:
    return linear("fp8_gemm", "fp8", x, (weight, scale), (block_n, block_k), False)


def fp8_gate_up(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int,
                block_k: int) -> torch.Tensor:
    return linear("fp8_gate_up", "fp8", x, (weight, scale), (block_n, block_k), True)


def nvfp4_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
               global_scale: torch.Tensor) -> torch.Tensor:
    return linear("nvfp4_gemm", "nvfp4", x, (packed, scale, global_scale), (), False)


def nvfp4_gate_up(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                  global_scale: torch.Tensor) -> torch.Tensor:
    return linear("nvfp4_gate_up", "nvfp4", x, (packed, scale, global_scale), (), True)


def int4_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
              group: int) -> torch.Tensor:
    return linear("int4_gemm", "int4", x, (packed, scale, zero), (group,), False)


def int4_gate_up(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                 zero: torch.Tensor, group: int) -> torch.Tensor:
    return linear("int4_gate_up", "int4", x, (packed, scale, zero), (group,), True)


def moe_gemm(x: torch.Tensor, topk_ids: torch.Tensor, weight: torch.Tensor,
             gated: bool = False) -> torch.Tensor:
    return experts("moe_gemm", "float", x, topk_ids, (weight,), (), gated)


def moe_fp8_gemm(x: torch.Tensor, topk_ids: torch.Tensor, weight: torch.Tensor,
                 scale: torch.Tensor, block_n: int, block_k: int, gated: bool = False
                 ) -> torch.Tensor:
    return experts("moe_fp8_gemm", "fp8", x, topk_ids, (weight, scale), (block_n, block_k),
                   gated)


def moe_nvfp4_gemm(x: torch.Tensor, topk_ids: torch.Tensor, packed: torch.Tensor,
                   scale: torch.Tensor, global_scale: torch.Tensor, gated: bool = False
                   ) -> torch.Tensor:
    return experts("moe_nvfp4_gemm", "nvfp4", x, topk_ids, (packed, scale, global_scale), (),
                   gated)


def moe_int4_gemm(x: torch.Tensor, topk_ids: torch.Tensor, packed: torch.Tensor,
                  scale: torch.Tensor, zero: torch.Tensor, group: int, gated: bool = False
                  ) -> torch.Tensor:
    return experts("moe_int4_gemm", "int4", x, topk_ids, (packed, scale, zero), (group,),
                   gated)
