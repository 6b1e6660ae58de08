"""Measure the skinny GEMMs' configurations once per GPU and shape, and cache the winners.

`tune` times each of gemm_configs.candidates (the counted configuration and its neighbours)
for one weight at each row bucket on a CUDA GPU, with CUDA events over a few dozen launches,
and records the fastest in the table gemm_configs.choose reads (~/.cache/flash_planner/
gemm_configs.json, keyed by GPU, format, shape and bucket). The engine tunes its own
quantized Linears at load when FLASH_PLANNER_TUNE_GEMMS=1 (engine/weights/tuning.py), and
bench/gpu.py tunes the shapes it measures; shapes already in the table are not measured again.
Every candidate computes the same sums in the same order per split (results may differ in
the last bit between splits, never between runs of one configuration).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from . import gemm_configs
from .fp8_gemm.skinny import fp8_rows
from .gemm_configs import RowsConfig, sm_count
from .int4_gemm.skinny import int4_rows
from .nvfp4_gemm.skinny import nvfp4_rows

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16)
# family -> (the skinny launcher, the operand its K alignment comes from)
LAUNCHERS: dict[str, Callable] = {"fp8": fp8_rows, "nvfp4": nvfp4_rows, "int4": int4_rows}


def k_align(family: str, operands: Sequence) -> int:
    """fp8: block_k; int4: group (both the fourth operand); nvfp4: its 16-value groups."""
    return 16 if family == "nvfp4" else operands[3]


def time_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median time of `fn` in ms after one warm-up call (the compile): CUDA events on a GPU,
    the wall clock otherwise (bench/kernels.py times with it too)."""
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


def tune(family: str, operands: Sequence, n: int, k: int, gated: bool, dtype: torch.dtype,
         buckets: Sequence[int] = BUCKETS, repeats: int = 30) -> dict[int, RowsConfig]:
    """The fastest configuration per row bucket for one weight (`operands`: the launcher's
    arguments after x, as the engine holds them; n the output width), recorded in the table.
    Buckets already in the table are read, not measured."""
    device = operands[0].device
    if device.type != "cuda":
        raise ValueError(f"tuning measures on a CUDA GPU; the weight is on {device}")
    align = k_align(family, operands)
    fp32 = dtype == torch.float32
    table = gemm_configs.load_table()
    best: dict[int, RowsConfig] = {}
    for rows in buckets:
        key = gemm_configs.shape_key(device, family, n, k, align, rows, gated, fp32)
        if key in table:
            best[rows] = table[key]
            continue
        x = torch.randn(rows, k, device=device, dtype=dtype)
        launcher = LAUNCHERS[family]

        def run(config: RowsConfig, x: torch.Tensor = x, launcher: Callable = launcher):
            launcher(x, *operands, gated=gated, config=config)

        timed = {config: time_ms(lambda c=config: run(c), repeats)
                 for config in gemm_configs.candidates(family, n, k, rows, sm_count(device),
                                                       align, gated, fp32)}
        best[rows] = min(timed, key=timed.get)
        gemm_configs.record(key, best[rows])
        log.info("GEMM %s %dx%d%s, %d rows: %s (%.4f ms; counted %.4f ms)", family, n, k,
                 " gate+up" if gated else "", rows, best[rows], timed[best[rows]],
                 next(iter(timed.values())))
    return best
