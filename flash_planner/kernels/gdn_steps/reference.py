"""Plain-torch gated delta rule, recurrent form, one token at a time.

Shapes (one convention everywhere): q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv];
state [B, Hv, Dk, Dv] float32. Per token t and value head h (key head h // (Hv // Hk)):

    S = S * exp(g_t);  delta = beta_t * (v_t - S^T k_t);  S = S + k_t (x) delta;  o_t = S^T q_t

with q and k L2-normalised (eps 1e-6) and q scaled by Dk^-0.5, all in float32.

A speculative verify passes `rows` = (k_rows [B, S, Hk, Dk], delta_rows [B, S, Hv, Dv],
g_rows [B, S, Hv]), float32, S >= T: each step's normalised k, its delta and its g go there
and the state is left as it was; once the accepted count n is known, gdn_commit replays
S = S * exp(g_t) + k_t (x) delta_t for t < n from them (one state written per verify, not T).
"""

from __future__ import annotations

import torch


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


Rows = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def check_state(k: torch.Tensor, v: torch.Tensor, state: torch.Tensor,
                rows: Rows | None = None) -> None:
    """The state every form of this op reads (and, without `rows`, updates in place):
    float32 [B, Hv, Dk, Dv]; `rows`, if given, float32 buffers holding the block's T steps."""
    b, t, hk, dk = k.shape
    hv, dv = v.shape[-2:]
    if state.shape != (b, hv, dk, dv) or state.dtype != torch.float32:
        raise ValueError(f"state must be float32 [{b}, {hv}, {dk}, {dv}], "
                         f"got {state.dtype} {tuple(state.shape)}")
    if rows is None:
        return
    if len(rows) != 3:
        raise ValueError("rows must be (k_rows, delta_rows, g_rows)")
    for name, buf, tail in zip(("k_rows", "delta_rows", "g_rows"), rows,
                               ((hk, dk), (hv, dv), (hv,))):
        if (buf.dtype != torch.float32 or buf.shape[0] != b or tuple(buf.shape[2:]) != tail
                or buf.shape[1] < t):
            raise ValueError(f"{name} must be float32 [{b}, >={t}, {', '.join(map(str, tail))}]"
                             f", got {buf.dtype} {tuple(buf.shape)}")


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
    rows: Rows | None = None,
) -> torch.Tensor:
    """Run T steps of the gated delta rule from `state`: updated in place, or with `rows`
    left as it was while each step's k, delta and g are kept for gdn_commit.
    Returns o [B, T, Hv, Dv] in v's dtype.
    """
    b, t = k.shape[:2]
    hv, dv = v.shape[-2:]
    check_state(k, v, state, rows)
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
        if rows is not None:
            rows[1][:, i] = delta
    if rows is None:
        state.copy_(s)
    else:
        keep_rows(rows, kf, gf, k.shape[2])
    return out.to(v.dtype)


def keep_rows(rows: Rows, kf: torch.Tensor, gf: torch.Tensor, hk: int) -> None:
    """The block's normalised k (one row per key head, from kf [B, T, Hv, Dk]) and g
    [B, T, Hv] into their row buffers."""
    t = kf.shape[1]
    rows[0][:, :t] = kf[:, :, ::kf.shape[2] // hk]
    rows[2][:, :t] = gf
