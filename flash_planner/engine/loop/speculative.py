"""The speculative transaction: propose -> verify -> accept -> commit (or roll back).

One cycle starts from the anchor (the last published token, not yet run through the target)
at position `start`:

1. propose: the proposer drafts k tokens (k = 0 is plain greedy decoding, same path); under
   a grammar constraint the drafts come to the host, the block ends at the first draft the
   grammar forbids and the tokens it forces next are appended (`constraint.py`);
2. verify: one target forward over [anchor, d_1..d_k] that keeps each row's GDN inputs
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

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..models.qwen.moe import RoutingRecord
from ..models.qwen.target import TargetModel
from ..state.cache import InferenceState
from ..telemetry import PhaseTimer, SharedPhase
from .acceptance import StrictAcceptance
from .constraint import Constraint, masked
from .proposer import DraftAsk, Proposer, drafts_of


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


@dataclass
class Block:
    """A cycle's rows to verify: the anchor, then the drafts (grammar-cut and forced tokens
    appended under a constraint)."""
    start: int                     # position of the anchor
    anchor: int
    rows: torch.Tensor             # [k+1] long: the anchor then d_1..d_k
    drafts: torch.Tensor           # [k]
    listed: list[int] | None       # the drafts on the host (under a constraint)
    proposed: int                  # drafts the proposer made (before the grammar)

    @property
    def k(self) -> int:
        return int(self.drafts.shape[0])


def draft_block(device: torch.device, start: int, anchor: int, proposer: Proposer | None,
                num_drafts: int, timer: PhaseTimer, constraint: Constraint | None = None,
                room: int = 0) -> Block:
    """Step 1. Under a constraint the block holds at most `room` drafts, forced tokens
    included."""
    with timer.phase("draft"):
        asked = ask_drafts(device, anchor, start, proposer, num_drafts)
        drafts = drafts_of(asked)
    return block_of(start, anchor, drafts, timer, constraint, room)


def ask_drafts(device: torch.device, anchor: int, start: int, proposer: Proposer | None,
               num_drafts: int) -> torch.Tensor | DraftAsk:
    """Step 1's proposal: drafts, or what to draft together with other requests
    (`proposer.draft_together`)."""
    if proposer is None or num_drafts <= 0:
        return _no_drafts(device)
    anchor_t = torch.tensor([anchor], dtype=torch.long, device=device)
    return proposer.ask(anchor_t, start, num_drafts)


def block_of(start: int, anchor: int, drafts: torch.Tensor, timer: PhaseTimer,
             constraint: Constraint | None = None, room: int = 0) -> Block:
    """Step 1's block from the proposer's drafts: cut by the grammar and the tokens it
    forces appended, under a constraint."""
    device = drafts.device
    proposed = int(drafts.shape[0])
    listed = None
    if constraint is not None:
        with timer.phase("grammar"):
            listed = constraint.block(drafts.tolist(), max(room, proposed))
            drafts = torch.tensor(listed, dtype=torch.long, device=device)
    anchor_t = torch.tensor([anchor], dtype=torch.long, device=device)
    rows = torch.cat((anchor_t, drafts)) if drafts.shape[0] else anchor_t
    return Block(start, anchor, rows, drafts, listed, proposed)


def decide(block: Block, raw: torch.Tensor, finite: torch.Tensor | None,
           taps: torch.Tensor | None, proposer: Proposer | None, policy, timer: PhaseTimer,
           constraint: Constraint | None = None, experts: torch.Tensor | None = None
           ) -> Cycle:
    """Step 3 over the verify's logits raw [k+1, V] (finite [k+1]: each row's logits are
    finite, or None to compute here), taps [1, k+1, n_taps*hidden] (or None) and, on an MoE
    target, the distinct experts the verify touched (a device scalar)."""
    k, start = block.k, block.start
    drafts = block.drafts
    bitmask = None
    if constraint is not None:
        with timer.phase("grammar"):   # host work while an asynchronous forward runs
            bitmask = constraint.masks(block.listed)
    with timer.phase("accept"):
        # finiteness of the raw logits (masking puts -inf where the grammar forbids): the
        # compiled forward's, or else whether a row's sum is finite (it is NaN or Inf iff a
        # logit is, or the row reaches ~1e34: broken all the same)
        if finite is None:
            finite = raw.sum(dim=-1).isfinite()
        logits = masked(raw, bitmask)
        n, picks = policy.decide(drafts, logits, start + 1)
        # The one host sync of the cycle: the count, all candidate tokens, whether each
        # row's logits are finite and (MoE) the experts the block touched, in one copy.
        # (without drafts nothing is accepted: n is 0, known here, not copied). A CPU decode
        # step reads its two scalars directly, cheaper than a concatenation; on a GPU each
        # read would be a sync of its own, so they come back together there too.
        if k or experts is not None or picks.is_cuda:
            parts = [n.view(1), drafts, picks, finite.long()] if k else [picks, finite.long()]
            if experts is not None:
                parts.append(experts.view(1).to(picks.device, torch.long))
            host = torch.cat(parts).tolist()
        else:
            host = [picks.item(), int(finite.item())]
    if not k:
        host.insert(0, 0)
    return _cycle_of(block, host, taps, proposer, experts is not None)


def _cycle_of(block: Block, host: list[int], taps: torch.Tensor | None,
              proposer: Proposer | None, has_experts: bool) -> Cycle:
    """The cycle from step 3's host copy: [n, d_1..d_k, k+1 picks, k+1 finite flags] and,
    on an MoE target, the distinct experts last."""
    k, start = block.k, block.start
    n, d, a, ok = host[0], host[1:1 + k], host[1 + k:2 + 2 * k], host[2 + 2 * k:3 + 3 * k]
    if not all(ok[:n + 1]):  # a row that decides a published token
        raise NonFiniteLogits(start + ok.index(0))
    method = proposer.last_method if block.proposed else "none"
    return Cycle(start, block.anchor, d[:n] + [a[n]], n, k, taps, method,
                 host[-1] if has_experts else 0)


def decide_strict_together(blocks: Sequence[Block], raw: torch.Tensor,
                           finite: torch.Tensor | None, constraints: Sequence[Constraint | None],
                           timers: Sequence[PhaseTimer],
                           experts: Sequence[torch.Tensor] | None = None
                           ) -> list[list[int] | BaseException]:
    """Step 3 of `decide` for a batch's greedy strict requests at once: raw [m, T, V] is
    their verify's logits (request i's block in row i, padded to T), finite [m, T] or None,
    experts (MoE) each one's distinct experts. Each request's grammar masks its own rows;
    the masking, argmax, accepted counts and finiteness run once for all of them (`decide`
    runs a dozen small ops per request), in one host copy -> per request its row for
    `cycle_from_row`, or the error its grammar raised (that request alone fails); the
    counts are `StrictAcceptance`'s (`accept_together`)."""
    m, t = raw.shape[0], raw.shape[1]
    failed: dict[int, BaseException] = {}
    bitmask = None
    for i, (block, constraint, timer) in enumerate(zip(blocks, constraints, timers)):
        if constraint is None:
            continue
        try:
            with timer.phase("grammar"):
                rows = constraint.masks(block.listed)
        except Exception as exc:
            failed[i] = exc
            continue
        if bitmask is None:
            bitmask = rows.new_full((m, t, rows.shape[-1]), -1)
        bitmask[i, :rows.shape[0]] = rows
    with SharedPhase(list(timers), "accept"):
        if finite is None:
            finite = raw.sum(dim=-1).isfinite()
        logits = raw if bitmask is None else masked(
            raw.flatten(0, 1), bitmask.flatten(0, 1)).view(m, t, -1)
        picks = logits.argmax(dim=-1)                                      # [m, T]
        drafts = picks.new_zeros(m, t - 1)
        for i, block in enumerate(blocks):
            drafts[i, :block.k] = block.drafts
        n = picks.new_zeros(m) if t == 1 else StrictAcceptance.accept_together(
            drafts, logits, torch.tensor([b.k for b in blocks], device=picks.device))
        parts = [n[:, None], drafts, picks, finite.long()]
        if experts is not None:
            parts.append(torch.stack(list(experts)).view(m, 1).to(picks.device, torch.long))
        host = torch.cat(parts, dim=1).tolist()
    return [failed.get(i, row) for i, row in enumerate(host)]


