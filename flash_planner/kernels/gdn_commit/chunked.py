"""The commit in closed form: the CPU path, same signature as reference.py.

From the kept rows of a verify (gdn_steps' chunked form solved every delta), the state after
n rows is one batched product, as in gdn_steps/chunked.py (gamma_t = exp(g_0 + ... + g_t)):

    S_n = gamma_{n-1} S + sum_{i<n} (gamma_{n-1} / gamma_i) k_i delta_i^T

for every layer, sequence and head at once, instead of n python steps of two ops each per
sequence. Ratios are exps of differences of cumulative sums, floored as there.
"""

from __future__ import annotations

import torch

from ..gdn_steps.chunked import LOG_FLOOR
from .reference import check_commit, host_counts


def gdn_commit(
    state: torch.Tensor,
    k_rows: torch.Tensor,
    delta_rows: torch.Tensor,
    g_rows: torch.Tensor,
    conv_state: torch.Tensor,
    conv_rows: torch.Tensor,
    count: torch.Tensor,
) -> None:
    """As reference.gdn_commit."""
    check_commit(state, k_rows, delta_rows, g_rows, conv_state, conv_rows, count)
    counts = host_counts(count, delta_rows.shape[2])
    if state.numel() == 0:
        return
    k1 = conv_state.shape[2]
    span = max(counts)
    same = len(set(counts)) == 1            # one sequence, or a batch that kept alike
    if span:
        hv, hk = state.shape[2], k_rows.shape[3]
        cum = g_rows[:, :, :span].cumsum(dim=2)                       # [L, B, n, Hv]
        if same:
            last = cum[:, :, span - 1:]
            w = (last - cum).clamp_min(LOG_FLOOR).exp()
        else:
            n = torch.tensor(counts, device=state.device)
            at = (n - 1).clamp(min=0)[None, :, None, None].expand(cum.shape[0], -1, 1, hv)
            last = cum.gather(2, at) * (n > 0)[None, :, None, None]  # [L, B, 1, Hv]
            kept = torch.arange(span, device=state.device)[None, :] < n[:, None]   # [B, n]
            # rows past a sequence's count may decay more than the kept ones: masked before
            # the exp, where their ratio could overflow (and inf * 0 is NaN)
            w = (last - cum).clamp_min(LOG_FLOOR).masked_fill(~kept[None, :, :, None], -torch.inf)
            w = w.exp()
        k = k_rows[:, :, :span]
        if hv != hk:
            k = k.repeat_interleave(hv // hk, dim=3)
        weighted = (k * w[..., None]).permute(0, 1, 3, 4, 2)          # [L, B, Hv, Dk, n]
        added = weighted @ delta_rows[:, :, :span].transpose(2, 3)    # [L, B, Hv, Dk, Dv]
        gamma = last[:, :, 0].clamp_min(LOG_FLOOR).exp()[..., None, None]
        state.mul_(gamma).add_(added)
    if same:
        conv_state.copy_(conv_rows[:, :, span:span + k1])
    else:
        for b, n in enumerate(counts):
            conv_state[:, b].copy_(conv_rows[:, b, n:n + k1])
