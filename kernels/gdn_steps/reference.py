"""Plain-torch gated delta rule, recurrent form, one token at a time.

Shapes (one convention everywhere): q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv];
state [B, Hv, Dk, Dv] float32. Per token t and value head h (key head h // (Hv // Hk)):

    S = S * exp(g_t);  delta = beta_t * (v_t - S^T k_t);  S = S + k_t (x) delta;  o_t = S^T q_t

with q and k L2-normalised (eps 1e-6) and q scaled by Dk^-0.5, all in float32.
"""

from __future__ import annotations

import torch


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def check_state(k: torch.Tensor, v: torch.Tensor, state: torch.Tensor,
                step_states: torch.Tensor | None = None) -> None:
    """The state every form of this op updates in place: float32 [B, Hv, Dk, Dv]; and the
    checkpoint buffer, if given, must hold the block's T steps."""
    b, t, _, dk = k.shape
    hv, dv = v.shape[-2:]
    if state.shape != (b, hv, dk, dv) or state.dtype != torch.float32:
        raise ValueError(f"state must be float32 [{b}, {hv}, {dk}, {dv}], "
                         f"got {state.dtype} {tuple(state.shape)}")
    if step_states is not None and step_states.shape[1] < t:
        raise ValueError(f"step_states holds {step_states.shape[1]} steps, block has {t}")


def expand_qk(q: torch.Tensor, k: torch.Tensor, hv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 q, k L2-normalised (q also scaled by Dk^-0.5), one row per value head:
    [B, T, Hv, Dk] each."""
    rep, dk = hv // k.shape[2], k.shape[-1]
    qf = _l2norm(q.float()).repeat_interleave(rep, dim=2) * dk ** -0.5
    return qf, _l2norm(k.float()).repeat_interleave(rep, dim=2)


def gdn_steps(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    step_states: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run T steps of the gated delta rule from `state`, updating `state` in place.

    step_states: optional [B, >=T, Hv, Dk, Dv] float32 buffer; row t receives the state after
    step t (the per-step checkpoints a speculative rollback selects from).
    Returns o [B, T, Hv, Dv] in v's dtype.
    """
    b, t = k.shape[:2]
    hv, dv = v.shape[-2:]
    check_state(k, v, state, step_states)
    qf, kf = expand_qk(q, k, hv)                                        # [B, T, Hv, Dk]
    vf, gf, bf = v.float(), g.float(), beta.float()
    out = torch.empty(b, t, hv, dv, dtype=torch.float32, device=v.device)
    s = state
    for i in range(t):
        s = s * gf[:, i].exp()[..., None, None]
        kv_mem = (s * kf[:, i, :, :, None]).sum(dim=-2)                    # [B, Hv, Dv]
        delta = (vf[:, i] - kv_mem) * bf[:, i, :, None]
        s = s + kf[:, i, :, :, None] * delta[:, :, None, :]
        out[:, i] = (s * qf[:, i, :, :, None]).sum(dim=-2)
        if step_states is not None:
            step_states[:, i] = s
    state.copy_(s)
    return out.to(v.dtype)
