"""Plain-torch mixture-of-experts grouped GEMM: y[m, j] = x[m, j or 0] @ W[topk_ids[m, j]].T.

Shapes (one-letter dims: M rows, S input slots, K in, E experts, k chosen per row, N out):
  x         [M, S, K] float32, bfloat16 or float16. S == 1: every chosen expert reads the
            row (gate and up projections); S == k: slot j reads its own input x[m, j] (the
            down projection, after the activation).
  topk_ids  [M, k] int32 or int64: each row's k chosen experts, distinct, in [0, E).
  weights   stacked per expert, E first, each expert in the 2-D kernels' layout:
            float   `weight` [E, N, K] in x's dtype
            fp8     `weight` uint8 [E, N, K] (e4m3 bits), `scale` float32
                    [E, ceil(N / block_n), ceil(K / block_k)]    (kernels/fp8_gemm)
            nvfp4   `packed` uint8 [E, N, K / 2], `scale` uint8 [E, N, K / 16] (e4m3 bits),
                    `global_scale` float32 [E]                     (kernels/nvfp4_gemm)
            int4    `packed` uint8 [E, N, ceil(K / 2)], `scale` float32 and `zero` uint8
                    [E, N, ceil(K / group)]                        (kernels/int4_gemm)
  y         [M, k, N] in x's dtype, accumulated in float32.
  gated     the stack holds each expert's gate rows, then its up rows (N = 2I; NVFP4:
            `global_scale` [E, 2], gate's then up's; FP8: I a multiple of block_n), and y is
            silu(gate) * up, [M, k, I] (kernels/gate_up.py), from the float32 sums.

The reference groups the (m, j) pairs by expert and computes each chosen expert with one
matmul against its weight, dequantized with the 2-D references' helpers. The checks here are
shared with the Triton launcher (kernel.py): ValueError naming the argument.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..fp8_gemm.reference import dequantize_fp8
from ..gate_up import swiglu_halves
from ..int4_gemm.reference import dequantize_int4
from ..nvfp4_gemm.reference import GROUP as NVFP4_GROUP
from ..nvfp4_gemm.reference import dequantize_nvfp4

ACTIVATIONS = (torch.float32, torch.bfloat16, torch.float16)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_shape(op: str, name: str, tensor: torch.Tensor, dtype: torch.dtype,
                shape: tuple[int, ...]) -> None:
    """ValueError naming `name` unless it is a `dtype` tensor of `shape`."""
    if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{op}: {name} must be {dtype} {tuple(shape)}, got {tensor.dtype} "
                         f"{tuple(tensor.shape)}")


def check_routing(op: str, x: torch.Tensor, topk_ids: torch.Tensor, first: torch.Tensor,
                  layout: str) -> tuple[int, int, int]:
    """(E, N, k) after checking x, topk_ids and the first weight tensor's rank."""
    if x.dim() != 3 or x.dtype not in ACTIVATIONS:
        raise ValueError(f"{op}: x must be [M, S, K] in float32, bfloat16 or float16, got "
                         f"{x.dtype} {tuple(x.shape)}")
    if (topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64)
            or topk_ids.shape[0] != x.shape[0]):
        raise ValueError(f"{op}: topk_ids must be int32 or int64 [M, k] with M = {x.shape[0]}, "
                         f"got {topk_ids.dtype} {tuple(topk_ids.shape)}")
    topk = topk_ids.shape[1]
    if x.shape[1] not in (1, topk):
        raise ValueError(f"{op}: x must be [M, 1, K] or [M, k, K] with k = {topk} (topk_ids), "
                         f"got S = {x.shape[1]}")
    if first.dim() != 3:
        raise ValueError(f"{op}: {layout}, got {tuple(first.shape)}")
    return first.shape[0], first.shape[1], topk


def check_ids(op: str, topk_ids: torch.Tensor, e: int, values: bool) -> None:
    """The id values, where `values` (on CUDA tensors a host sync): in [0, E), distinct in
    each row."""
    if values and topk_ids.numel():
        if topk_ids.min() < 0 or topk_ids.max() >= e:
            raise ValueError(f"{op}: topk_ids must lie in [0, {e}) (E = {e} experts)")
        ids = topk_ids.sort(dim=1).values
        if (ids[:, 1:] == ids[:, :-1]).any():
            raise ValueError(f"{op}: topk_ids must hold distinct experts in each row")


# Per format: (E, N, k) once every argument is checked; the id values only where `values`.


