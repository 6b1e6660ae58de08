"""Triton y = x @ W.T over FP8 e4m3 weights with one float32 scale per (block_n x block_k).

Layout as in reference.py: x [..., K] (fp32, bf16 or fp16; leading dims flattened to M rows),
`weight` uint8 [N, K] of e4m3 bit patterns, `scale` float32 [ceil(N / block_n),
ceil(K / block_k)], a multiplier; y [..., N] in x's dtype. Grid (M tiles, N tiles): each
program walks K in BLOCK_K steps, decodes its [BLOCK_N, BLOCK_K] weight tile in registers and
accumulates in float32 with tl.dot. The tile sizes are fixed (not the model's N or K); only
BLOCK_M follows M: 16 rows for decode and verify blocks (the least tl.dot takes), 64 for
prefill chunks, where 16-row tiles would decode every weight tile M / 16 times.

The dot sees the weights unscaled: e4m3 values are exact in bf16 and fp16, so the
tensor-core products are exact and the block scale, constant over a K tile (block_k is a
multiple of BLOCK_K), multiplies the partial sum. Offsets are int32 (the launcher checks the
sizes): 64-bit offset tiles cost registers every program keeps. Shared with the NVFP4 and
int4 kernels: `e4m3_to_float`, `dot_xwt`, `check_operand`, `flatten_rows`, `int32_sizes`; with
the mixture-of-experts kernels (kernels/moe_gemm) also the weight-tile decode, `fp8_tile`.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..specs import Spec, launch

# Tiles and warps, from kernels/report.py: 64 x 64 weight tiles with 4 warps took 212-255
# registers and spilled in the 64-row prefill tiles (the report compiles without Triton's
# 16-byte alignment specialization, so every byte is its own load and pointer); K steps of 32
# with 8 warps hold 61-204 registers and no stack across the three formats.
BLOCK_N = 64
BLOCK_K = 32
NUM_WARPS = 8
ACTIVATIONS = (torch.float32, torch.bfloat16, torch.float16)
# The CPU interpreter stores bf16 as raw uint16 and multiplies those integers in tl.dot: under
# it every dot runs in fp32 (read at import; tests set the variable before importing kernels).
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def e4m3_to_float(bits):
    """uint8 e4m3fn bit patterns -> float32, exactly (NaN codes 0x7F / 0xFF never occur).

    Sign, exponent and mantissa moved into fp16's places: e4m3 (bias 7) read as fp16 (bias
    15) is the value times 2^-8, subnormals included (fp16's go down to 2^-24), so a shift and
    one power-of-two multiply decode it with no table and no branch.
    """
    b = bits.to(tl.int32)
    half = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return half.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def dot_xwt(x, w):
    """x [BM, BK] as loaded @ w [BN, BK]^T -> float32 [BM, BN], on tensor cores.

    `w` is float32 holding values exact in bf16 and fp16 (e4m3, E2M1 x e4m3, q - z), so the
    dot multiplies exactly and accumulates in fp32. fp32 x is split into three bf16 pieces
    (8 significant bits each: all 24 of x), three bf16 dots: exact products again, where
    tf32 would round x to 11 bits and IEEE fp32 would leave the tensor cores idle.
    """
    if INTERPRETED:
        acc = tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
    elif x.dtype == tl.float32:
        wt = tl.trans(w.to(tl.bfloat16))
        hi = x.to(tl.bfloat16)
        rest = x - hi.to(tl.float32)
        mid = rest.to(tl.bfloat16)
        lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
        acc = tl.dot(hi, wt, tl.dot(mid, wt, tl.dot(lo, wt)))     # smallest terms first
    else:
        acc = tl.dot(x, tl.trans(w.to(x.dtype)))
    return acc


@triton.jit
def fp8_tile(weight, w_off, s_rows, mn, mk, k0, block_k, BLOCK_K: tl.constexpr):
    """The weight tile at K offset k0: e4m3 decoded to float32 [BN, BK] (unscaled) and the
    block scale [BN] of each of its rows. w_off holds each row's offset in `weight` [BN, 1],
    s_rows points at each row's scale row [BN]; mn and mk mask rows and columns."""
    rk = tl.arange(0, BLOCK_K)
    wq = tl.load(weight + k0 + w_off + rk[None, :], mask=mn[:, None] & mk[None, :], other=0)
    s = tl.load(s_rows + k0 // block_k, mask=mn, other=0.0)          # [BN], one K block
    return e4m3_to_float(wq), s


@triton.jit
def _fp8_gemm_kernel(x, weight, scale, out, M, N, K, stride_xm, block_n, block_k, scale_cols,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mm = rm < M
    mn = rn < N
    x_off = rm[:, None] * stride_xm
    w_off = rn[:, None] * K
    s_rows = scale + (rn // block_n) * scale_cols
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = tl.arange(0, BLOCK_K)
        mk = rk < K - k0
        xt = tl.load(x + k0 + x_off + rk[None, :], mask=mm[:, None] & mk[None, :], other=0.0)
        w, s = fp8_tile(weight, w_off, s_rows, mn, mk, k0, block_k, BLOCK_K)
        acc += dot_xwt(xt, w) * s[None, :]
    dst = out + rm[:, None] * N + rn[None, :]
    tl.store(dst, acc.to(out.dtype.element_ty), mask=mm[:, None] & mn[None, :])


def check_operand(op: str, name: str, tensor: torch.Tensor, dtype: torch.dtype,
                  shape: tuple[int, ...], device: torch.device) -> None:
    """ValueError naming `name` unless it is a contiguous `dtype` tensor of `shape` on
    `device` (the kernels index weights as dense row-major arrays)."""
    if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{op}: {name} must be {dtype} {tuple(shape)}, got {tensor.dtype} "
                         f"{tuple(tensor.shape)}")
    if not tensor.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous")
    if tensor.device != device:
        raise ValueError(f"{op}: {name} is on {tensor.device}, x on {device}")


def flatten_rows(op: str, x: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> [M, K] with unit stride along K (a view when x allows it)."""
    if x.dtype not in ACTIVATIONS or x.dim() == 0:
        raise ValueError(f"{op}: x must be [..., K] in float32, bfloat16 or float16, got "
                         f"{x.dtype} {tuple(x.shape)}")
    rows = x.reshape(-1, x.shape[-1])                                  # [M, K]
    return rows if rows.stride(1) == 1 or rows.shape[1] == 1 else rows.contiguous()


def int32_sizes(op: str, rows: torch.Tensor, weight: torch.Tensor, n: int) -> None:
    """ValueError unless every offset the kernels form fits in int32."""
    if max(rows.shape[0] * rows.stride(0), weight.numel(), rows.shape[0] * n) >= 2**31:
        raise ValueError(f"{op}: x, weight or the output span 2^31 elements or more")


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int,
             block_k: int) -> torch.Tensor:
    """Same contract as the reference: x [..., K] -> [..., N]."""
    rows = flatten_rows("fp8_gemm", x)
    if weight.dim() != 2:
        raise ValueError(f"fp8_gemm: weight must be uint8 [N, K], got {tuple(weight.shape)}")
    n, k = weight.shape
    check_operand("fp8_gemm", "weight", weight, torch.uint8, (n, rows.shape[1]), x.device)
    if block_n < 1 or block_k < 1 or block_k % BLOCK_K:
        raise ValueError(f"fp8_gemm: block_n must be >= 1 and block_k a multiple of {BLOCK_K} "
                         f"(the kernel's K tile), got ({block_n}, {block_k})")
    check_operand("fp8_gemm", "scale", scale, torch.float32,
                  (triton.cdiv(n, block_n), triton.cdiv(k, block_k)), x.device)
    int32_sizes("fp8_gemm", rows, weight, n)
    m = rows.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m * n:
        options = meta(m)
        args = dict(x=rows, weight=weight, scale=scale, out=out, M=m, N=n, K=k,
                    stride_xm=rows.stride(0), block_n=block_n, block_k=block_k,
                    scale_cols=scale.shape[1])
        grid = (triton.cdiv(m, options["BLOCK_M"]), triton.cdiv(n, BLOCK_N))
        launch(_fp8_gemm_kernel, grid, args, options)
    return out.reshape(*x.shape[:-1], n)


def gemm_meta(m: int, block_k: int) -> dict:
    """Constexprs and launch options of the three GEMMs: fixed N and K tiles; 16 rows up to
    M = 16, else 64."""
    return {"BLOCK_M": 16 if m <= 16 else 64, "BLOCK_N": BLOCK_N, "BLOCK_K": block_k,
            "num_warps": NUM_WARPS, "num_stages": 3}


def meta(m: int) -> dict:
    return gemm_meta(m, BLOCK_K)


def _spec(model: str, act: str, m: int) -> Spec:
    types = {"x": act, "weight": "*u8", "scale": "*fp32", "out": act,
             **dict.fromkeys(("M", "N", "K", "stride_xm", "block_n", "block_k", "scale_cols"),
                             "i32")}
    label = f"fp8 {model} {act[1:]} M{'<=16' if m <= 16 else '>16'}"
    return Spec.from_meta(_fp8_gemm_kernel, label, types, meta(m))


# Qwen3.6-27B's FP8 layers (q/k/v/o, GDN in_proj_qkv/z/out_proj, MLP: K 5120 to 17408, block
# scales 128 x 128) with bf16 activations on Thor; the demo (hidden 192, MLP 512) in fp32. The
# tiles are the same at every shape: a spec per activation dtype and row tile (M <= 16:
# decode and verify blocks; M > 16: prefill chunks).
SPECS = tuple(_spec(model, act, m) for model, act in (("27B", "*bf16"), ("demo", "*fp32"))
              for m in (16, 64))
