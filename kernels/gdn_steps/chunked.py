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
prefills run chunk after chunk, carrying the state. On CUDA the Triton kernel serves.
"""

from __future__ import annotations

import torch

from .reference import check_state, expand_qk

CHUNK = 64
LOG_FLOOR = -60.0


def gdn_steps(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    step_states: torch.Tensor | None = None,
) -> torch.Tensor:
    """As reference.gdn_steps: T steps from `state` (updated in place), per-step states into
    `step_states` [B, >=T, Hv, Dk, Dv] if given; returns o [B, T, Hv, Dv] in v's dtype."""
    b, t = k.shape[:2]
    hv, dv = v.shape[-2:]
    check_state(k, v, state, step_states)
    qf, kf = (x.transpose(1, 2) for x in expand_qk(q, k, hv))         # head-major [B, Hv, T, D]
    vf = v.float().transpose(1, 2)
    gf = g.float().transpose(1, 2)                                     # [B, Hv, T]
    bf = beta.float().transpose(1, 2)
    out = torch.empty(b, hv, t, dv, dtype=torch.float32, device=v.device)
    s = state
    for c0 in range(0, t, CHUNK):
        c1 = min(t, c0 + CHUNK)
        s = _chunk(qf[:, :, c0:c1], kf[:, :, c0:c1], vf[:, :, c0:c1], gf[:, :, c0:c1],
                   bf[:, :, c0:c1], s, out[:, :, c0:c1],
                   None if step_states is None else step_states[:, c0:c1])
    state.copy_(s)
    return out.transpose(1, 2).to(v.dtype)


def _chunk(q, k, v, g, beta, s0, out, step_states):
    """One chunk; q, k [B, Hv, C, Dk], v and out [B, Hv, C, Dv], g, beta [B, Hv, C];
    writes `out` (and `step_states` [B, C, Hv, Dk, Dv]), returns the state after the chunk."""
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
    if step_states is None:
        last = decay[..., -1, :, None]                                 # [B, Hv, C, 1]
        return gamma[..., -1, :, None] * s0 + (k * last).transpose(-1, -2) @ delta
    # S_t for every t, written straight into the checkpoint rows [B, C, Hv, Dk, Dv] (no
    # [C, Dk*Dv]-sized temporaries: on a CPU, moving those costs more than the arithmetic)
    weighted = (decay[..., None] * k[:, :, None]).permute(0, 2, 1, 4, 3)  # [B, C, Hv, Dk, C]
    if step_states.is_contiguous():
        torch.matmul(weighted, delta[:, None], out=step_states)
    else:   # a batch's rows of fewer steps than it holds (`out=` must be contiguous)
        step_states.copy_(weighted @ delta[:, None])
    step_states.addcmul_(gamma.transpose(1, 2)[..., None], s0[:, None])
    return step_states[:, -1]
