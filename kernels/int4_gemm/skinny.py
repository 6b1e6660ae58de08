"""Triton int4 GEMMs for decode and verify (M <= 16 rows), split along K (kernels/split_k.py).

Same layout and arithmetic as kernel.py (q - zero of the even-k and odd-k nibbles against the
matching x columns, the group scale on each K step's partial sum), on the grid of split_k.py
with a configuration from gemm_configs.py. A K step covers up to 128 values (64 bytes of
every packed row) inside one group, unmasked along the row where the step lies inside K.

GATED: the packed weight holds a gate projection's rows, then an up projection's (2I rows,
their scales and zero points likewise); y = silu(gate) * up, [M, I].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..gemm_configs import RowsConfig
from ..split_k import dot_rows, finish, launch_rows, rows_specs
from ..weight_tiles import int4_tile


@triton.jit
def _int4_rows_kernel(x, packed, scale, zero, out, part, counts, M, N, K, stride_xm,
                      packed_cols, group, groups, steps, BLOCK_M: tl.constexpr,
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
    p_gate = rn[:, None] * packed_cols
    p_up = (rn + N)[:, None] * packed_cols
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if EVEN:
            even = tl.full((HALF,), 1, tl.int1)
            odd = even
        else:
            even = 2 * rj < k_hi - k0               # k0 + 2j < K: byte j holds a value
            odd = 2 * rj + 1 < k_hi - k0            # its high nibble too (not past odd K)
        xk = x + rm[:, None] * stride_xm + k0 + 2 * rj[None, :]       # x at k0 + 2j
        x_even = tl.load(xk, mask=mm[:, None] & even[None, :], other=0.0)
        x_odd = tl.load(xk + 1, mask=mm[:, None] & odd[None, :], other=0.0)
        w_even, w_odd, s = int4_tile(packed, p_gate, scale, zero, rn * groups, mn, even, k0,
                                     group, BLOCK_K)
        part_sum = dot_rows(x_even, w_even, USE_DOT) + dot_rows(x_odd, w_odd, USE_DOT)
        acc += part_sum * s[None, :]
        if GATED:
            u_even, u_odd, su = int4_tile(packed, p_up, scale, zero, (rn + N) * groups, mn,
                                          even, k0, group, BLOCK_K)
            up_sum = dot_rows(x_even, u_even, USE_DOT) + dot_rows(x_odd, u_odd, USE_DOT)
            up += up_sum * su[None, :]
    finish(acc, up, out, part, counts, pid_n, pid_k, rm[:, None] * N + rn[None, :],
           mm[:, None] & mn[None, :], M * N, SPLIT, GATED)


def int4_rows(rows: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
              zero: torch.Tensor, group: int, gated: bool = False,
              config: RowsConfig | None = None) -> torch.Tensor:
    """y [M, N] for rows [M <= 16, K] (operands checked by the caller); gated: N = packed
    rows / 2 and y = silu(gate) * up. `config` overrides the table's choice."""
    weights = dict(packed=packed, scale=scale, zero=zero, packed_cols=packed.shape[1],
                   group=group, groups=scale.shape[1])
    n = packed.shape[0] // 2 if gated else packed.shape[0]
    return launch_rows(_int4_rows_kernel, "int4", rows, n, group, weights, gated, config)


# W4A16 checkpoints (AWQ, GPTQ, compressed-tensors) group 128 along K
SPECS = rows_specs(_int4_rows_kernel, "int4", 128,
                   {"packed": "*u8", "scale": "*fp32", "zero": "*u8"},
                   lambda n, k: {"packed_cols": -(-k // 2), "group": 128,
                                 "groups": -(-k // 128)})
