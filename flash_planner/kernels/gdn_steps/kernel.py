"""Triton gated delta rule over a block: a prefill chunk, a decode step or a verify.

Grid (sequence x value head, block of value columns): each program keeps a [Dk, BV] slice
of its head's state in registers and runs the T steps in order: q/k L2 normalisation and the
Dk^-0.5 query scale in the kernel, all math in float32 (the CPU interpreter gets bf16
arithmetic wrong; loads are upcast at once). Non-power-of-two head dims are masked. A verify
(KEEP_ROWS) leaves the state as it was and keeps each step's normalised k, delta and g
(kilobytes a row, where the state after every step was megabytes) for gdn_commit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..specs import Spec, launch
from .reference import Rows, check_state

# Value columns per program and warps: at the 27B's 128x128 heads, when a verify stored the
# state after every step, BV=32 with 4 warps took 254 registers and spilled compiled for
# sm_90/sm_110, BV=16 187; a verify keeping its rows holds 71-76 at BV=16 and no stack
# (kernels/report.py prints the figures; a wider BV is untried without a GPU to time it).
BV_MAX = 16
NUM_WARPS = 4


@triton.jit
def _gdn_steps_kernel(q, k, v, g, beta, state, k_rows, delta_rows, g_rows, out, steps, hk, hv,
                      dk, dv, slots, scale, KEEP_ROWS: tl.constexpr, BK: tl.constexpr,
                      BV: tl.constexpr):
    bh = tl.program_id(0)                       # b * Hv + h
    vb = tl.program_id(1)
    b = bh // hv
    h = bh % hv
    kh = h // (hv // hk)
    ik = tl.arange(0, BK)
    iv = vb * BV + tl.arange(0, BV)
    mk = ik < dk
    mv = iv < dv
    mkv = mk[:, None] & mv[None, :]
    s_off = bh.to(tl.int64) * dk * dv + ik[:, None] * dv + iv[None, :]
    s = tl.load(state + s_off, mask=mkv, other=0.0)
    for t in range(steps):
        row = b.to(tl.int64) * steps + t                              # index into [B, T]
        qt = tl.load(q + (row * hk + kh) * dk + ik, mask=mk, other=0.0).to(tl.float32)
        kt = tl.load(k + (row * hk + kh) * dk + ik, mask=mk, other=0.0).to(tl.float32)
        vt = tl.load(v + (row * hv + h) * dv + iv, mask=mv, other=0.0).to(tl.float32)
        gt = tl.load(g + row * hv + h).to(tl.float32)
        bt = tl.load(beta + row * hv + h).to(tl.float32)
        qt = qt / tl.sqrt(tl.sum(qt * qt, axis=0) + 1e-6) * scale
        kt = kt / tl.sqrt(tl.sum(kt * kt, axis=0) + 1e-6)
        s = s * tl.exp(gt)
        kv_mem = tl.sum(s * kt[:, None], axis=0)                      # [BV]
        delta = (vt - kv_mem) * bt
        s = s + kt[:, None] * delta[None, :]
        ot = tl.sum(s * qt[:, None], axis=0)
        tl.store(out + (row * hv + h) * dv + iv, ot.to(out.dtype.element_ty), mask=mv)
        if KEEP_ROWS:
            kept = b.to(tl.int64) * slots + t                         # [B, slots, ...] rows
            tl.store(delta_rows + (kept * hv + h) * dv + iv, delta, mask=mv)
            if vb == 0:
                tl.store(g_rows + kept * hv + h, gt)
                if h % (hv // hk) == 0:
                    tl.store(k_rows + (kept * hk + kh) * dk + ik, kt, mask=mk)
    if not KEEP_ROWS:
        tl.store(state + s_off, s, mask=mkv)


def gdn_steps(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    rows: Rows | None = None,
) -> torch.Tensor:
    """Same contract as the reference: q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta
    [B, T, Hv]; state [B, Hv, Dk, Dv] float32, updated in place, or with `rows` (k_rows
    [B, S, Hk, Dk], delta_rows [B, S, Hv, Dv], g_rows [B, S, Hv], float32, S >= T) read only
    while each step's k, delta and g are kept. Returns o [B, T, Hv, Dv].
    """
    b, t, hk, dk = k.shape
    hv, dv = v.shape[-2:]
    check_state(k, v, state, rows)
    if rows is not None and not all(r.is_contiguous() for r in rows):
        raise ValueError("gdn_steps: the kept rows must be contiguous")
    if not state.is_contiguous():
        raise ValueError("gdn_steps: state must be contiguous")
    out = torch.empty(b, t, hv, dv, dtype=v.dtype, device=v.device)
    if b * t == 0:
        return out
    options = meta(dk, dv, rows is not None)
    k_rows, delta_rows, g_rows = rows if rows is not None else (state,) * 3   # unused then
    args = dict(q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), g=g.contiguous(),
                beta=beta.contiguous(), state=state, k_rows=k_rows, delta_rows=delta_rows,
                g_rows=g_rows, out=out, steps=t, hk=hk, hv=hv, dk=dk, dv=dv,
                slots=delta_rows.shape[1] if rows is not None else 0, scale=dk ** -0.5)
    launch(_gdn_steps_kernel, (b * hv, triton.cdiv(dv, options["BV"])), args, options)
    return out


def meta(dk: int, dv: int, keep_rows: bool) -> dict:
    """Constexprs and launch options: a [BK, BV] slice of one head's state per program."""
    return {"KEEP_ROWS": keep_rows, "BK": triton.next_power_of_2(dk),
            "BV": min(triton.next_power_of_2(dv), BV_MAX), "num_warps": NUM_WARPS,
            "num_stages": 3}


def _spec(model: str, dk: int, dv: int, act: str, keep_rows: bool) -> Spec:
    types = {"q": act, "k": act, "v": act, "g": "*fp32", "beta": act, "state": "*fp32",
             "k_rows": "*fp32", "delta_rows": "*fp32", "g_rows": "*fp32", "out": act,
             **dict.fromkeys(("steps", "hk", "hv", "dk", "dv", "slots"), "i32"),
             "scale": "fp32"}
    label = f"{model} {act[1:]}, {'verify (rows kept)' if keep_rows else 'prefill'}"
    return Spec.from_meta(_gdn_steps_kernel, label, types, meta(dk, dv, keep_rows),
                          per_cycle=keep_rows, shape_constexprs=("BK", "BV"))


# Qwen3.6-27B linear attention: 128x128 key/value heads, bf16 activations on Thor; the demo's
# 32x48 heads in fp32. Verify blocks keep their rows; prefill chunks update the state.
SPECS = tuple(_spec(*shape, store) for shape in (("27B", 128, 128, "*bf16"),
                                                 ("demo", 32, 48, "*fp32"))
              for store in (True, False))
