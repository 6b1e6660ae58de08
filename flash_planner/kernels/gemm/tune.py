"""Measure the skinny kernel's configurations once per GPU and shape, and cache the winners.

`tune` times each of configs.candidates (the counted configuration and its neighbours) for
one weight at each row bucket on a CUDA GPU, with CUDA events over a few dozen launches, and
records the fastest in the device's GemmContext table (~/.cache/flash_planner/
gemm_configs.json, keyed by GPU, format, shape and bucket). The engine tunes its own
quantized Linears at load when FLASH_PLANNER_TUNE_GEMMS=1 (engine/weights/tuning.py), and
bench/gpu.py tunes the shapes it measures; shapes already in the table are not measured again.
`tune_vendors` then times the vendor GEMMs (vendor.py) against our kernel at its chosen
configuration and records, per shape and bucket, which one serves.
Every candidate computes the same sums in the same order per split (results may differ in
the last bit between splits, never between runs of one configuration).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from .configs import RowsConfig, candidates
from .context import context, shape_key
from .formats import FORMATS
from .skinny import rows_gemm
from .tiles import INTERPRETED
from .vendor import WEIGHT_ONLY, rel_diff, routed, winner

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16)


def split_operands(fmt: str, operands: Sequence) -> tuple[tuple, tuple]:
    """(tensors, parameters) of a launcher's arguments after x, as the engine holds them."""
    count = len(FORMATS[fmt].tensors)
    return tuple(operands[:count]), tuple(operands[count:])


def skinny_launch(fmt: str, x: torch.Tensor, operands: Sequence, gated: bool,
                  config: RowsConfig | None = None) -> torch.Tensor:
    """The skinny kernel on rows x [M <= 16, K] with one configuration (checked operands)."""
    tensors, params = split_operands(fmt, operands)
    rows = tensors[0].shape[0]
    width = rows // 2 if gated else rows
    ints = FORMATS[fmt].ints(tensors, params, width)
    return rows_gemm(context(x.device), fmt, x, tensors, ints, width,
                     FORMATS[fmt].k_align(params), gated, config)


def time_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median time of `fn` in ms after one warm-up call (the compile): CUDA events on a GPU,
    the wall clock otherwise (bench/kernel_times.py times with it too). Interpreted kernels have
    nothing to compile, and each call takes seconds: no warm-up then."""
    if not INTERPRETED:
        fn()
    times = []
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        for _ in range(repeats):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def tune(fmt: str, operands: Sequence, n: int, k: int, gated: bool, dtype: torch.dtype,
         buckets: Sequence[int] = BUCKETS, repeats: int = 30) -> dict[int, RowsConfig]:
    """The fastest configuration per row bucket for one weight (`operands`: the launcher's
    arguments after x; n the output width), recorded in the table. Buckets already in the
    table are read, not measured."""
    device = operands[0].device
    if device.type != "cuda":
        raise ValueError(f"tuning measures on a CUDA GPU; the weight is on {device}")
    align = FORMATS[fmt].k_align(split_operands(fmt, operands)[1])
    fp32 = dtype == torch.float32
    gemm = context(device)
    best: dict[int, RowsConfig] = {}
    for rows in buckets:
        key = shape_key(device, fmt, n, k, align, rows, gated, fp32)
        if key in gemm.table():
            best[rows] = gemm.table()[key]
            continue
        x = torch.randn(rows, k, device=device, dtype=dtype)
        timed = {config: time_ms(lambda c=config, x=x: skinny_launch(fmt, x, operands, gated,
                                                                       c), repeats)
                 for config in candidates(fmt, n, k, rows, gemm.sms, align, gated, fp32)}
        best[rows] = min(timed, key=timed.get)
        gemm.record(key, best[rows])
        log.info("GEMM %s %dx%d%s, %d rows: %s (%.4f ms; counted %.4f ms)", fmt, n, k,
                 " gate+up" if gated else "", rows, best[rows], timed[best[rows]],
                 next(iter(timed.values())))
    return best


def tune_vendors(fmt: str, operands: Sequence, n: int, k: int, gated: bool, dtype: torch.dtype,
                 buckets: Sequence[int] = BUCKETS, repeats: int = 30,
                 numerics: tuple[str, ...] = WEIGHT_ONLY) -> dict[int, str]:
    """Per row bucket, the vendor GEMM that beats our kernel (at its chosen configuration)
    within its numerics' tolerance, or "" for ours; recorded in the table. Buckets already
    there are read, not measured; `tune` first, so ours runs its measured configuration."""
    device = operands[0].device
    if device.type != "cuda":
        raise ValueError(f"tuning measures on a CUDA GPU; the weight is on {device}")
    gemm = context(device)
    align = FORMATS[fmt].k_align(split_operands(fmt, operands)[1])
    fp32 = dtype == torch.float32
    rows_n = n * 2 if gated else n
    found = list(routed(fmt, tuple(operands), rows_n, k, gated).values())
    out: dict[int, str] = {}
    for rows in buckets:
        key = shape_key(device, fmt, n, k, align, rows, gated, fp32)
        if key in gemm.vendors():
            out[rows] = gemm.vendor(key)
            continue
        x = torch.randn(rows, k, device=device, dtype=dtype)
        config = gemm.choose(fmt, n, k, rows, align, gated, fp32)
        ours = skinny_launch(fmt, x, operands, gated, config)
        ours_ms = time_ms(lambda x=x, c=config: skinny_launch(fmt, x, operands, gated, c),
                          repeats)
        measured = []
        for c in found:
            try:
                diff = rel_diff(c.fn(x), ours)
            except (RuntimeError, NotImplementedError) as exc:   # the vendor refuses the shape
                log.info("GEMM %s %dx%d, %d rows: %s refused (%s)", fmt, n, k, rows, c.name, exc)
                continue
            measured.append((c, time_ms(lambda c=c, x=x: c.fn(x), repeats), diff))
        out[rows] = winner(ours_ms, measured, numerics)
        gemm.record_vendor(key, out[rows])
        log.info("GEMM %s %dx%d%s, %d rows: %s serves (ours %.4f ms; %s)", fmt, n, k,
                 " gate+up" if gated else "", rows, out[rows] or "ours", ours_ms,
                 ", ".join(f"{c.name} {ms:.4f} ms, diff {d:.1e}" for c, ms, d in measured)
                 or "no vendor candidate")
    return out
