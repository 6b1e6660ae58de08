"""What the mixture-of-experts kernels (kernel.py: any M; skinny.py: up to 16 rows) share:
which rows of a block chose an expert, where their results go, the float experts' dot."""

from __future__ import annotations

import triton
import triton.language as tl

from ..weight_tiles import INTERPRETED, dot_xwt


@triton.jit
def routed_rows(topk_ids, expert, rm, M, topk, TOPK: tl.constexpr):
    """For rows rm [BM]: the slot j in which each chose `expert`, and its row m * k + j of y
    [M * k, N], -1 where the row did not choose it (ids are distinct within a row)."""
    rt = tl.arange(0, TOPK)
    ids = tl.load(topk_ids + rm[:, None] * topk + rt[None, :],
                  mask=(rm < M)[:, None] & (rt < topk)[None, :], other=-1)   # [BM, TOPK]
    hit = ids == expert
    slot = tl.sum(tl.where(hit, rt[None, :], 0), axis=1)
    # one row index per row, not (m, j, chosen): the epilogue keeps it live across the K loop
    return slot, tl.where(tl.max(hit.to(tl.int32), axis=1) > 0, rm * topk + slot, -1)


@triton.jit
def store_chosen(out, acc, y_row, rn, N):
    """y[y_row, rn] = acc where y_row >= 0; out is y [M * k, N]."""
    dst = out + y_row[:, None] * N + rn[None, :]
    tl.store(dst, acc.to(out.dtype.element_ty), mask=(y_row >= 0)[:, None] & (rn < N)[None, :])


@triton.jit
def dot_float(x, w):
    """x [BM, BK] @ w [BN, BK]^T -> float32 [BM, BN], w as loaded (x's dtype)."""
    if w.dtype == tl.float32:
        if INTERPRETED:
            acc = tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), input_precision="tf32x3")
    else:
        acc = dot_xwt(x, w.to(tl.float32))     # upcast at once: the interpreter's bf16 quirk
    return acc


@triton.jit
def dot_float_rows(x, w, USE_DOT: tl.constexpr):
    """dot_float on tensor cores, or for 1-4 rows a broadcast multiply and a sum over K."""
    if USE_DOT:
        acc = dot_float(x, w)
    else:
        acc = tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    return acc
