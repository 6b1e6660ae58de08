"""Triton mixture-of-experts GEMMs for decode and verify (M <= 16 rows), split along K.

Same contract, layouts and arithmetic as kernel.py; the grid and the K loop are the skinny
2-D GEMMs' (kernels/split_k.py). Grid (N tiles, splits, E): program (n, s, e) loads the ids
of all M rows and exits at once when none chose expert e; otherwise it reads the x rows that
chose e (x[m, j or 0]) and walks its share of K over expert e's weight tile, 64 bytes of
every weight row a step (16-byte loads where the step lies inside K), on tensor cores (the
FMA path for 1-4 rows where a configuration asks for it). A decode step's 8 chosen experts
of 256 leave few working programs (8 experts x N / 64 tiles), so K is split until N tiles x
splits x the experts chosen reach 4 programs per SM: the partial sums of (m, j) land where
y[m, j] will (each (m, j) belongs to one expert, so a split's partials never collide) and
the last program of (e, n) to arrive adds them in split order and stores y. Counters: one
per (e, n) tile.

The configuration is counted (gemm_configs.heuristic over the N of every chosen expert
together), not measured: the experts a step reads change every step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..gemm_configs import COUNTERS, DECLARED_MOE, RowsConfig, heuristic, sm_count
from ..specs import Spec, launch
from ..split_k import SHAPE_CONSTEXPRS, counters, dot_rows, finish, workspace
from ..weight_tiles import fp8_tile, int4_tile, nvfp4_tile
from .tiles import dot_float_rows, routed_rows


@triton.jit
def _moe_float_rows_kernel(x, topk_ids, weight, out, part, counts, M, N, K, topk, stride_xm,
                           stride_xs, steps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, TOPK: tl.constexpr,
                           EVEN: tl.constexpr, GATED: tl.constexpr):
    expert = tl.program_id(2)
    rm = tl.arange(0, BLOCK_M)
    slot, y_row = routed_rows(topk_ids, expert, rm, M, topk, TOPK)
    if tl.max(y_row, axis=0) < 0:                         # no row chose this expert
        return
    chosen = y_row >= 0
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mn = rn < N
    x_off = rm[:, None] * stride_xm + slot[:, None] * stride_xs      # x[m, j or 0]
    weight += expert.to(tl.int64) * (2 * N if GATED else N) * K
    k_lo = tl.program_id(1) * steps * BLOCK_K
    k_hi = tl.minimum(K, k_lo + steps * BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if EVEN:
            mk = tl.full((BLOCK_K,), 1, tl.int1)
        else:
            mk = rk < k_hi - k0
        xt = tl.load(x + x_off + k0 + rk[None, :], mask=chosen[:, None] & mk[None, :],
                     other=0.0)
        w = tl.load(weight + rn[:, None] * K + k0 + rk[None, :],
                    mask=mn[:, None] & mk[None, :], other=0.0)
        acc += dot_float_rows(xt, w, BLOCK_M >= 16)
        if GATED:
            u = tl.load(weight + (rn + N)[:, None] * K + k0 + rk[None, :],
                        mask=mn[:, None] & mk[None, :], other=0.0)
            up += dot_float_rows(xt, u, BLOCK_M >= 16)
    finish(acc, up, out, part, counts, expert * tl.num_programs(0) + tl.program_id(0),
           tl.program_id(1), y_row[:, None] * N + rn[None, :], chosen[:, None] & mn[None, :],
           M * topk * N, SPLIT, GATED)


@triton.jit
def _moe_fp8_rows_kernel(x, topk_ids, weight, scale, out, part, counts, M, N, K, topk,
                         stride_xm, stride_xs, block_n, block_k, scale_cols, steps,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         SPLIT: tl.constexpr, TOPK: tl.constexpr, EVEN: tl.constexpr,
                         GATED: tl.constexpr):
    expert = tl.program_id(2)
    rm = tl.arange(0, BLOCK_M)
    slot, y_row = routed_rows(topk_ids, expert, rm, M, topk, TOPK)
    if tl.max(y_row, axis=0) < 0:
        return
    chosen = y_row >= 0
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mn = rn < N
    x_off = rm[:, None] * stride_xm + slot[:, None] * stride_xs
    rows: tl.constexpr = 2 if GATED else 1            # weight rows per output column
    weight += expert.to(tl.int64) * (rows * N) * K
    scale += expert.to(tl.int64) * tl.cdiv(rows * N, block_n) * scale_cols
    s_rows = scale + (rn // block_n) * scale_cols
    s_up = scale + ((rn + N) // block_n) * scale_cols
    k_lo = tl.program_id(1) * steps * BLOCK_K
    k_hi = tl.minimum(K, k_lo + steps * BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if EVEN:
            mk = tl.full((BLOCK_K,), 1, tl.int1)
        else:
            mk = rk < k_hi - k0
        xt = tl.load(x + x_off + k0 + rk[None, :], mask=chosen[:, None] & mk[None, :],
                     other=0.0)
        w, s = fp8_tile(weight, rn[:, None] * K, s_rows, mn, mk, k0, block_k, BLOCK_K)
        acc += dot_rows(xt, w, BLOCK_M >= 16) * s[None, :]
        if GATED:
            u, su = fp8_tile(weight, (rn + N)[:, None] * K, s_up, mn, mk, k0, block_k,
                             BLOCK_K)
            up += dot_rows(xt, u, BLOCK_M >= 16) * su[None, :]
    finish(acc, up, out, part, counts, expert * tl.num_programs(0) + tl.program_id(0),
           tl.program_id(1), y_row[:, None] * N + rn[None, :], chosen[:, None] & mn[None, :],
           M * topk * N, SPLIT, GATED)


@triton.jit
def _moe_nvfp4_rows_kernel(x, topk_ids, packed, scale, global_scale, out, part, counts, M, N,
                           K, topk, stride_xm, stride_xs, stride_p, stride_s, steps,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, TOPK: tl.constexpr,
                           EVEN: tl.constexpr, GATED: tl.constexpr):
    HALF: tl.constexpr = BLOCK_K // 2
    USE_DOT: tl.constexpr = BLOCK_M >= 16
    expert = tl.program_id(2)
    rm = tl.arange(0, BLOCK_M)
    slot, y_row = routed_rows(topk_ids, expert, rm, M, topk, TOPK)
    if tl.max(y_row, axis=0) < 0:
        return
    chosen = y_row >= 0
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rj = tl.arange(0, HALF)
    mn = rn < N
    x_off = rm[:, None] * stride_xm + slot[:, None] * stride_xs
    rows: tl.constexpr = 2 if GATED else 1            # weight rows per output column
    packed += expert.to(tl.int64) * (rows * N) * stride_p
    scale += expert.to(tl.int64) * (rows * N) * stride_s
    k_lo = tl.program_id(1) * steps * BLOCK_K
    k_hi = tl.minimum(K, k_lo + steps * BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        w_even, w_odd = nvfp4_tile(packed, rn[:, None] * stride_p, scale,
                                   rn[:, None] * stride_s, mn, k0, k_hi, BLOCK_N, BLOCK_K, EVEN)
        xk = x + x_off + k0 + 2 * rj[None, :]                         # x at k0 + 2j
        xm = chosen[:, None] & (rj < (k_hi - k0) // 2)[None, :]
        x_even = tl.load(xk, mask=xm, other=0.0)
        x_odd = tl.load(xk + 1, mask=xm, other=0.0)
        acc += dot_rows(x_even, w_even, USE_DOT) + dot_rows(x_odd, w_odd, USE_DOT)
        if GATED:
            u_even, u_odd = nvfp4_tile(packed, (rn + N)[:, None] * stride_p, scale,
                                       (rn + N)[:, None] * stride_s, mn, k0, k_hi, BLOCK_N,
                                       BLOCK_K, EVEN)
            up += dot_rows(x_even, u_even, USE_DOT) + dot_rows(x_odd, u_odd, USE_DOT)
    acc = acc * tl.load(global_scale + expert * rows)
    if GATED:
        up = up * tl.load(global_scale + expert * rows + 1)
    finish(acc, up, out, part, counts, expert * tl.num_programs(0) + tl.program_id(0),
           tl.program_id(1), y_row[:, None] * N + rn[None, :], chosen[:, None] & mn[None, :],
           M * topk * N, SPLIT, GATED)


@triton.jit
def _moe_int4_rows_kernel(x, topk_ids, packed, scale, zero, out, part, counts, M, N, K, topk,
                          stride_xm, stride_xs, packed_cols, group, groups, steps,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          SPLIT: tl.constexpr, TOPK: tl.constexpr, EVEN: tl.constexpr,
                          GATED: tl.constexpr):
    HALF: tl.constexpr = BLOCK_K // 2
    USE_DOT: tl.constexpr = BLOCK_M >= 16
    expert = tl.program_id(2)
    rm = tl.arange(0, BLOCK_M)
    slot, y_row = routed_rows(topk_ids, expert, rm, M, topk, TOPK)
    if tl.max(y_row, axis=0) < 0:
        return
    chosen = y_row >= 0
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rj = tl.arange(0, HALF)
    mn = rn < N
    x_off = rm[:, None] * stride_xm + slot[:, None] * stride_xs
    rows: tl.constexpr = 2 if GATED else 1            # weight rows per output column
    packed += expert.to(tl.int64) * (rows * N) * packed_cols
    scale += expert.to(tl.int64) * (rows * N) * groups
    zero += expert.to(tl.int64) * (rows * N) * groups
    k_lo = tl.program_id(1) * steps * BLOCK_K
    k_hi = tl.minimum(K, k_lo + steps * BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if EVEN:
            even = tl.full((HALF,), 1, tl.int1)
            odd = even
        else:
            even = 2 * rj < k_hi - k0
            odd = 2 * rj + 1 < k_hi - k0
        w_even, w_odd, s = int4_tile(packed, rn[:, None] * packed_cols, scale, zero,
                                     rn * groups, mn, even, k0, group, BLOCK_K)
        xk = x + x_off + k0 + 2 * rj[None, :]
        x_even = tl.load(xk, mask=chosen[:, None] & even[None, :], other=0.0)
        x_odd = tl.load(xk + 1, mask=chosen[:, None] & odd[None, :], other=0.0)
        part_sum = dot_rows(x_even, w_even, USE_DOT) + dot_rows(x_odd, w_odd, USE_DOT)
        acc += part_sum * s[None, :]
        if GATED:
            u_even, u_odd, su = int4_tile(packed, (rn + N)[:, None] * packed_cols, scale, zero,
                                          (rn + N) * groups, mn, even, k0, group, BLOCK_K)
            up_sum = dot_rows(x_even, u_even, USE_DOT) + dot_rows(x_odd, u_odd, USE_DOT)
            up += up_sum * su[None, :]
    finish(acc, up, out, part, counts, expert * tl.num_programs(0) + tl.program_id(0),
           tl.program_id(1), y_row[:, None] * N + rn[None, :], chosen[:, None] & mn[None, :],
           M * topk * N, SPLIT, GATED)


# format -> (kernel, the 2-D family whose K steps it takes, its weights' own integer arguments)
KERNELS = {"float": (_moe_float_rows_kernel, "float", ()),
           "fp8": (_moe_fp8_rows_kernel, "fp8", ("block_n", "block_k", "scale_cols")),
           "nvfp4": (_moe_nvfp4_rows_kernel, "nvfp4", ("stride_p", "stride_s")),
           "int4": (_moe_int4_rows_kernel, "int4", ("packed_cols", "group", "groups"))}


def moe_config(fmt: str, n: int, k: int, rows: int, experts: int, topk: int, sms: int,
               k_align: int, fp32: bool, gated: bool = False, fma: bool = False
               ) -> RowsConfig:
    """The counted configuration: the 2-D one over the N of every expert a block can choose
    (at most rows x k of them), so the split fills the GPU with the programs that work; fma:
    the FMA path's (gemm_configs.heuristic)."""
    active = min(experts, rows * topk)
    return heuristic(KERNELS[fmt][1], n * active, k, rows, sms, k_align, gated, fp32, fma)


