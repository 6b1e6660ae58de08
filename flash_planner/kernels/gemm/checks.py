"""The operand checks of the GEMM family: ValueError naming the argument that is wrong.

The references check what the arithmetic needs (dtypes, shapes, routing); the Triton
launchers add what the kernels need (contiguous memory on x's device, int32 offsets, K tiles).
"""

from __future__ import annotations

import torch

from .formats import FORMATS

ACTIVATIONS = (torch.float32, torch.bfloat16, torch.float16)


def check_tensor(op: str, name: str, tensor: torch.Tensor, dtype: torch.dtype,
                 shape: tuple[int, ...]) -> None:
    if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{op}: {name} must be {dtype} {tuple(shape)}, got {tensor.dtype} "
                         f"{tuple(tensor.shape)}")


def check_memory(op: str, tensors: dict[str, torch.Tensor], device: torch.device) -> None:
    """Dense row-major tensors on x's device: the kernels index them so."""
    for name, tensor in tensors.items():
        if not tensor.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous")
        if tensor.device != device:
            raise ValueError(f"{op}: {name} is on {tensor.device}, x on {device}")


def check_weights(op: str, fmt: str, x_dtype: torch.dtype, k: int, tensors: tuple,
                  params: tuple, gated: bool, kernel: bool, experts: int | None = None) -> int:
    """The weight's rows (per expert where `experts`), once its tensors and parameters are
    checked against the format's layout; 2-D weights take a global scale of any shape that
    holds one value per half."""
    form = FORMATS[fmt]
    first = tensors[0]
    rank = 2 if experts is None else 3
    if first.dim() != rank:
        dims = "[N, ...]" if experts is None else "[E, N, ...]"
        raise ValueError(f"{op}: {form.tensors[0]} must be {dims}, got {tuple(first.shape)}")
    n = first.shape[-2]
    form.validate(op, k, n, params, gated, kernel)
    lead = () if experts is None else (experts,)
    for name, tensor, (dtype, shape) in zip(form.tensors, tensors,
                                             form.layout(n, k, params, gated)):
        if experts is None and name == "global_scale":
            tensor, shape = tensor.reshape(-1), (2 if gated else 1,)
        check_tensor(op, name, tensor, dtype or x_dtype, lead + shape)
    return n


def flatten_rows(op: str, x: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> [M, K] with unit stride along K (a view when x allows it)."""
    if x.dtype not in ACTIVATIONS or x.dim() == 0:
        raise ValueError(f"{op}: x must be [..., K] in float32, bfloat16 or float16, got "
                         f"{x.dtype} {tuple(x.shape)}")
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(1) == 1 or rows.shape[1] == 1 else rows.contiguous()


def check_int32(op: str, x_span: int, weight_span: int, out_span: int, what: str) -> None:
    if max(x_span, weight_span, out_span) >= 2**31:
        raise ValueError(f"{op}: x, {what} or the output span 2^31 elements or more")


def check_routing(op: str, x: torch.Tensor, topk_ids: torch.Tensor, first: torch.Tensor) -> int:
    """E (0 where the stack is not 3-D) after checking x [M, S, K] and topk_ids [M, k]."""
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
    return first.shape[0] if first.dim() == 3 else 0


def check_ids(op: str, topk_ids: torch.Tensor, e: int) -> None:
    """The id values (on CUDA tensors a host sync): in [0, E), distinct in each row."""
    if topk_ids.numel():
        if topk_ids.min() < 0 or topk_ids.max() >= e:
            raise ValueError(f"{op}: topk_ids must lie in [0, {e}) (E = {e} experts)")
        ids = topk_ids.sort(dim=1).values
        if (ids[:, 1:] == ids[:, :-1]).any():
            raise ValueError(f"{op}: topk_ids must hold distinct experts in each row")


def check_experts(op: str, fmt: str, x: torch.Tensor, topk_ids: torch.Tensor, tensors: tuple,
                  params: tuple, gated: bool, kernel: bool, values: bool) -> tuple[int, int]:
    """(E, N) of an expert stack once x, the ids (their values where `values`) and the
    weights are checked."""
    e = check_routing(op, x, topk_ids, tensors[0])
    n = check_weights(op, fmt, x.dtype, x.shape[2], tensors, params, gated, kernel, e)
    if values:
        check_ids(op, topk_ids, e)
    return e, n
