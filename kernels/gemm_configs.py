"""How each skinny weight-only GEMM is launched: tiles, K split and warps per shape and device.

A configuration is chosen per (format, N, K, row bucket, SM count; fused or not, fp32 rows
or not). The choice comes from a table measured once per GPU and cached on disk
(kernels/tune.py: run by the engine at load with FLASH_PLANNER_TUNE_GEMMS=1 on CUDA, and by
`bench/gpu.py --tune`), else from `heuristic`, which counts instead of measuring:
  - rows: every bucket on a 16-row tensor-core tile. The FMA path (BLOCK_M the bucket, 1-4
    rows) is a candidate for the measured table only: on an H200 (bench/gpu.py, counted
    configurations, CUDA events) it took 1.77 ms for one row of the 27B's FP8 lm_head, 3.10
    for two and 5.81 for four, where the 16-row tile took 0.65 for eight: its per-step sum
    across K costs more than the padding rows;
  - a K step reads 64 bytes of every weight row (fp8 64 values, nvfp4 and int4 128; fp8 and
    int4 held inside one scale block or group): 64 rows x 64 B = 4 KiB a step, 32 bytes (two
    16-byte vectors) per thread of a 4-warp program, at about 100 registers (kernels/report),
    so 4-5 programs fit an SM: 16-20 KiB in flight per SM, above the ~14 KiB an H100 SM needs
    to cover its share of 3 TB/s over ~600 ns of latency (Thor's needs ~8 KiB);
  - BLOCK_N keeps the FMA path's [BM, BN, BK] products at 64 fp32 per thread, and is halved
    for a fused gate and up projection, whose programs decode two tiles a step (the fp32
    demo's 16-row gated tiles spilled at 64);
  - fp32 rows on tensor cores use 8 warps and half the tile width, and half the K step when
    fused (the fp32 demo's tiles spilled at 4 warps, its MoE FP8 tiles at 8 warps and the
    full width, its fused MoE NVFP4 tiles at the full step);
  - SPLIT (a power of two, at most 16) makes N tiles x SPLIT reach 4 programs per SM, while
    every split keeps at least two K steps.
Buckets are powers of two: a 3-row verify runs the 4-row configuration.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

COUNTERS = 1 << 14            # split-K tile counters per device (kernels/split_k.py)
MAX_ROWS = 16                 # the skinny kernels' rows; more go to the tiled kernels
FMA_ROWS = 4                  # up to this bucket the FMA path; above, tensor cores
STEP_BYTES = 64               # bytes of one weight row per K step
PROGRAMS_PER_SM = 4
MAX_SPLIT = 16
PRODUCT_ELEMENTS = 64 * 128   # FMA path: fp32 products per program per step (64 a thread)
BITS = {"float": 16, "fp8": 8, "nvfp4": 4, "int4": 4}


@dataclass(frozen=True)
class RowsConfig:
    """One launch configuration of a skinny GEMM."""

    block_m: int
    block_n: int
    block_k: int
    split: int
    num_warps: int = 4
    num_stages: int = 3

    @property
    def use_dot(self) -> bool:
        return self.block_m >= 16

    def grid(self, n: int, k: int) -> tuple[int, int, int]:
        """(N tiles, K steps per split, splits) of a launch at [N, K]: whole K steps per
        split, so the last split may be short and fewer splits than `split` may remain; no
        split where the tiles would outnumber the counters."""
        tiles = -(-n // self.block_n)
        steps = -(-k // self.block_k)
        if self.split == 1 or tiles > COUNTERS:
            return tiles, steps, 1
        per_split = -(-steps // self.split)
        return tiles, per_split, -(-steps // per_split)

    def meta(self) -> dict:
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "BLOCK_K": self.block_k,
                "SPLIT": self.split, "num_warps": self.num_warps, "num_stages": self.num_stages}


_skinny_rows = MAX_ROWS


def skinny(rows: int) -> bool:
    """Whether a launch over `rows` rows runs a skinny kernel (up to 16; none inside
    `tiled_only`)."""
    return rows <= _skinny_rows


@contextlib.contextmanager
def tiled_only() -> Iterator[None]:
    """Every weight-only and MoE GEMM inside on the tiled kernels, whatever M: what decode
    ran before the skinny kernels (bench/gpu.py times both)."""
    global _skinny_rows
    _skinny_rows = 0
    try:
        yield
    finally:
        _skinny_rows = MAX_ROWS


def bucket(rows: int) -> int:
    """The power of two at or above `rows` (1..16)."""
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"skinny GEMMs take 1 to {MAX_ROWS} rows, got {rows}")
    return 1 << (rows - 1).bit_length()


def step_k(family: str, k_align: int) -> int:
    """Values of a K step: STEP_BYTES of a row. NVFP4 tiles decode a scale per 16 values;
    fp8 and int4 scale a step's partial sum once per row, so their step stays inside one
    scale block or group (`k_align`: block_k, group), never below 32 (the tiled kernels')."""
    block_k = STEP_BYTES * 8 // BITS[family]
    while family != "nvfp4" and k_align % block_k and block_k > 32:
        block_k //= 2
    return block_k


def heuristic(family: str, n: int, k: int, rows: int, sms: int, k_align: int,
              gated: bool = False, fp32: bool = False, fma: bool = False) -> RowsConfig:
    """The counted configuration (the module docstring); n is the output width (I when
    gated), fp32 whether the rows are float32; fma: the FMA path's configuration instead
    (up to FMA_ROWS rows)."""
    m = bucket(rows)
    if fma and m > FMA_ROWS:
        raise ValueError(f"the FMA path takes up to {FMA_ROWS} rows, got {rows}")
    block_k = step_k(family, k_align)
    block_m = m if fma else 16
    # the FMA product tile spans BK / 2 per even/odd half for the 4-bit formats
    width = block_k if BITS[family] == 8 else block_k // 2
    block_n = 64 if block_m >= 16 else max(16, min(64, PRODUCT_ELEMENTS // (block_m * width)))
    if gated:
        block_n //= 2
    tiles = -(-n // block_n)
    split = 1
    while (split < MAX_SPLIT and tiles * split < PROGRAMS_PER_SM * sms
           and k >= 2 * block_k * split * 2):
        split *= 2
    # fp32 rows take three bf16 dots each (weight_tiles.dot_xwt): 8 warps share the registers
    # of a half-width tile
    warps = 4
    if fp32 and block_m >= 16:
        warps, block_n = 8, max(32, block_n // 2)
        if gated:                       # two tiles' three dots each: half the K step
            block_k = max(32, block_k // 2)
    return RowsConfig(block_m, block_n, block_k, split, num_warps=warps)


# ---- the declared specializations (kernels/report.py compiles these)

# Qwen3.6-27B's MLP with bf16 rows: gate and up fused (I 17408 from K 5120) and down (N 5120
# from K 17408: few tiles, split along K) on Thor (20 SMs), the down projection on an H100 (132
# SMs) too; the demo (hidden 192, MLP 512) in fp32. One row (FMA) and 16 (tensor cores).
DECLARED = (("27B", "*bf16", "gate_up", 17408, 5120, 20),
            ("27B", "*bf16", "down", 5120, 17408, 20),
            ("27B", "*bf16", "down", 5120, 17408, 132),
            ("demo", "*fp32", "gate_up", 512, 192, 20),
            ("demo", "*fp32", "down", 192, 512, 20))


# Qwen3.6-35B-A3B's experts (hidden 2048, moe_intermediate_size 512, 256 experts, top 8):
# gate and up stacked ("up": I 512 from K 2048, S = 1) and down (N 2048 from K 512, S = k)
# on Thor and an H100; Qwen3.8-Flash-Next's (hidden 2560, 640 wide, 512 experts, top 10) on
# Thor; the demo-sized fp32 MoE the CPU tests load (8 experts, top 2, hidden 64, 32 wide).
DECLARED_MOE = (("35B-A3B", "*bf16", "up", 512, 2048, 256, 8, 20),
                ("35B-A3B", "*bf16", "down", 2048, 512, 256, 8, 20),
                ("35B-A3B", "*bf16", "up", 512, 2048, 256, 8, 132),
                ("35B-A3B", "*bf16", "down", 2048, 512, 256, 8, 132),
                ("Flash-Next", "*bf16", "up", 640, 2560, 512, 10, 20),
                ("Flash-Next", "*bf16", "down", 2560, 640, 512, 10, 20),
                ("demo", "*fp32", "up", 32, 64, 8, 2, 20),
                ("demo", "*fp32", "down", 64, 32, 8, 2, 20))


def declared(family: str, k_align: int) -> list[tuple[str, str, RowsConfig, bool, int, int]]:
    """(label, activation type, configuration, gated, N, K) of each distinct declared
    specialization of a family's skinny kernel."""
    out: dict[tuple, tuple] = {}
    for model, act, proj, n, k, sms in DECLARED:
        for rows, fma in ((1, True), (1, False), (MAX_ROWS, False)):
            config = heuristic(family, n, k, rows, sms, k_align, proj == "gate_up",
                               act == "*fp32", fma)
            key = (act, config, proj == "gate_up", k % config.block_k == 0)
            label = f"{family} rows {model} {act[1:]} {proj} M{rows} {sms} SMs"
            out.setdefault(key, (label, act, config, proj == "gate_up", n, k))
    return list(out.values())


# ---- the measured table

def table_path() -> Path:
    """gemm_configs.json under engine.config.cache_home()'s root, by the same rule (kernels
    import nothing of the engine)."""
    if os.environ.get("FLASH_PLANNER_CACHE"):
        root = Path(os.environ["FLASH_PLANNER_CACHE"]).expanduser()
    else:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flash_planner"
    return root / "gemm_configs.json"


_sms: dict[torch.device, int] = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (asked once per device, outside a compile
    trace); 4 elsewhere (the interpreter: small, so tests at tiny shapes split K as an H100
    does at the 27B's)."""
    if device.type != "cuda":
        return 4
    if torch.compiler.is_compiling():   # no read of _sms: dynamo would guard on its contents
        return torch.cuda.get_device_properties(device).multi_processor_count
    sms = _sms.get(device)
    if sms is None:
        sms = _sms[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return sms


def device_key(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    props = torch.cuda.get_device_properties(device)
    return f"{props.name} sm{props.major}{props.minor} x{props.multi_processor_count}"


def shape_key(device: torch.device, family: str, n: int, k: int, k_align: int, rows: int,
              gated: bool, fp32: bool) -> str:
    kind = f"{family} gate_up" if gated else family
    return (f"{device_key(device)}|{kind}|{n}x{k}/{k_align}|M{bucket(rows)}"
            f"{' fp32' if fp32 else ''}")


_table: dict[str, RowsConfig] | None = None
_chosen: dict[tuple, RowsConfig] = {}     # choose()'s answers, per launch shape


def load_table() -> dict[str, RowsConfig]:
    """The cached measurements (empty when none are, or when the file cannot be read)."""
    global _table
    if _table is None:
        _table = {}
        _chosen.clear()
        path = table_path()
        if path.is_file():
            try:
                raw = json.loads(path.read_text())
                _table = {key: RowsConfig(**value) for key, value in raw.items()}
            except (OSError, ValueError, TypeError) as exc:
                log.warning("GEMM configurations in %s unreadable (%s): counted ones used",
                            path, exc)
    return _table


def record(key: str, config: RowsConfig) -> None:
    """Add one measured configuration to the table and write it back."""
    table = load_table()
    table[key] = config
    _chosen.clear()
    path = table_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({key: asdict(c) for key, c in sorted(table.items())}, indent=1))
    tmp.replace(path)


def choose(family: str, n: int, k: int, rows: int, device: torch.device, k_align: int,
           gated: bool, fp32: bool) -> RowsConfig:
    """The measured configuration of this shape on this device, else the counted one
    (remembered per shape: an eager launch looks it up once). Inside a torch.compile trace:
    the table as loaded, nothing read from disk and nothing remembered."""
    if torch.compiler.is_compiling():
        return _lookup(_table or {}, family, n, k, rows, device, k_align, gated, fp32)
    args = (family, n, k, bucket(rows), device, k_align, gated, fp32)
    config = _chosen.get(args)
    if config is None:
        config = _chosen[args] = _lookup(load_table(), family, n, k, rows, device, k_align,
                                         gated, fp32)
    return config


def _lookup(table: dict[str, RowsConfig], family: str, n: int, k: int, rows: int,
            device: torch.device, k_align: int, gated: bool, fp32: bool) -> RowsConfig:
    found = table.get(shape_key(device, family, n, k, k_align, rows, gated, fp32))
    return found if found is not None else heuristic(family, n, k, rows, sm_count(device),
                                                     k_align, gated, fp32)


def candidates(family: str, n: int, k: int, rows: int, sms: int, k_align: int,
               gated: bool, fp32: bool) -> list[RowsConfig]:
    """What `tune` times: the counted configuration and its neighbours (half and double the
    split, other tile widths, the other warp count), and for 1-4 rows the FMA path's."""
    base = heuristic(family, n, k, rows, sms, k_align, gated, fp32)
    out = [base]
    if bucket(rows) <= FMA_ROWS:
        out.append(heuristic(family, n, k, rows, sms, k_align, gated, fp32, fma=True))
    for split in (base.split // 2, base.split * 2):
        if 1 <= split <= MAX_SPLIT and k >= 2 * base.block_k * split:
            out.append(RowsConfig(base.block_m, base.block_n, base.block_k, split,
                                  base.num_warps))
    for block_n in (base.block_n // 2, base.block_n * 2):
        if 16 <= block_n <= 128:
            out.append(RowsConfig(base.block_m, block_n, base.block_k, base.split,
                                  base.num_warps))
    out.append(RowsConfig(base.block_m, base.block_n, base.block_k, base.split,
                          num_warps=12 - base.num_warps))
    return list(dict.fromkeys(out))


load_table()        # at import: a compiled graph's trace reads the table, never the disk
