"""Triton FP8 GEMMs for decode and verify (M <= 16 rows), split along K (kernels/split_k.py).

Same layout and arithmetic as kernel.py (e4m3 decoded in registers, the block scale on each
K step's partial sum), on the grid of split_k.py with a configuration from gemm_configs.py.
A K step covers 64 values (64 bytes of every weight row), inside one scale block, unmasked
along the row where the step lies inside K, so the loads can be 16-byte vectors.

GATED: the weight holds a gate projection's rows, then an up projection's (2I rows; I a
multiple of block_n, so no scale block straddles the two); y = silu(gate) * up, [M, I].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..gemm_configs import RowsConfig
from ..split_k import dot_rows, finish, launch_rows, rows_specs
from ..weight_tiles import fp8_tile


@triton.jit
def _fp8_rows_kernel(x, weight, scale, out, part, counts, M, N, K, stride_xm, block_n, block_k,
                     scale_cols, steps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, GATED: tl.constexpr,
                     EVEN: tl.constexpr):
    USE_DOT: tl.constexpr = BLOCK_M >= 16
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mm = rm < M
    mn = rn < N
    k_lo = pid_k * steps * BLOCK_K            # a multiple of BLOCK_K the compiler can see
    k_hi = tl.minimum(K, k_lo + steps * BLOCK_K)
    w_gate = rn[:, None] * K
    w_up = (rn + N)[:, None] * K
    s_gate = scale + (rn // block_n) * scale_cols
    s_up = scale + ((rn + N) // block_n) * scale_cols
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if EVEN:
            mk = tl.full((BLOCK_K,), 1, tl.int1)
        else:
            mk = rk < k_hi - k0
        xt = tl.load(x + rm[:, None] * stride_xm + k0 + rk[None, :],
                     mask=mm[:, None] & mk[None, :], other=0.0)
        w, s = fp8_tile(weight, w_gate, s_gate, mn, mk, k0, block_k, BLOCK_K)
        acc += dot_rows(xt, w, USE_DOT) * s[None, :]
        if GATED:
            u, su = fp8_tile(weight, w_up, s_up, mn, mk, k0, block_k, BLOCK_K)
            up += dot_rows(xt, u, USE_DOT) * su[None, :]
    finish(acc, up, out, part, counts, pid_n, pid_k, rm[:, None] * N + rn[None, :],
           mm[:, None] & mn[None, :], M * N, SPLIT, GATED)


def fp8_rows(rows: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int,
             block_k: int, gated: bool = False, config: RowsConfig | None = None
             ) -> torch.Tensor:
    """y [M, N] for rows [M <= 16, K] (operands checked by the caller); gated: N = weight
    rows / 2 and y = silu(gate) * up. `config` overrides the table's choice."""
    weights = dict(weight=weight, scale=scale, block_n=block_n, block_k=block_k,
                   scale_cols=scale.shape[1])
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    return launch_rows(_fp8_rows_kernel, "fp8", rows, n, block_k, weights, gated, config)


# the 27B's FP8 checkpoints scale 128 x 128 blocks
SPECS = rows_specs(_fp8_rows_kernel, "fp8", 128, {"weight": "*u8", "scale": "*fp32"},
                   lambda n, k: {"block_n": 128, "block_k": 128,
                                 "scale_cols": -(-k // 128)})
