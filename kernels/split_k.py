"""What the skinny weight-only GEMMs (decode and verify: M <= 16 rows) share.

A decode GEMM reads N x K weights for a handful of rows: its speed is how fast the weights
stream in, so the grid must keep every SM loading. N / BLOCK_N tiles are too few where N is
small against K (the 27B's MLP down: 80 tiles of 64 rows, 132 SMs on an H100), so K is split
too: grid (N tiles, SPLIT), each program sums its share of K. The sums meet without a second
launch: each program stores its fp32 partial tile, counts itself in at its tile's counter
(one atomic, acquire-release), and the program that arrives last adds the SPLIT partials in
split order (so the result does not depend on which one arrives last: the same bits every
run, eager or in a CUDA graph), runs the epilogue, stores y and puts the counter back to 0.
Counters therefore rest at zero between launches: eager launches share one buffer per device
and need no memset (launches on one stream, the engine's, never overlap; two streams running
split GEMMs at once would share counters). Inside a torch.compile trace each launch gets a
zeroed buffer of its own instead (`counters`), a small memset in the compiled graph.

The inner product is `dot_rows`: tensor cores (tl.dot on a 16-row tile, padding rows and
all), or fp32 FMAs on CUDA cores for a BLOCK_M of 1-4 rows, which only the measured table
chooses (gemm_configs: on an H200 the counted FMA configurations for 1-4 rows took
2.7-9x the time the 16-row tile took for 8).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemm_configs import COUNTERS, RowsConfig, choose, declared
from .specs import Spec, launch
from .weight_tiles import dot_xwt

# constexprs that follow the shape (a tiny test model launches other tiles than the 27B)
SHAPE_CONSTEXPRS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT", "EVEN")
_counters: dict[torch.device, torch.Tensor] = {}


@triton.jit
def dot_rows(x, w, USE_DOT: tl.constexpr):
    """x [BM, BK] as loaded @ w [BN, BK]^T (float32 values exact in x's dtype) -> float32
    [BM, BN]: tensor cores, or for a few rows a broadcast multiply and a sum over K."""
    if USE_DOT:
        acc = dot_xwt(x, w)
    else:
        acc = tl.sum(x.to(tl.float32)[:, None, :] * w[None, :, :], axis=2)
    return acc


@triton.jit
def silu_mul(gate, up):
    """silu(gate) * up; the sigmoid from exp(-|gate|), which never overflows."""
    e = tl.exp(-tl.abs(gate))
    sigmoid = tl.where(gate >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    return gate * sigmoid * up


@triton.jit
def partial_sum(part, offs, mask, stride, SPLIT: tl.constexpr):
    """The SPLIT partial tiles, `stride` apart, added in split order, read from L2 (.cg:
    never a line an SM's L1 kept)."""
    total = tl.load(part + offs, mask=mask, other=0.0, cache_modifier=".cg")
    for s in tl.static_range(1, SPLIT):
        total += tl.load(part + s * stride + offs, mask=mask, other=0.0, cache_modifier=".cg")
    return total


@triton.jit
def store_rows(out, offs, mask, acc, up, GATED: tl.constexpr):
    if GATED:
        acc = silu_mul(acc, up)
    tl.store(out + offs, acc.to(out.dtype.element_ty), mask=mask)


@triton.jit
def finish(acc, up, out, part, counts, tile, pid_k, offs, mask, tile_elems,
           SPLIT: tl.constexpr, GATED: tl.constexpr):
    """Store y for this program's tile (offs and mask: [BM, BN] into out [M, N]); split: store
    the partial sums (acc, and up when GATED; `tile_elems` = M * N apart) and let the last of
    the SPLIT programs of tile `tile` add them, store y and reset the counter."""
    if SPLIT == 1:
        store_rows(out, offs, mask, acc, up, GATED)
    else:
        halves: tl.constexpr = 2 if GATED else 1
        mine = part + pid_k * halves * tile_elems
        tl.store(mine + offs, acc, mask=mask)
        if GATED:
            tl.store(mine + tile_elems + offs, up, mask=mask)
        tl.debug_barrier()             # every thread's partial stored before the count
        if tl.atomic_add(counts + tile, 1, sem="acq_rel") == SPLIT - 1:
            acc = partial_sum(part, offs, mask, halves * tile_elems, SPLIT)
            if GATED:
                up = partial_sum(part + tile_elems, offs, mask, halves * tile_elems, SPLIT)
            store_rows(out, offs, mask, acc, up, GATED)
            tl.store(counts + tile, 0)


def launch_rows(kernel, family: str, rows: torch.Tensor, n: int, k_align: int,
                weights: dict, gated: bool, config: RowsConfig | None) -> torch.Tensor:
    """Launch one skinny GEMM `kernel` over rows [M <= 16, K] (operands checked by the
    caller): `weights` holds its weight arguments, n its output width (I when gated). The
    configuration is `config` (tests, tuning) or the table's choice; returns y [M, n]."""
    m, k = rows.shape
    if config is None:
        config = choose(family, n, k, m, rows.device, k_align, gated,
                        rows.dtype == torch.float32)
    if config.block_m < m:
        raise ValueError(f"{family} skinny GEMM: BLOCK_M {config.block_m} < {m} rows")
    tiles, steps, split = config.grid(n, k)
    out = torch.empty(m, n, dtype=rows.dtype, device=rows.device)
    args = dict(x=rows, **weights, out=out,
                part=workspace(split, 2 if gated else 1, m, n, rows.device),
                counts=counters(rows.device, tiles), M=m, N=n, K=k, stride_xm=rows.stride(0),
                steps=steps)
    meta = {**config.meta(), "SPLIT": split, "GATED": gated, "EVEN": k % config.block_k == 0}
    launch(kernel, (tiles, split), args, meta)
    return out


def rows_specs(kernel, family: str, k_align: int, weight_types: dict[str, str],
               weight_values) -> tuple[Spec, ...]:
    """The declared specializations of a family's skinny kernel (gemm_configs.DECLARED):
    `weight_types` its weight arguments' types, `weight_values(n, k)` the integer ones'
    values at a shape. Integers divisible by 16 there, and every pointer, are `aligned`."""
    specs = []
    for label, act, config, gated, n, k in declared(family, k_align):
        types = {"x": act, **weight_types, "out": act, "part": "*fp32", "counts": "*i32"}
        rows_n = 2 * n if gated else n
        values = {"M": 1, "N": n, "K": k, "stride_xm": k, **weight_values(rows_n, k),
                  "steps": config.grid(n, k)[1]}
        types.update(dict.fromkeys(values, "i32"))
        order = [name for name in kernel.arg_names if name in types]
        aligned = tuple(name for name in order if types[name].startswith("*")
                        or (name != "M" and values[name] % 16 == 0))
        meta = {**config.meta(), "GATED": gated, "EVEN": k % config.block_k == 0}
        specs.append(Spec.from_meta(kernel, label, {name: types[name] for name in order}, meta,
                                    shape_constexprs=SHAPE_CONSTEXPRS, aligned=aligned))
    return tuple(specs)


def counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed counters for `tiles` tiles: the device's own (made on first use; the kernels
    leave them at zero), or, inside a torch.compile trace, a fresh zeroed buffer (a
    module-level tensor must not be born inside a traced graph; a compiled graph pays a small
    memset for it)."""
    if torch.compiler.is_compiling():
        return torch.zeros(tiles, dtype=torch.int32, device=device)
    buf = _counters.get(device)
    if buf is None:
        buf = _counters[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return buf


def workspace(split: int, halves: int, m: int, n: int, device: torch.device) -> torch.Tensor:
    """Room for the partial tiles: [split, halves, m, n] float32 (a 1-element dummy when the
    kernel does not split, so every launch has the same argument types)."""
    if split == 1:
        return torch.empty(1, dtype=torch.float32, device=device)
    return torch.empty(split, halves, m, n, dtype=torch.float32, device=device)