def moe_rows(fmt: str, x: torch.Tensor, ids: torch.Tensor, experts: int, n: int,
             weights: dict, ints: dict, k_align: int, config: RowsConfig | None = None,
             gated: bool = False) -> torch.Tensor:
    """y [M, k, N] for x [M <= 16, S, K] and int32 ids [M, k] (operands checked by the
    caller, kernel.py's launchers); gated: each expert's gate rows then up rows, n the
    output width I, y = silu(gate) * up. `config` overrides the counted configuration."""
    kernel = KERNELS[fmt][0]
    m, s, k = x.shape
    topk = ids.shape[1]
    if config is None:
        config = moe_config(fmt, n, k, m, experts, topk, sm_count(x.device), k_align,
                            x.dtype == torch.float32, gated)
    if config.block_m < m:
        raise ValueError(f"moe {fmt} skinny GEMM: BLOCK_M {config.block_m} < {m} rows")
    tiles, steps, split = config.grid(n, k)
    if experts * tiles > COUNTERS:
        tiles, steps, split = tiles, -(-k // config.block_k), 1
    out = torch.empty(m, topk, n, dtype=x.dtype, device=x.device)
    args = dict(x=x, topk_ids=ids, **weights, out=out,
                part=workspace(split, 2 if gated else 1, m * topk, n, x.device),
                counts=counters(x.device, experts * tiles),
                M=m, N=n, K=k, topk=topk, stride_xm=x.stride(0),
                stride_xs=x.stride(1) if s > 1 else 0, **ints, steps=steps)
    meta = {**config.meta(), "SPLIT": split, "TOPK": triton.next_power_of_2(topk),
            "EVEN": k % config.block_k == 0, "GATED": gated}
    launch(kernel, (tiles, split, experts), args, meta)
    return out


def _specs() -> tuple[Spec, ...]:
    """The experts of gemm_configs.DECLARED_MOE (Qwen3.6-35B-A3B's, Flash-Next's) in each
    format, bf16 rows, one row (FMA path and tensor cores) and 16; the demo-sized fp32
    variant the CPU tests launch. The ids tile's width (TOPK) is a specialization of its
    own."""
    weight_types = {"float": lambda act: {"weight": act},
                    "fp8": lambda act: {"weight": "*u8", "scale": "*fp32"},
                    "nvfp4": lambda act: {"packed": "*u8", "scale": "*u8",
                                          "global_scale": "*fp32"},
                    "int4": lambda act: {"packed": "*u8", "scale": "*fp32", "zero": "*u8"}}
    align = {"float": 16, "fp8": 128, "nvfp4": 16, "int4": 128}
    INT_VALUES = {"float": lambda n, k: {},
                  "fp8": lambda n, k: {"block_n": 128, "block_k": 128,
                                       "scale_cols": -(-k // 128)},
                  "nvfp4": lambda n, k: {"stride_p": k // 2, "stride_s": k // 16},
                  "int4": lambda n, k: {"packed_cols": -(-k // 2), "group": 128,
                                        "groups": -(-k // 128)}}
    out: dict[tuple, Spec] = {}
    for fmt, (kernel, _, ints) in KERNELS.items():
        for model, act, proj, n, k, experts, topk, sms in DECLARED_MOE:
            gated = proj == "up"                  # gate and up stacked, as the loader fuses
            for rows, fma in ((1, True), (1, False), (16, False)):
                config = moe_config(fmt, n, k, rows, experts, topk, sms, align[fmt],
                                    act == "*fp32", gated, fma)
                types = {"x": act, "topk_ids": "*i32", **weight_types[fmt](act), "out": act,
                         "part": "*fp32", "counts": "*i32",
                         **dict.fromkeys(("M", "N", "K", "topk", "stride_xm", "stride_xs",
                                          *ints, "steps"), "i32")}
                even = k % config.block_k == 0
                meta = {**config.meta(), "TOPK": triton.next_power_of_2(topk), "EVEN": even,
                        "GATED": gated}
                s = 1 if proj == "up" else topk
                values = {"M": 1, "N": n, "K": k, "topk": topk, "stride_xm": s * k,
                          "stride_xs": k if s > 1 else 0, **INT_VALUES[fmt](n, k),
                          "steps": config.grid(n, k)[1]}
                aligned = tuple(name for name, kind in types.items() if kind.startswith("*")
                                or (name != "M" and values[name] % 16 == 0))
                label = (f"{fmt} rows {model} {act[1:]} {'gate_up' if gated else proj} M{rows}"
                         f" {sms} SMs")
                key = (kernel, act, config, even, gated, meta["TOPK"])
                out.setdefault(key, Spec.from_meta(
                    kernel, label, types, meta, aligned=aligned,
                    shape_constexprs=(*SHAPE_CONSTEXPRS, "TOPK")))
    return tuple(out.values())


SPECS = _specs()
