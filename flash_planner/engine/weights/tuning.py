"""Measure the decode GEMMs' configurations for the Linears a model holds (CUDA, opt-in).

With FLASH_PLANNER_TUNE_GEMMS=1 the engine, on a CUDA GPU, times each distinct quantized
Linear shape of the target and its proposers' modules (the DFlash drafter, the MTP head;
fused gate/up projections included) at 1, 2, 4, 8 and 16 rows before it
compiles its graphs (kernels/gemm/tune.py), and caches the fastest configurations on disk per GPU:
the first start with a new model pays a few seconds per shape, later starts read the table.
Without it the kernels run the counted configurations (kernels/gemm/configs.py). Tuning
also times the vendor GEMMs (kernels/gemm/vendor.py) beside ours; where the table says one
won a shape and row bucket, `route_vendors` gives each such Linear that vendor's function for
those buckets (a copy of the weight in the vendor's packing: the log states the bytes).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable

import torch
from torch import nn

from .linear import QuantLinear

ENV = "FLASH_PLANNER_TUNE_GEMMS"
log = logging.getLogger(__name__)


def gemm_context(device: torch.device):
    """The device's GEMM state (kernels/gemm/context.py), its measured table read now: a
    compiled graph's trace reads the table as loaded, never the disk."""
    from ...kernels.gemm.context import context

    gemm = context(device)
    gemm.table()
    return gemm


def wanted(device: torch.device) -> bool:
    return device.type == "cuda" and os.environ.get(ENV) == "1"


def linears(owners: Iterable[object]) -> list[QuantLinear]:
    """The quantized 2-D Linears under `owners`: modules, or objects holding modules (a
    proposer's drafter or head), each once."""
    modules = [m for owner in owners for m in ([owner] if isinstance(owner, nn.Module) else
                                                vars(owner).values())
               if isinstance(m, nn.Module)]
    found = {id(linear): linear for module in modules for linear in module.modules()
             if isinstance(linear, QuantLinear) and not linear.expert_count}
    return list(found.values())


def distinct_linears(owners: Iterable[object]) -> dict[tuple, QuantLinear]:
    """(format, N out, K, gated, format parameters) -> one quantized 2-D Linear of that kind,
    under `owners` (`linears`)."""
    seen: dict[tuple, QuantLinear] = {}
    for linear in linears(owners):
        n = linear.out_features // 2 if linear.gated else linear.out_features
        key = (linear.family, n, linear.in_features, linear.gated,
               tuple(op for op in linear.operands() if not torch.is_tensor(op)))
        seen.setdefault(key, linear)
    return seen


def tune_linears(owners: Iterable[object], dtype: torch.dtype,
                 progress: Callable[[str], None] | None = None) -> int:
    """Tune every distinct kind of quantized Linear under `owners` (`distinct_linears`);
    returns how many there were."""
    from ...kernels.gemm.tune import tune, tune_vendors

    seen = distinct_linears(owners)
    for i, ((family, n, k, gated, _), linear) in enumerate(seen.items(), 1):
        if progress is not None:
            progress(f"tuning GEMM {i}/{len(seen)}: {family} {n}x{k}"
                     f"{' gate+up' if gated else ''}")
        tune(family, linear.operands(), n, k, gated, dtype)
        tune_vendors(family, linear.operands(), n, k, gated, dtype)
    return len(seen)


def route_vendors(owners: Iterable[object], dtype: torch.dtype) -> int:
    """Give each quantized Linear under `owners` the vendor GEMMs its device's table names
    for its shape (`QuantLinear.vendor_routes`); returns how many Linears took one."""
    from ...kernels.gemm.configs import MAX_ROWS
    from ...kernels.gemm.context import context, shape_key
    from ...kernels.gemm.formats import FORMATS
    from ...kernels.gemm.tune import BUCKETS, split_operands
    from ...kernels.gemm.vendor import routed

    routed_count, extra = 0, 0
    for linear in linears(owners):
        device = linear.operands()[0].device
        gemm = context(device)
        if not gemm.vendors():
            continue
        fmt, k, gated = linear.family, linear.in_features, linear.gated
        n = linear.out_features // 2 if gated else linear.out_features
        align = FORMATS[fmt].k_align(split_operands(fmt, linear.operands())[1])
        names = {rows: gemm.vendor(shape_key(device, fmt, n, k, align, rows, gated,
                                             dtype == torch.float32))
                 for rows in BUCKETS if rows <= MAX_ROWS}
        names = {rows: name for rows, name in names.items() if name}
        if not names:
            continue
        found = routed(fmt, linear.operands(), linear.out_features, k, gated,
                       set(names.values()))
        linear.vendor_routes = {rows: found[name].fn for rows, name in names.items()
                                if name in found}
        if linear.vendor_routes:
            routed_count += 1
            extra += sum(c.weight_bytes for c in found.values())
    if routed_count:
        log.info("vendor GEMMs serve %d quantized Linears at their measured buckets (about "
                 "%.1f MB more for their weights' vendor packing)", routed_count, extra / 1e6)
    return routed_count
