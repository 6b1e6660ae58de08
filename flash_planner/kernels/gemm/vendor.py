"""Vendor GEMMs for the weight formats, on the engine's own packed operands: the candidates
that bench/gpu.py (`--parts gemm`) times beside our kernels at the same shapes and rows.

DESIGN.md: a vendor kernel is a candidate beside ours, measured side by side, taken where
it is fastest and its numerics match what the checkpoint's recipe implies. Each candidate
says which numerics it computes:
  - `int4` tinygemm (torch.ops.aten._weight_int4pack_mm on CUDA, its _for_cpu twin here):
    W4A16 with a scale and a float zero per group along K, w = (q - 8) * scale + zero:
    our (q - z) * scale with zero = (8 - z) * scale, so the same weights up to that product's
    rounding ("exact" up to the zero's rounding: W4A16);
  - `fp8` cuBLASLt through torch._scaled_mm: both operands e4m3, rows scaled per row at
    call time, the weight re-scaled per output channel (the same bytes): W8A8, activations
    rounded to e4m3, so only for recipes that quantize activations;
  - `nvfp4` torch._scaled_mm on float4_e2m1fn_x2 multiplies e2m1 by e2m1 (W4A4) on
    compute capability 10.x: not wired here (its swizzled block-scale layout), said so.
Each is a function x [M, K] -> y [M, N] (x's dtype), or the reason it is not available.

`tune.tune_vendors` times the admissible ones beside our kernel per shape and row bucket and
records the winner in the device's table; `routed` builds the winners' functions for a
weight, which the engine's Linears call in place of ours at those buckets (engine/weights/
tuning.py). Admissible: numerics the checkpoint implies (the engine's Linears are weight-only,
so W4A16; W8A8 and W4A4 only for a recipe that quantizes activations) and a difference from
our kernel within that numerics' TOLERANCE.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from .reference import dequantize_fp8, swiglu_halves

TINYGEMM_GROUPS = (32, 64, 128, 256)
INNER_K_TILES = 8          # tinygemm's K tiling on CUDA: K a multiple of 8 x 16
E4M3_MAX = 448.0
WEIGHT_ONLY = ("W4A16",)
# largest |vendor - ours| over ours' largest |value| that a winner may show, per numerics:
# W4A16 differs by the zero's product rounding (bf16 scale/zero pairs on CUDA); W8A8 by the
# rows' e4m3 rounding (test/kernels/test_vendor_gemm.py measures both on a CPU)
TOLERANCE = {"W4A16": 2e-2, "W8A8": 1e-1}


@dataclass(frozen=True)
class Candidate:
    name: str
    numerics: str                                   # W4A16, W8A8, W4A4
    fn: Callable[[torch.Tensor], torch.Tensor] | None
    why_not: str = ""                               # where fn is None
    weight_bytes: int = 0


def candidates(fmt: str, operands: tuple, n: int, k: int) -> list[Candidate]:
    """The vendor candidates for one Linear [n, k] of format `fmt` (the engine's operands,
    QuantLinear.operands())."""
    if fmt == "int4":
        return [tinygemm(*operands, n=n, k=k)]
    if fmt == "fp8":
        return [scaled_mm_fp8(*operands, n=n, k=k)]
    if fmt == "nvfp4":
        return [Candidate("scaled_mm e2m1", "W4A4", None,
                          "block-scaled FP4 (float4_e2m1fn_x2, compute capability 10.x) "
                          "multiplies e2m1 by e2m1, and its swizzled scale layout is not "
                          "wired here")]
    return []


def routed(fmt: str, operands: tuple, n: int, k: int, gated: bool,
           names: set[str] | None = None) -> dict[str, Candidate]:
    """Name -> candidate for those in `names` (all: None) that this weight can run (`n` its stacked
    rows; gated: the function returns silu(gate) * up of the sums, as our fused kernel does)."""
    return {c.name: replace(c, fn=_gated(c.fn)) if gated else c
            for c in candidates(fmt, operands, n, k)
            if (names is None or c.name in names) and c.fn is not None}


def _gated(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    def gate_up(x: torch.Tensor) -> torch.Tensor:
        return swiglu_halves(fn(x).float()).to(x.dtype)
    return gate_up


def rel_diff(y: torch.Tensor, ours: torch.Tensor) -> float:
    """|y - ours| at its largest, over ours' largest |value|."""
    return ((y.float() - ours.float()).abs().max()
            / ours.float().abs().max().clamp(min=1e-30)).item()


def winner(ours_ms: float, measured: list[tuple[Candidate, float, float]],
           numerics: tuple[str, ...] = WEIGHT_ONLY) -> str:
    """The fastest admissible candidate's name among (candidate, ms, rel_diff) measured beside
    our kernel's `ours_ms`, "" where ours is at least as fast or none is admissible."""
    best, best_ms = "", ours_ms
    for c, ms, diff in measured:
        if c.numerics in numerics and diff <= TOLERANCE[c.numerics] and ms < best_ms:
            best, best_ms = c.name, ms
    return best


def tinygemm(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int, *,
             n: int, k: int) -> Candidate:
    name = "tinygemm int4"
    if group not in TINYGEMM_GROUPS or k % group or (packed.is_cuda and k % (INNER_K_TILES * 16)):
        return Candidate(name, "W4A16", None, f"tinygemm takes groups {TINYGEMM_GROUPS} "
                         f"dividing K (and K a multiple of {INNER_K_TILES * 16} on CUDA); "
                         f"this weight has group {group}, K {k}")
    q = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(n, -1)[:, :k].to(torch.int32)
    s = scale.float()
    zero_float = (8 - zero.float()) * s                  # w = (q - 8) * s + (8 - z) * s
    if packed.is_cuda:
        weight = torch.ops.aten._convert_weight_to_int4pack(
            (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), INNER_K_TILES)
        pairs = torch.stack([s.t(), zero_float.t()], dim=-1).to(torch.bfloat16).contiguous()

        def fn(x: torch.Tensor) -> torch.Tensor:
            return torch.ops.aten._weight_int4pack_mm(x.to(torch.bfloat16), weight, group,
                                                      pairs).to(x.dtype)
    else:
        weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        pairs = torch.stack([s.t(), zero_float.t()], dim=-1).contiguous()

        def fn(x: torch.Tensor) -> torch.Tensor:
            return torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.to(pairs.dtype), weight, group, pairs).to(x.dtype)
    return Candidate(name, "W4A16", fn, weight_bytes=weight.nbytes + pairs.nbytes)


def scaled_mm_fp8(weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int, *,
                  n: int, k: int) -> Candidate:
    """W8A8: the weight dequantized and re-quantized per output channel (e4m3, one fp32
    scale a row), the rows quantized per row when called."""
    w = dequantize_fp8(weight, scale, block_n, block_k).float()
    w_scale = (w.abs().amax(dim=1, keepdim=True) / E4M3_MAX).clamp(min=1e-12)
    wq = (w / w_scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)

    def fn(x: torch.Tensor) -> torch.Tensor:
        x_scale = (x.float().abs().amax(dim=1, keepdim=True) / E4M3_MAX).clamp(min=1e-12)
        xq = (x.float() / x_scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return torch._scaled_mm(xq, wq.t(), scale_a=x_scale, scale_b=w_scale.t(),
                                out_dtype=x.dtype if x.is_cuda else torch.float32).to(x.dtype)

    return Candidate("scaled_mm e4m3", "W8A8", fn, weight_bytes=wq.nbytes + w_scale.nbytes)
