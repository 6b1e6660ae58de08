"""Gated delta rule in chunked (parallel) form: the CPU path, same signature as reference.py.

The recurrence of reference.py, unrolled over a chunk of C tokens from the chunk's initial
state S0 (per value head; gamma_t = exp(g_1 + ... + g_t), all ratios gamma_t / gamma_i taken
as exp of a difference of cumulative sums, so no 1 / gamma_i can overflow):

    delta_t + beta_t sum_{i<t} (gamma_t/gamma_i) (k_t . k_i) delta_i
        = beta_t (v_t - gamma_t S0^T k_t)                      (one unit-triangular solve)
    S_t = gamma_t S0 + sum_{i<=t} (gamma_t/gamma_i) k_i delta_i^T
    o_t = S_t^T q_t = gamma_t S0^T q_t + sum_{i<=t} (gamma_t/gamma_i) (q_t . k_i) delta_i

A speculative verify block (T <= 16) is one chunk: about a dozen batched tensor ops instead
of T python iterations of five ops each, which is what a 16-row verify costs on a CPU. Long
prefills run chunk after chunk, carrying the state. On CUDA the Triton kernel serves. A
verify's `rows` receive the solved deltas, the normalised k and g: what gdn_commit needs to
build the state after any accepted prefix (no per-step states are formed).
"""

from __future__ import annotations

import torch

from .reference import Rows, check_state, expand_qk, keep_rows

CHUNK = 64
LOG_FLOOR = -60.0


def gdn_steps(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    rows: Rows | None = None,
) -> torch.Tensor:
    """As reference.gdn_steps: T steps from `state` (updated in place; with `rows`, read
    only, and the block's deltas, k and g kept); returns o [B, T, Hv, Dv] in v's dtype."""
    b, t = k.shape[:2]
    hv, dv = v.shape[-2:]
    check_state(k, v, state, rows)
    if rows is not None and t > CHUNK:
        raise ValueError(f"a verify block keeps at most {CHUNK} rows, got {t}")
    qn, kn = expand_qk(q, k, hv)
    qf, kf = qn.transpose(1, 2), kn.transpose(1, 2)                   # head-major [B, Hv, T, D]
    vf = v.float().transpose(1, 2)
    gf = g.float().transpose(1, 2)                                     # [B, Hv, T]
    bf = beta.float().transpose(1, 2)
    out = torch.empty(b, hv, t, dv, dtype=torch.float32, device=v.device)
    s = state
    for c0 in range(0, t, CHUNK):
        c1 = min(t, c0 + CHUNK)
        s = _chunk(qf[:, :, c0:c1], kf[:, :, c0:c1], vf[:, :, c0:c1], gf[:, :, c0:c1],
                   bf[:, :, c0:c1], s, out[:, :, c0:c1],
                   None if rows is None else rows[1][:, :t])
    if rows is None:
        state.copy_(s)
    else:
        keep_rows(rows, kn, g.float(), k.shape[2])
    return out.transpose(1, 2).to(v.dtype)


def _chunk(q, k, v, g, beta, s0, out, delta_rows):
    """One chunk; q, k [B, Hv, C, Dk], v and out [B, Hv, C, Dv], g, beta [B, Hv, C];
    writes `out`; returns the state after the chunk, or with `delta_rows` [B, C, Hv, Dv]
    the deltas there and None (the state is built later, for the accepted rows only)."""
    c = k.shape[2]
    cum = g.cumsum(dim=-1)                                             # log gamma_t
    lower = torch.ones(c, c, dtype=torch.bool, device=k.device).tril()
    # decay[t, i] = gamma_t / gamma_i for i <= t, else 0 (masked before exp: no overflow).
    # Log decays are floored at LOG_FLOOR: a factor below e^-60 is zero to within 1e-26, and
    # letting it reach float32's subnormal range slows every op that touches it several-fold.
    diff = (cum[..., :, None] - cum[..., None, :]).clamp_min(LOG_FLOOR)
    diff = diff.masked_fill(~lower, float("-inf"))
    decay = diff.exp()                                                 # [B, Hv, C, C]
    gamma = cum.clamp_min(LOG_FLOOR).exp()[..., None]                  # [B, Hv, C, 1]
    strict = (decay * (k @ k.transpose(-1, -2))).tril(-1) * beta[..., None]
    rhs = beta[..., None] * (v - gamma * (k @ s0))
    # (I + strict) delta = rhs; unitriangular: the solve takes the unit diagonal as given
    delta = torch.linalg.solve_triangular(strict, rhs, upper=False,
                                          unitriangular=True)          # [B, Hv, C, Dv]
    out.copy_(gamma * (q @ s0) + (decay * (q @ k.transpose(-1, -2))) @ delta)
    if delta_rows is not None:
        delta_rows.copy_(delta.transpose(1, 2))
        return None
    last = decay[..., -1, :, None]                                     # [B, Hv, C, 1]
    return gamma[..., -1, :, None] * s0 + (k * last).transpose(-1, -2) @ delta
