"""Triton commit of a verify's accepted rows: one launch replays every layer's GDN state.

Grid (sequence, layer, program): programs below Hv x value blocks each hold a [Dk, BV] slice
of one head's state in registers and apply the kept rows S = S * exp(g_t) + k_t (x) delta_t
in order, with the same float32 operations as gdn_steps' kernel, so the state equals the one
that kernel reached after those rows; the remaining programs rebuild the conv window (a
copy). The state is read and written once per sequence, whatever the count.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..gdn_steps.kernel import BV_MAX
from ..specs import Spec, launch
from .reference import check_commit, host_counts

BLOCK = 1024
NUM_WARPS = 4


@triton.jit
def _commit_kernel(state, k_rows, delta_rows, g_rows, conv, conv_rows, count, num_seqs, slots,
                   hk, hv, dk, dv, value_blocks, conv_numel, conv_width,
                   BK: tl.constexpr, BV: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    layer = tl.program_id(1)
    p = tl.program_id(2)
    n = tl.load(count + b).to(tl.int32)
    lb = layer.to(tl.int64) * num_seqs + b
    if p < hv * value_blocks:
        h = p // value_blocks
        kh = h // (hv // hk)
        ik = tl.arange(0, BK)
        iv = (p % value_blocks) * BV + tl.arange(0, BV)
        mk = ik < dk
        mv = iv < dv
        mkv = mk[:, None] & mv[None, :]
        s_off = (lb * hv + h) * dk * dv + ik[:, None] * dv + iv[None, :]
        s = tl.load(state + s_off, mask=mkv, other=0.0)
        for t in range(0, n):
            row = lb * slots + t
            kt = tl.load(k_rows + (row * hk + kh) * dk + ik, mask=mk, other=0.0)
            dt = tl.load(delta_rows + (row * hv + h) * dv + iv, mask=mv, other=0.0)
            gt = tl.load(g_rows + row * hv + h)
            s = s * tl.exp(gt)
            s = s + kt[:, None] * dt[None, :]
        tl.store(state + s_off, s, mask=mkv)
    else:
        offs = (p - hv * value_blocks) * BLOCK + tl.arange(0, BLOCK)
        keep = offs < conv_numel
        # rows n .. n+K-2 of [window before the block ; block rows]
        src = conv_rows + lb * (conv_numel + slots * conv_width) + n * conv_width + offs
        tl.store(conv + lb * conv_numel + offs, tl.load(src, mask=keep), mask=keep)


def gdn_commit(
    state: torch.Tensor,
    k_rows: torch.Tensor,
    delta_rows: torch.Tensor,
    g_rows: torch.Tensor,
    conv_state: torch.Tensor,
    conv_rows: torch.Tensor,
    count: torch.Tensor,
) -> None:
    """Same contract as the reference (count [B] in 0..S, not checked on a GPU: that would
    be a host sync; a count past S reads rows beyond the sequence's own)."""
    check_commit(state, k_rows, delta_rows, g_rows, conv_state, conv_rows, count)
    for name, t in (("state", state), ("k_rows", k_rows), ("delta_rows", delta_rows),
                    ("g_rows", g_rows), ("conv_state", conv_state), ("conv_rows", conv_rows)):
        if not t.is_contiguous():
            raise ValueError(f"gdn_commit: {name} must be contiguous")
        if t.dtype != torch.float32:
            raise ValueError(f"gdn_commit: {name} must be float32, got {t.dtype}")
    if not count.is_cuda:
        host_counts(count, delta_rows.shape[2])
    layers, seqs, hv, dk, dv = state.shape
    if layers == 0 or seqs == 0:
        return
    options = meta(dk, dv)
    value_blocks = triton.cdiv(dv, options["BV"])
    conv_numel = conv_state[0, 0].numel()
    grid = (seqs, layers, hv * value_blocks + triton.cdiv(max(conv_numel, 1), BLOCK))
    args = dict(state=state, k_rows=k_rows, delta_rows=delta_rows, g_rows=g_rows,
                conv=conv_state, conv_rows=conv_rows, count=count.to(torch.int32).contiguous(),
                num_seqs=seqs, slots=delta_rows.shape[2], hk=k_rows.shape[3], hv=hv, dk=dk,
                dv=dv, value_blocks=value_blocks, conv_numel=conv_numel,
                conv_width=conv_state.shape[-1])
    launch(_commit_kernel, grid, args, options)


def meta(dk: int, dv: int) -> dict:
    """Constexprs and launch options: a [BK, BV] slice of one head's state per program, as
    gdn_steps holds it."""
    return {"BK": triton.next_power_of_2(dk), "BV": min(triton.next_power_of_2(dv), BV_MAX),
            "BLOCK": BLOCK, "num_warps": NUM_WARPS, "num_stages": 3}


_INTS = ("num_seqs", "slots", "hk", "hv", "dk", "dv", "value_blocks", "conv_numel",
         "conv_width")


def _spec(model: str, dk: int, dv: int) -> Spec:
    types = {**dict.fromkeys(("state", "k_rows", "delta_rows", "g_rows", "conv", "conv_rows"),
                             "*fp32"), "count": "*i32", **dict.fromkeys(_INTS, "i32")}
    return Spec.from_meta(_commit_kernel, f"{model} fp32 state and conv window", types,
                          meta(dk, dv), per_cycle=True, shape_constexprs=("BK", "BV"))


# The 27B's 128x128 heads and the demo's 32x48, as gdn_steps' specs.
SPECS = (_spec("27B", 128, 128), _spec("demo", 32, 48))
