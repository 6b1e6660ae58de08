"""Plain-torch commit of a speculative verify's accepted rows into the GDN and conv state.

Shapes: state [L, B, Hv, Dk, Dv] float32, the state before the verify; k_rows [L, B, S, Hk,
Dk], delta_rows [L, B, S, Hv, Dv] and g_rows [L, B, S, Hv] float32, what the verify kept per
row (gdn_steps with `rows`: the normalised k, the delta, the log decay); conv_state [L, B,
K-1, C]; conv_rows [L, B, K-1+S, C] = the conv window before the block followed by the
block's S pre-conv rows; count [B] = rows kept per sequence (0..S).

The state after n rows is S = S * exp(g_t) + k_t (x) delta_t for t < n: the verify's own
recurrence with its deltas, so no v, beta or q is read again. One state is written per
sequence whatever n is, and the reads are the state and the kept rows.
"""

from __future__ import annotations

import torch


def check_commit(state: torch.Tensor, k_rows: torch.Tensor, delta_rows: torch.Tensor,
                 g_rows: torch.Tensor, conv_state: torch.Tensor, conv_rows: torch.Tensor,
                 count: torch.Tensor) -> None:
    layers, seqs, hv, dk, dv = state.shape
    slots = delta_rows.shape[2]
    want = {"k_rows": (layers, seqs, slots, None, dk), "delta_rows": (layers, seqs, slots, hv, dv),
            "g_rows": (layers, seqs, slots, hv)}
    for name, t in (("k_rows", k_rows), ("delta_rows", delta_rows), ("g_rows", g_rows)):
        shape = want[name]
        if t.dim() != len(shape) or any(w is not None and w != s for w, s in zip(shape, t.shape)):
            raise ValueError(f"gdn_commit: {name} has shape {tuple(t.shape)}, expected "
                             f"{tuple('Hk' if w is None else w for w in shape)}")
    if k_rows.shape[3] and hv % k_rows.shape[3]:
        raise ValueError(f"gdn_commit: {hv} value heads do not share {k_rows.shape[3]} key heads")
    if conv_rows.shape[2] != conv_state.shape[2] + slots:
        raise ValueError("gdn_commit: conv_rows must hold K-1 + S rows")
    if count.shape != (seqs,):
        raise ValueError(f"gdn_commit: count must be [{seqs}], got {tuple(count.shape)}")


def host_counts(count: torch.Tensor, slots: int) -> list[int]:
    """The counts as ints (a host read), each checked to lie in 0..slots."""
    counts = count.tolist()
    if any(not 0 <= n <= slots for n in counts):
        raise ValueError(f"gdn_commit: counts {counts} outside 0..{slots}")
    return counts


def gdn_commit(
    state: torch.Tensor,
    k_rows: torch.Tensor,
    delta_rows: torch.Tensor,
    g_rows: torch.Tensor,
    conv_state: torch.Tensor,
    conv_rows: torch.Tensor,
    count: torch.Tensor,
) -> None:
    """Advance every layer's state by the first count[b] kept rows and set its conv window
    to the K-1 rows ending at the last kept one, in place."""
    check_commit(state, k_rows, delta_rows, g_rows, conv_state, conv_rows, count)
    if state.numel() == 0:
        return
    hv = state.shape[2]
    k1 = conv_state.shape[2]
    counts = host_counts(count, delta_rows.shape[2])
    kv = k_rows.repeat_interleave(hv // k_rows.shape[3], dim=3)        # [L, B, S, Hv, Dk]
    for b, n in enumerate(counts):
        s = state[:, b]
        for t in range(n):
            s = s * g_rows[:, b, t].exp()[..., None, None]
            s = s + kv[:, b, t, :, :, None] * delta_rows[:, b, t, :, None, :]
        state[:, b].copy_(s)
        conv_state[:, b].copy_(conv_rows[:, b, n:n + k1])
