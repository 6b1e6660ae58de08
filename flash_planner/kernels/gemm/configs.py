"""How the two GEMM kernels are launched: tiles, K split and warps per shape and device.

The tiled kernel (prefill chunks, M > 16) has fixed tiles: 64 x K-step weight tiles with 8
warps (kernels/report.py: 64 x 64 tiles with 4 warps took 212-255 registers and spilled in
the 64-row tiles; K steps of 32 with 8 warps hold 47-142 registers and no stack across the
formats), BLOCK_M 16 up to M = 16 and 64 above, where 16-row tiles would decode every weight
tile M / 16 times.

The skinny kernel (decode and verify, M <= 16) takes a configuration per (format, N, K, row
bucket, SM count; fused or not, fp32 rows or not): measured once per GPU (tune.py, the
table a GemmContext holds), else `heuristic`, which counts instead of measuring:
  - rows: every bucket on a 16-row tensor-core tile. The FMA path (BLOCK_M the bucket, 1-4
    rows) is a candidate for the measured table only: on an H200 (bench/gpu.py, counted
    configurations, CUDA events) it took 1.77 ms for one row of the 27B's FP8 lm_head, 3.10
    for two and 5.81 for four, where the 16-row tile took 0.65 for eight: its per-step sum
    across K costs more than the padding rows;
  - a K step reads 64 bytes of every weight row (fp8 64 values, nvfp4 and int4 128; fp8 and
    int4 held inside one scale block or group): 64 rows x 64 B = 4 KiB a step, 32 bytes (two
    16-byte vectors) per thread of a 4-warp program, at about 100 registers (kernels/report),
    so 4-5 programs fit an SM: 16-20 KiB in flight per SM, above the ~14 KiB an H100 SM needs
    to cover its share of 3 TB/s over ~600 ns of latency (Thor's needs ~8 KiB). The 4-bit
    formats' tensor-core tiles with bf16 rows run 2 warps of 128 rows (64 fused), 128 bytes
    a thread at 145-254 registers, no stack: 4-7 programs, 36-64 KiB in flight per SM. Every
    warp repeats x's loads, its even/odd split and the address arithmetic whatever its share
    of the tile, so a weight byte issues fewer instructions the more of them a warp holds
    (kernels/report, 27B and 35B-A3B shapes on sm_90: 4 warps of 32 bytes issue 1.2-1.3x
    the slots of 2 warps of 64, 2 warps of 128 0.87-0.91x those);
  - BLOCK_N keeps the FMA path's [BM, BN, BK] products at 64 fp32 per thread, and is halved
    for a fused gate and up projection, whose programs decode two tiles a step (the fp32
    demo's 16-row gated tiles spilled at 64);
  - fp32 rows on tensor cores use 8 warps and half the tile width, and half the K step when
    fused (the fp32 demo's tiles spilled at 4 warps, its MoE FP8 tiles at 8 warps and the
    full width, its fused MoE NVFP4 tiles at the full step);
  - SPLIT (a power of two, at most 16) makes N tiles x SPLIT reach 4 programs per SM, while
    every split keeps at least two K steps. Experts count the N of every expert a block can
    choose (at most rows x k of them): the split fills the GPU with the programs that work.
Buckets are powers of two: a 3-row verify runs the 4-row configuration.
"""

from __future__ import annotations

from dataclasses import dataclass

from .formats import FORMATS, TILED_K

COUNTERS = 1 << 14            # split-K tile counters per stream (skinny.py)
MAX_ROWS = 16                 # the skinny kernel's rows; more go to the tiled kernel
FMA_ROWS = 4                  # up to this bucket the FMA path; above, tensor cores
STEP_BYTES = 64               # bytes of one weight row per K step
PROGRAMS_PER_SM = 4
MAX_SPLIT = 16
PRODUCT_ELEMENTS = 64 * 128   # FMA path: fp32 products per program per step (64 a thread)
SKINNY_N = 64                 # skinny tensor-core tiles' weight rows (4-bit with bf16 rows: 2x)
TILED_N = 64
TILED_WARPS = 8


def tiled_meta(fmt: str, m: int, routed: bool, topk: int = 1) -> dict:
    """Constexprs and launch options of the tiled kernel."""
    form = FORMATS[fmt]
    return {"FORMAT": fmt, "ROUTED": routed, "BLOCK_M": 16 if m <= 16 else 64,
            "BLOCK_N": TILED_N, "BLOCK_K": form.routed_k if routed else form.tiled_k,
            "TOPK": 1 << (topk - 1).bit_length(), "num_warps": TILED_WARPS, "num_stages": 3}


