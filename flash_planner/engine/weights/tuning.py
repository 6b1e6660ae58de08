"""Measure the decode GEMMs' configurations for the Linears a model holds (CUDA, opt-in).

With FLASH_PLANNER_TUNE_GEMMS=1 the engine, on a CUDA GPU, times each distinct quantized
Linear shape of the target and its proposers' modules (the DFlash drafter, the MTP head;
fused gate/up projections included) at 1, 2, 4, 8 and 16 rows before it
compiles its graphs (kernels/gemm/tune.py), and caches the fastest configurations on disk per GPU:
the first start with a new model pays a few seconds per shape, later starts read the table.
Without it the kernels run the counted configurations (kernels/gemm/configs.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

import torch
from torch import nn

from .linear import QuantLinear

ENV = "FLASH_PLANNER_TUNE_GEMMS"


def gemm_context(device: torch.device):
    """The device's GEMM state (kernels/gemm/context.py), its measured table read now: a
    compiled graph's trace reads the table as loaded, never the disk."""
    from ...kernels.gemm.context import context

    gemm = context(device)
    gemm.table()
    return gemm


def wanted(device: torch.device) -> bool:
    return device.type == "cuda" and os.environ.get(ENV) == "1"


def distinct_linears(owners: Iterable[object]) -> dict[tuple, QuantLinear]:
    """(format, N out, K, gated, format parameters) -> one quantized 2-D Linear of that kind,
    under `owners`: modules, or objects holding modules (a proposer's drafter or head)."""
    modules = [m for owner in owners for m in ([owner] if isinstance(owner, nn.Module) else
                                                vars(owner).values())
               if isinstance(m, nn.Module)]
    seen: dict[tuple, QuantLinear] = {}
    for module in modules:
        for linear in module.modules():
            if isinstance(linear, QuantLinear) and not linear.expert_count:
                n = linear.out_features // 2 if linear.gated else linear.out_features
                key = (linear.family, n, linear.in_features, linear.gated,
                       tuple(op for op in linear.operands() if not torch.is_tensor(op)))
                seen.setdefault(key, linear)
    return seen


def tune_linears(owners: Iterable[object], dtype: torch.dtype,
                 progress: Callable[[str], None] | None = None) -> int:
    """Tune every distinct kind of quantized Linear under `owners` (`distinct_linears`);
    returns how many there were."""
    from ...kernels.gemm.tune import tune

    seen = distinct_linears(owners)
    for i, ((family, n, k, gated, _), linear) in enumerate(seen.items(), 1):
        if progress is not None:
            progress(f"tuning GEMM {i}/{len(seen)}: {family} {n}x{k}"
                     f"{' gate+up' if gated else ''}")
        tune(family, linear.operands(), n, k, gated, dtype)
    return len(seen)