def cycle_from_row(block: Block, row: list[int], taps: torch.Tensor | None,
                   proposer: Proposer | None, has_experts: bool = False) -> Cycle:
    """A request's cycle from its row of `decide_strict_together` ([n, T-1 drafts, T picks,
    T finite flags, the experts where counted], padded past its block)."""
    k, t = block.k, (len(row) - has_experts + 1) // 3
    host = [row[0], *row[1:1 + k], *row[t:t + k + 1], *row[2 * t:2 * t + k + 1]]
    return _cycle_of(block, host + row[-1:] if has_experts else host, taps, proposer,
                     has_experts)


def run_cycle(model: TargetModel, state: InferenceState, anchor: int,
              proposer: Proposer | None, policy, num_drafts: int, timer: PhaseTimer,
              constraint: Constraint | None = None, room: int = 0) -> Cycle:
    """Steps 1-3 on one sequence; the state is left with k+1 pending rows for
    `commit_cycle`."""
    block = draft_block(state.device, state.length, anchor, proposer, num_drafts, timer,
                        constraint, room)
    tap_ids = proposer.tap_ids if proposer is not None else ()
    routing = RoutingRecord() if model.moe_blocks else None
    with timer.phase("verify"):
        out = model(block.rows[None], state, record_steps=block.k > 0, taps=tap_ids,
                    all_logits=True, routing=routing)
    experts = None
    if routing is not None:
        experts = routing.distinct_per_layer(model.moe_blocks[0].num_experts).sum()
    taps = torch.cat(out.taps, dim=-1) if tap_ids else None
    return decide(block, out.logits[0], None if out.finite is None else out.finite[0], taps,
                  proposer, policy, timer, constraint, experts)


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
