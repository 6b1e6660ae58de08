"""Plain-torch acceptance per draft row.

drafts [B, k] (long), logits [B, k+1, V] (row i judges draft i), relaxed [B, k] (bool: the
relaxed rule applies to this draft). Draft i is accepted (ok) when it is the row's argmax
(the first index of the maximum, as torch.argmax), or, where relaxed, when fewer than
`topk` logits of its row are strictly greater than its own and it is within `delta` logits
of the maximum. The accepted length is the leading run of ok (see `accepted_prefix`).
"""

from __future__ import annotations

import torch


def accept_rows(
    drafts: torch.Tensor,
    logits: torch.Tensor,
    relaxed: torch.Tensor,
    topk: int,
    delta: float,
) -> torch.Tensor:
    """ok [B, k] bool."""
    rows = logits[:, :-1].float()                                      # [B, k, V]
    strict = drafts == rows.argmax(dim=-1)
    own = rows.gather(-1, drafts[..., None])[..., 0]                   # [B, k]
    rank = (rows > own[..., None]).sum(dim=-1)
    margin = rows.max(dim=-1).values - own
    return strict | (relaxed & (rank < topk) & (margin <= delta))


def accepted_prefix(ok: torch.Tensor) -> torch.Tensor:
    """Length of the leading run of True along the last dim (long, on ok's device)."""
    return torch.cumprod(ok.long(), dim=-1).sum(dim=-1)
