"""The speculative transaction: propose -> verify -> accept -> commit (or roll back).

One cycle starts from the anchor (the last published token, not yet run through the target)
at position `start`:

1. propose: the proposer drafts k tokens (k = 0 is plain greedy decoding, same path); under
   a grammar constraint the drafts come to the host, the block ends at the first draft the
   grammar forbids and the tokens it forces next are appended (`constraint.py`);
2. verify: one target forward over [anchor, d_1..d_k] that records per-step GDN checkpoints
   and the proposer's taps; a constraint's masks are built while it runs and applied to its
   logits;
3. accept: the policy decides the accepted count n and the token after it (the row's
   argmax, or a sample: `sampling.py`) on the device; one host copy brings back n, the
   drafts and those tokens together;
4. commit (after the caller's stop rules chose how many new tokens to publish, `keep`):
   keep rows (the anchor and d_1..d_{keep-1}) are committed to the target state, which rolls
   the GDN/conv state back to that step in O(1) and rewinds the KV length; the same rows go
   to the proposer's window in commit order; the proposer and the policy see the published
   tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache import InferenceState
from .constraint import Constraint, masked
from .models.moe import RoutingRecord
from .models.target import TargetModel
from .proposer import Proposer
from .telemetry import PhaseTimer


class NonFiniteLogits(RuntimeError):
    """The target's logits that decide a token are NaN or Inf: broken weights or overflow."""

    def __init__(self, position: int):
        super().__init__(f"the model produced non-finite logits (NaN or Inf) at position "
                         f"{position}; the request is aborted, no output is trusted")
        self.position = position


@dataclass
class Cycle:
    start: int                    # position of the anchor
    anchor: int
    tokens: list[int]             # d_1..d_n then the bonus token: n+1 candidates to publish
    accepted: int                 # n
    drafted: int                  # k
    taps: torch.Tensor | None     # [1, k+1, n_taps*hidden] verify taps, row 0 = anchor
    method: str = "none"          # the proposer that drafted (none: it drafted nothing)
    experts: int = 0              # MoE targets: distinct experts the verify touched, summed
                                  # over the sparse layers (0 for a dense target)


_EMPTY: dict[torch.device, torch.Tensor] = {}


def _no_drafts(device: torch.device) -> torch.Tensor:
    """An empty draft block on `device` (one per device: a cycle without drafts makes none)."""
    empty = _EMPTY.get(device)
    if empty is None:
        empty = _EMPTY[device] = torch.zeros(0, dtype=torch.long, device=device)
    return empty


def run_cycle(model: TargetModel, state: InferenceState, anchor: int,
              proposer: Proposer | None, policy, num_drafts: int, timer: PhaseTimer,
              constraint: Constraint | None = None, room: int = 0) -> Cycle:
    """Steps 1-3; the state is left with k+1 pending rows for `commit_cycle`. Under a
    constraint the block holds at most `room` drafts, forced tokens included."""
    device = state.device
    anchor_t = torch.tensor([anchor], dtype=torch.long, device=device)
    start = state.length
    with timer.phase("draft"):
        if proposer is not None and num_drafts > 0:
            drafts = proposer.propose(anchor_t, start, num_drafts)
        else:
            drafts = _no_drafts(device)
    proposed = int(drafts.shape[0])
    if constraint is not None:
        with timer.phase("grammar"):
            block = constraint.block(drafts.tolist(), max(room, proposed))
            drafts = torch.tensor(block, dtype=torch.long, device=device)
    k = int(drafts.shape[0])
    tap_ids = proposer.tap_ids if proposer is not None else ()
    routing = RoutingRecord() if model.moe_blocks else None
    rows = torch.cat((anchor_t, drafts)) if k else anchor_t
    with timer.phase("verify"):
        out = model(rows[None], state, record_steps=k > 0, taps=tap_ids, all_logits=True,
                    routing=routing)
    bitmask = None
    if constraint is not None:
        with timer.phase("grammar"):   # host work while an asynchronous forward runs
            bitmask = constraint.masks(block)
    with timer.phase("accept"):
        raw = out.logits[0]                                             # [k+1, V]
        # finiteness of the raw logits (masking puts -inf where the grammar forbids): the
        # compiled forward's, or else whether a row's sum is finite (it is NaN or Inf iff a
        # logit is, or the row reaches ~1e34: broken all the same)
        finite = out.finite[0] if out.finite is not None else raw.sum(dim=-1).isfinite()
        logits = masked(raw, bitmask)
        n, picks = policy.decide(drafts, logits, start + 1)
        # The one host sync of the cycle: the count, all candidate tokens, whether each
        # row's logits are finite and (MoE) the experts the block touched, in one copy.
        # (without drafts nothing is accepted: n is 0, known here, not copied). A CPU decode
        # step reads its two scalars directly, cheaper than a concatenation; on a GPU each
        # read would be a sync of its own, so they come back together there too.
        if k or routing is not None or picks.is_cuda:
            parts = [n.view(1), drafts, picks, finite.long()] if k else [picks, finite.long()]
            if routing is not None:
                experts = routing.distinct_per_layer(model.moe_blocks[0].num_experts).sum()
                parts.append(experts.view(1).to(picks.device, torch.long))
            host = torch.cat(parts).tolist()
        else:
            host = [picks.item(), int(finite.item())]
    if not k:
        host.insert(0, 0)
    n, d, a, ok = host[0], host[1:1 + k], host[1 + k:2 + 2 * k], host[2 + 2 * k:3 + 3 * k]
    if not all(ok[:n + 1]):  # a row that decides a published token
        raise NonFiniteLogits(start + ok.index(0))
    taps = torch.cat(out.taps, dim=-1) if tap_ids else None
    method = proposer.last_method if proposed else "none"
    experts = host[-1] if routing is not None else 0
    return Cycle(start, anchor, d[:n] + [a[n]], n, k, taps, method, experts)


def commit_cycle(state: InferenceState, cycle: Cycle, keep: int, proposer: Proposer | None,
                 policy, timer: PhaseTimer, constraint: Constraint | None = None) -> None:
    """Step 4: commit `keep` rows (1 <= keep <= n+1) everywhere, in commit order."""
    with timer.phase("commit"):
        state.commit(keep)
        rows = [cycle.anchor] + cycle.tokens[:keep - 1]
        if proposer is not None:
            proposer.commit(rows, None if cycle.taps is None else cycle.taps[:, :keep],
                            cycle.start)
            proposer.published(cycle.tokens[:keep])
        policy.observe(cycle.tokens[:keep])
    if constraint is not None:
        with timer.phase("grammar"):
            constraint.commit(cycle.tokens[:keep], min(keep, cycle.accepted))