def check_gated(op: str, n: int, gated: bool, block_n: int = 1) -> None:
    """A gated stack's rows: gate's then up's, as many of each, no FP8 block across them."""
    if gated and (n % 2 or (n // 2) % block_n):
        raise ValueError(f"{op}: a gated stack holds gate rows, then as many up rows (I a "
                         f"multiple of block_n {block_n}), got N = {n}")


def check_float(op, x, topk_ids, weight, values=True, gated=False):
    e, n, topk = check_routing(op, x, topk_ids, weight, "weight must be [E, N, K]")
    check_shape(op, "weight", weight, x.dtype, (e, n, x.shape[2]))
    check_gated(op, n, gated)
    check_ids(op, topk_ids, e, values)
    return e, n, topk


def check_fp8(op, x, topk_ids, weight, scale, block_n, block_k,
              values=True, gated=False):
    e, n, topk = check_routing(op, x, topk_ids, weight, "weight must be uint8 [E, N, K]")
    k = x.shape[2]
    check_shape(op, "weight", weight, torch.uint8, (e, n, k))
    if block_n < 1 or block_k < 1:
        raise ValueError(f"{op}: block_n and block_k must be >= 1, got ({block_n}, {block_k})")
    check_shape(op, "scale", scale, torch.float32, (e, cdiv(n, block_n), cdiv(k, block_k)))
    check_gated(op, n, gated, block_n)
    check_ids(op, topk_ids, e, values)
    return e, n, topk


def check_nvfp4(op, x, topk_ids, packed, scale, global_scale,
                values=True, gated=False):
    e, n, topk = check_routing(op, x, topk_ids, packed, "packed must be uint8 [E, N, K / 2]")
    k = x.shape[2]
    if k % NVFP4_GROUP:
        raise ValueError(f"{op}: K (x's last dim) must be a multiple of {NVFP4_GROUP}, got {k}")
    check_shape(op, "packed", packed, torch.uint8, (e, n, k // 2))
    check_shape(op, "scale", scale, torch.uint8, (e, n, k // NVFP4_GROUP))
    check_shape(op, "global_scale", global_scale, torch.float32, (e, 2) if gated else (e,))
    check_gated(op, n, gated)
    check_ids(op, topk_ids, e, values)
    return e, n, topk


def check_int4(op, x, topk_ids, packed, scale, zero, group,
               values=True, gated=False):
    e, n, topk = check_routing(op, x, topk_ids, packed,
                               "packed must be uint8 [E, N, ceil(K / 2)]")
    k = x.shape[2]
    if group < 1:
        raise ValueError(f"{op}: group must be >= 1, got {group}")
    check_shape(op, "packed", packed, torch.uint8, (e, n, cdiv(k, 2)))
    check_shape(op, "scale", scale, torch.float32, (e, n, cdiv(k, group)))
    check_shape(op, "zero", zero, torch.uint8, (e, n, cdiv(k, group)))
    check_gated(op, n, gated)
    check_ids(op, topk_ids, e, values)
    return e, n, topk


def grouped_gemm(x: torch.Tensor, topk_ids: torch.Tensor, n: int, num_experts: int,
                 expert_weight: Callable[[int], torch.Tensor], gated: bool = False
                 ) -> torch.Tensor:
    """y [M, k, N] (gated: silu(gate) * up, [M, k, N / 2]): each chosen expert once, one
    matmul over the (m, j) pairs that chose it; expert_weight(e) is expert e's float32
    weight [N, K]."""
    m, _, k = x.shape
    topk = topk_ids.shape[1]
    rows = x.float().expand(m, topk, k).reshape(m * topk, k)       # pair (m, j) -> its input
    ids = topk_ids.reshape(-1)                                       # [M * k]
    if torch.compiler.is_compiling():
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


def moe_gemm(x: torch.Tensor, topk_ids: torch.Tensor, weight: torch.Tensor,
             gated: bool = False) -> torch.Tensor:
    """Float expert weights [E, N, K]: x [M, S, K] -> y [M, k, N]."""
    e, n, _ = check_float("moe_gemm", x, topk_ids, weight, not torch.compiler.is_compiling(),
                          gated)
    return grouped_gemm(x, topk_ids, n, e, lambda i: weight[i].float(), gated)


def moe_fp8_gemm(x: torch.Tensor, topk_ids: torch.Tensor, weight: torch.Tensor,
                 scale: torch.Tensor, block_n: int, block_k: int, gated: bool = False
                 ) -> torch.Tensor:
    """FP8 e4m3 expert weights with block scales: x [M, S, K] -> y [M, k, N]."""
    e, n, _ = check_fp8("moe_fp8_gemm", x, topk_ids, weight, scale, block_n, block_k,
                        not torch.compiler.is_compiling(), gated)
    return grouped_gemm(x, topk_ids, n, e,
                        lambda i: dequantize_fp8(weight[i], scale[i], block_n, block_k), gated)


def moe_nvfp4_gemm(x: torch.Tensor, topk_ids: torch.Tensor, packed: torch.Tensor,
                   scale: torch.Tensor, global_scale: torch.Tensor, gated: bool = False
                   ) -> torch.Tensor:
    """NVFP4 expert weights: x [M, S, K] -> y [M, k, N]."""
    e, n, _ = check_nvfp4("moe_nvfp4_gemm", x, topk_ids, packed, scale, global_scale,
                          not torch.compiler.is_compiling(), gated)

    return grouped_gemm(x, topk_ids, n, e, lambda i: dequantize_nvfp4(
        packed[i], scale[i], global_scale[i] if gated else global_scale[i:i + 1]), gated)


def moe_int4_gemm(x: torch.Tensor, topk_ids: torch.Tensor, packed: torch.Tensor,
                  scale: torch.Tensor, zero: torch.Tensor, group: int, gated: bool = False
                  ) -> torch.Tensor:
    """int4 expert weights with group scales and zero points: x [M, S, K] -> y [M, k, N]."""
    e, n, _ = check_int4("moe_int4_gemm", x, topk_ids, packed, scale, zero, group,
                         not torch.compiler.is_compiling(), gated)
    return grouped_gemm(x, topk_ids, n, e, lambda i: dequantize_int4(
        packed[i], scale[i], zero[i], group, x.shape[2]), gated)
