"""What a compiled model's warm-up did (`CompileReport`: telemetry, the node's summary, the
benches), and running a warm-up so that it reports it (`warm_up_report`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ....kernels.toolchain import toolchain_error
from .cpu_isa import record_probe, trust_recorded_probe
from .direct import DirectGraph

log = logging.getLogger(__name__)


@contextmanager
def quiet_inductor():
    """Compiling with the C++ wrapper warns, once per op, that ops without a C shim (the
    triangular solve of the GDN verify) run through a proxy: correct, and not for users."""
    logger = logging.getLogger("torch._inductor.ir")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@dataclass(frozen=True)
class CompileReport:
    """What warm-up did: telemetry and the node's summary show it."""

    backend: str              # "inductor" (CPU) or "inductor + CUDA graphs"
    buckets: tuple[int, ...]
    parts: tuple[str, ...]    # the models compiled: target, and the MTP head where loaded
    spans: int                # graph calls per target forward for its layers
    graphs: int               # graphs compiled (or read from the cache) at warm-up
    seconds: float
    cache_dir: str
    batches: tuple[int, ...] = (1,)   # batch buckets (a batch of slots' forwards)
    captured: int = 0         # CUDA graphs captured (per bucket, and per key bucket)
    read: int = 0             # of `graphs`, those read from the store (not compiled)
    deferred: int = 0         # keys left to compile in the background after warm-up

    def plus(self, other: CompileReport) -> CompileReport:
        return replace(self, parts=self.parts + other.parts, graphs=self.graphs + other.graphs,
                       seconds=self.seconds + other.seconds,
                       captured=self.captured + other.captured,
                       read=self.read + other.read,
                       deferred=self.deferred + other.deferred,
                       batches=max(self.batches, other.batches, key=len))

    def as_dict(self) -> dict[str, object]:
        return {"backend": self.backend, "buckets": list(self.buckets),
                "batches": list(self.batches),
                "parts": list(self.parts), "spans": self.spans, "graphs": self.graphs,
                "captured": self.captured, "read": self.read, "deferred": self.deferred,
                "seconds": round(self.seconds, 3),
                "cache_dir": self.cache_dir}

    def __str__(self) -> str:
        batches = f" x batches {list(self.batches)}" if self.batches != (1,) else ""
        captured = f", {self.captured} CUDA graphs captured" if self.captured else ""
        if self.deferred:
            captured += f", {self.deferred} more buckets compiling in the background"
        return (f"compiled {' + '.join(self.parts)} ({self.backend}): buckets "
                f"{list(self.buckets)}{batches}, {self.spans} layer graph calls per target "
                f"forward, {self.graphs} graphs ({self.read} read from the cache){captured} "
                f"in {self.seconds:.1f} s (cache {self.cache_dir})")


@torch.inference_mode()
@quiet_inductor()
def warm_up_report(run: Callable[[], None], graphs: Sequence[DirectGraph], part: str,
                   cuda_graphs: bool, buckets: tuple[int, ...], spans: int, cache_dir: Path,
                   batches: tuple[int, ...] = (1,)) -> CompileReport:
    """Run `run` (the first call of every graph: compiled, or read from the store at
    `cache_dir`) and report what it took."""
    # process-wide: inductor reads the variable whenever it looks for a compiled module (a
    # graph read from the store finds its C++ wrapper there instead of building it again)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
    if not cuda_graphs:
        trust_recorded_probe(cache_dir)

    def counts() -> tuple[int, int]:
        return sum(g.compiled_now for g in graphs), sum(g.read for g in graphs)

    (compiled, read), t0 = counts(), time.perf_counter()
    try:
        run()
    except Exception as exc:    # a compiled graph calls the kernels unguarded (dispatch.py)
        clear = toolchain_error(exc)
        if clear is None:
            raise
        raise clear from exc
    if not cuda_graphs:
        record_probe(cache_dir)
    compiled_after, read_after = counts()
    report = CompileReport("inductor + CUDA graphs" if cuda_graphs else "inductor", buckets,
                           (part,), spans, compiled_after - compiled + read_after - read,
                           time.perf_counter() - t0, str(cache_dir), batches,
                           read=read_after - read)
    log.info("%s", report)
    return report
