"""The GEMM family's state for one device: a GemmContext, made when first asked for.

It holds the device's SM count, the measured configurations and vendor winners (read from
disk when first asked, never at import), the choices already made per launch shape, the
split-K counters of each stream, and whether the skinny kernel serves (`tiled_only` turns it
off: what decode ran before it, which bench/gpu.py times). The engine holds its device's context
(`context(device)`, engine/weights/tuning.py tunes through it). `tracing()` is the one test
for "inside a torch.compile trace", where nothing is read from or remembered in a context
(dynamo would guard on what it read).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import torch

from .configs import COUNTERS, MAX_ROWS, RowsConfig, bucket, heuristic

log = logging.getLogger(__name__)

VENDOR_SECTION = "vendor"      # the table file's section of vendor winners (no shape key)


def tracing() -> bool:
    return torch.compiler.is_compiling()


def table_path() -> Path:
    """gemm_configs.json under engine.config.cache_home()'s root, by the same rule (kernels
    import nothing of the engine)."""
    if os.environ.get("FLASH_PLANNER_CACHE"):
        root = Path(os.environ["FLASH_PLANNER_CACHE"]).expanduser()
    else:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flash_planner"
    return root / "gemm_configs.json"


def device_key(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    props = torch.cuda.get_device_properties(device)
    return f"{props.name} sm{props.major}{props.minor} x{props.multi_processor_count}"


def shape_key(device: torch.device, fmt: str, n: int, k: int, k_align: int, rows: int,
              gated: bool, fp32: bool) -> str:
    kind = f"{fmt} gate_up" if gated else fmt
    return (f"{device_key(device)}|{kind}|{n}x{k}/{k_align}|M{bucket(rows)}"
            f"{' fp32' if fp32 else ''}")


class GemmContext:
    """One device's SM count, measured table, choices and split-K counters."""

    def __init__(self, device: torch.device):
        self.device = device
        # streaming multiprocessors; 4 off CUDA (the interpreter is small, so tests at tiny
        # shapes split K as an H100 does at the 27B's)
        self.sms = (torch.cuda.get_device_properties(device).multi_processor_count
                    if device.type == "cuda" else 4)
        self.skinny_rows = MAX_ROWS
        self.chosen: dict[tuple, RowsConfig] = {}       # choose()'s answers, per shape
        self._table: dict[str, RowsConfig] | None = None
        # shape key -> the vendor GEMM measured faster than ours (kernels/gemm/vendor.py), or
        # "" where ours won: the file's "vendor" section, read with the table
        self._vendors: dict[str, str] = {}
        self._counters: dict[int, torch.Tensor] = {}   # per CUDA stream

    def skinny(self, rows: int) -> bool:
        """Whether a launch over `rows` rows runs the skinny kernel."""
        return rows <= self.skinny_rows

    @contextlib.contextmanager
    def tiled_only(self) -> Iterator[None]:
        self.skinny_rows = 0
        try:
            yield
        finally:
            self.skinny_rows = MAX_ROWS

    def table(self) -> dict[str, RowsConfig]:
        """The measured configurations (empty when none are, or the file is unreadable)."""
        if self._table is None:
            self._table, self._vendors = {}, {}
            self.chosen.clear()
            path = table_path()
            if path.is_file():
                try:
                    raw = json.loads(path.read_text())
                    vendors = raw.pop(VENDOR_SECTION, {})
                    self._table = {key: RowsConfig(**value) for key, value in raw.items()}
                    self._vendors = {str(key): str(name) for key, name in vendors.items()}
                except (OSError, ValueError, TypeError, AttributeError) as exc:
                    log.warning("GEMM configurations in %s unreadable (%s): counted ones used",
                                path, exc)
                    self._table, self._vendors = {}, {}
        return self._table

    def vendors(self) -> dict[str, str]:
        """Shape key -> the vendor GEMM measured fastest there ("" where ours was)."""
        self.table()
        return self._vendors

    def vendor(self, key: str) -> str:
        """The vendor GEMM that serves this shape key, "" for ours. Inside a trace: the
        table as loaded before it."""
        return (self._vendors if tracing() else self.vendors()).get(key, "")

    def record(self, key: str, config: RowsConfig) -> None:
        """Add one measured configuration to the table and write it back."""
        self.table()[key] = config
        self.chosen.clear()
        self._write()

    def record_vendor(self, key: str, name: str) -> None:
        """Record which GEMM won at this shape key: a vendor candidate's name, "" for ours."""
        self.vendors()[key] = name
        self._write()

    def _write(self) -> None:
        raw: dict = {key: asdict(c) for key, c in sorted(self.table().items())}
        if self._vendors:
            raw[VENDOR_SECTION] = dict(sorted(self._vendors.items()))
        path = table_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(raw, indent=1))
        tmp.replace(path)

    def choose(self, fmt: str, n: int, k: int, rows: int, k_align: int, gated: bool,
               fp32: bool) -> RowsConfig:
        """The measured configuration of this shape, else the counted one (remembered per
        shape: an eager launch looks it up once). Inside a trace: the table as loaded before
        it (engines load it before they compile), nothing remembered."""
        if tracing():
            return self._lookup(self._table or {}, fmt, n, k, rows, k_align, gated, fp32)
        args = (fmt, n, k, bucket(rows), k_align, gated, fp32)
        config = self.chosen.get(args)
        if config is None:
            config = self.chosen[args] = self._lookup(self.table(), *args)
        return config

    def _lookup(self, table: dict[str, RowsConfig], fmt: str, n: int, k: int, rows: int,
                k_align: int, gated: bool, fp32: bool) -> RowsConfig:
        found = table.get(shape_key(self.device, fmt, n, k, k_align, rows, gated, fp32))
        return found if found is not None else heuristic(fmt, n, k, rows, self.sms, k_align,
                                                         gated, fp32)

    def counters(self, tiles: int) -> torch.Tensor:
        """Zeroed split-K counters for `tiles` tiles: the current stream's own (made on first
        use; the kernel leaves them at zero, and launches on one stream never overlap), or
        inside a trace a fresh zeroed buffer (a tensor born inside a traced graph must not be
        kept; the compiled graph pays a small memset)."""
        if tracing():
            return torch.zeros(tiles, dtype=torch.int32, device=self.device)
        stream = torch.cuda.current_stream(self.device).stream_id \
            if self.device.type == "cuda" else 0
        buf = self._counters.get(stream)
        if buf is None:
            buf = self._counters[stream] = torch.zeros(COUNTERS, dtype=torch.int32,
                                                       device=self.device)
        return buf


_contexts: dict[torch.device, GemmContext] = {}


def context(device: torch.device | str) -> GemmContext:
    """The device's context, made on first use (the engine's at load: engine.gemm)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    found = _contexts.get(device)
    if found is None:
        found = _contexts[device] = GemmContext(device)
    return found