@dataclass(frozen=True)
class RowsConfig:
    """One launch configuration of the skinny kernel."""

    block_m: int
    block_n: int
    block_k: int
    split: int
    num_warps: int = 4
    num_stages: int = 3

    @property
    def use_dot(self) -> bool:
        return self.block_m >= 16

    def grid(self, n: int, k: int, tiles_per_counter: int = 1) -> tuple[int, int, int]:
        """(N tiles, K steps per split, splits) of a launch at [N, K]: whole K steps per
        split, so the last split may be short and fewer splits than `split` may remain; no
        split where the tiles (times `tiles_per_counter`: the experts) would outnumber the
        counters."""
        tiles = -(-n // self.block_n)
        steps = -(-k // self.block_k)
        if self.split == 1 or tiles * tiles_per_counter > COUNTERS:
            return tiles, steps, 1
        per_split = -(-steps // self.split)
        return tiles, per_split, -(-steps // per_split)

    def meta(self) -> dict:
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "BLOCK_K": self.block_k,
                "SPLIT": self.split, "num_warps": self.num_warps, "num_stages": self.num_stages}


def bucket(rows: int) -> int:
    """The power of two at or above `rows` (1..16)."""
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"skinny GEMMs take 1 to {MAX_ROWS} rows, got {rows}")
    return 1 << (rows - 1).bit_length()


def step_k(fmt: str, k_align: int) -> int:
    """Values of a K step: STEP_BYTES of a row. NVFP4 tiles decode a scale per 16 values;
    fp8 and int4 scale a step's partial sum once per row, so their step stays inside one
    scale block or group (`k_align`: block_k, group), never below the tiled kernel's."""
    block_k = STEP_BYTES * 8 // FORMATS[fmt].bits
    while fmt != "nvfp4" and k_align % block_k and block_k > TILED_K:
        block_k //= 2
    return block_k


def heuristic(fmt: str, n: int, k: int, rows: int, sms: int, k_align: int,
              gated: bool = False, fp32: bool = False, fma: bool = False) -> RowsConfig:
    """The counted configuration (the module docstring); n is the output width (I when
    gated; for experts, times the experts a block can choose), fp32 whether the rows are
    float32; fma: the FMA path's configuration instead (up to FMA_ROWS rows)."""
    m = bucket(rows)
    if fma and m > FMA_ROWS:
        raise ValueError(f"the FMA path takes up to {FMA_ROWS} rows, got {rows}")
    block_k = step_k(fmt, k_align)
    block_m = m if fma else 16
    # the FMA product tile spans BK / 2 per even/odd half for the 4-bit formats
    width = block_k if FORMATS[fmt].bits == 8 else block_k // 2
    if block_m < 16:
        block_n = max(16, min(64, PRODUCT_ELEMENTS // (block_m * width)))
    elif FORMATS[fmt].bits == 4 and not fp32:
        block_n = 2 * SKINNY_N          # two warps, 128 bytes a thread (the docstring)
    else:
        block_n = SKINNY_N
    if gated:
        block_n //= 2
    tiles = -(-n // block_n)
    split = 1
    while (split < MAX_SPLIT and tiles * split < PROGRAMS_PER_SM * sms
           and k >= 2 * block_k * split * 2):
        split *= 2
    # fp32 rows take three bf16 dots each (tiles.dot_xwt): 8 warps share the registers of a
    # half-width tile. The 4-bit formats' 16-row tiles take 2: every warp repeats the step's
    # x loads and splits, and its address arithmetic, whatever its share of the weight tile
    warps = 2 if FORMATS[fmt].bits == 4 and block_m >= 16 else 4
    if fp32 and block_m >= 16:
        warps, block_n = 8, max(32, block_n // 2)
        if gated:                       # two tiles' three dots each: half the K step
            block_k = max(32, block_k // 2)
    return RowsConfig(block_m, block_n, block_k, split, num_warps=warps)


def candidates(fmt: str, n: int, k: int, rows: int, sms: int, k_align: int,
               gated: bool, fp32: bool) -> list[RowsConfig]:
    """What tune.py times: the counted configuration and its neighbours (half and double the
    split, other tile widths, the other warp count), and for 1-4 rows the FMA path's."""
    base = heuristic(fmt, n, k, rows, sms, k_align, gated, fp32)
    out = [base]
    if bucket(rows) <= FMA_ROWS:
        out.append(heuristic(fmt, n, k, rows, sms, k_align, gated, fp32, fma=True))
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


# ---- the declared shapes (kernels/report.py compiles their specializations)

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
