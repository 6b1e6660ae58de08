"""Triton NVFP4 GEMMs for decode and verify (M <= 16 rows), split along K (kernels/split_k.py).

Same layout and arithmetic as kernel.py (even-k and odd-k nibbles against the matching x
columns, the e4m3 group scales applied in the tile decode, the global scale once on the sum),
on the grid of split_k.py with a configuration from gemm_configs.py. A K step covers 256
values: 128 bytes of every packed row and 16 scale bytes, unmasked along the row where the
step lies inside K, so each thread's share loads as 16-byte vectors.

GATED: the weight holds a gate projection's rows, then an up projection's (2I rows, a global
scale each: global_scale [2]); a program decodes the two tiles at the same K offsets and
writes silu(x @ gate.T) * (x @ up.T), [M, I], so x is read once and y is stored once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..gemm_configs import RowsConfig
from ..split_k import dot_rows, finish, launch_rows, rows_specs
from ..weight_tiles import nvfp4_tile
from .reference import GROUP


@triton.jit
def _nvfp4_rows_kernel(x, packed, scale, global_scale, out, part, counts, M, N, K, stride_xm,
                       stride_p, stride_s, steps, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                       GATED: tl.constexpr, EVEN: tl.constexpr):
    HALF: tl.constexpr = BLOCK_K // 2
    USE_DOT: tl.constexpr = BLOCK_M >= 16
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rj = tl.arange(0, HALF)
    mm = rm < M
    mn = rn < N
    k_lo = pid_k * steps * BLOCK_K            # a multiple of BLOCK_K the compiler can see
    k_hi = tl.minimum(K, k_lo + steps * BLOCK_K)
    p_gate = rn[:, None] * stride_p
    s_gate = rn[:, None] * stride_s
    p_up = (rn + N)[:, None] * stride_p
    s_up = (rn + N)[:, None] * stride_s
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        xk = x + rm[:, None] * stride_xm + k0 + 2 * rj[None, :]       # x at k0 + 2j
        xm = mm[:, None] & (rj < (k_hi - k0) // 2)[None, :]
        x_even = tl.load(xk, mask=xm, other=0.0)
        x_odd = tl.load(xk + 1, mask=xm, other=0.0)
        w_even, w_odd = nvfp4_tile(packed, p_gate, scale, s_gate, mn, k0, k_hi, BLOCK_N,
                                   BLOCK_K, EVEN)
        acc += dot_rows(x_even, w_even, USE_DOT) + dot_rows(x_odd, w_odd, USE_DOT)
        if GATED:
            u_even, u_odd = nvfp4_tile(packed, p_up, scale, s_up, mn, k0, k_hi, BLOCK_N,
                                       BLOCK_K, EVEN)
            up += dot_rows(x_even, u_even, USE_DOT) + dot_rows(x_odd, u_odd, USE_DOT)
    acc = acc * tl.load(global_scale)
    if GATED:
        up = up * tl.load(global_scale + 1)
    finish(acc, up, out, part, counts, pid_n, pid_k, rm[:, None] * N + rn[None, :],
           mm[:, None] & mn[None, :], M * N, SPLIT, GATED)


def nvfp4_rows(rows: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
               global_scale: torch.Tensor, gated: bool = False,
               config: RowsConfig | None = None) -> torch.Tensor:
    """y [M, N] for rows [M <= 16, K] (operands checked by the caller); gated: N = packed
    rows / 2 and y = silu(gate) * up. `config` overrides the table's choice."""
    weights = dict(packed=packed, scale=scale, global_scale=global_scale,
                   stride_p=packed.shape[1], stride_s=scale.shape[1])
    n = packed.shape[0] // 2 if gated else packed.shape[0]
    return launch_rows(_nvfp4_rows_kernel, "nvfp4", rows, n, GROUP, weights, gated, config)


SPECS = rows_specs(_nvfp4_rows_kernel, "nvfp4", GROUP,
                   {"packed": "*u8", "scale": "*u8", "global_scale": "*fp32"},
                   lambda n, k: {"stride_p": k // 2, "stride_s": k // GROUP})
