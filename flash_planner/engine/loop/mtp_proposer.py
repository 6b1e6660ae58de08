"""The MTP proposer: the checkpoint's own `mtp.*` head drafts k tokens by chaining itself.

The head's KV cache (its own `InferenceState`, one attention layer, FP8 like the target's if
asked) only ever holds entries made from the target's normed hidden state h_q and the true
next token, for committed positions q. Committed rows wait in `pending` until the next
`propose`, which runs them through the head with the anchor as the last row's next token:
the rows of the last commit in one forward whose last row gives draft 1, after the older
rows (the prompt, or cycles another proposer drafted) in chunks as a catch-up. Drafts 2..k
chain the head on its own output and draft at the next positions; those entries are
forgotten (`truncate`) before the verify, so after any partial accept the cache holds
exactly the entries of committed positions: the ones upstream engines keep. No host sync:
drafts stay on the device.

A prefix snapshot (`prefix.py`) keeps the head's entries of the prefix's positions but its
last (whose next token is the suffix's first): a prompt starting with that prefix begins
with them restored and catches up only from there.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..models.drafters.mtp import MTPHead
from ..models.graphs.compiled_drafts import StaticHead
from ..models.qwen.inference import inference
from ..models.qwen.target import TargetModel
from ..state.cache import InferenceState, StateCopy
from ..state.slots import SlotStates
from .proposer import DraftAsk, Proposer


@dataclass(frozen=True)
class HeadPrefix:
    """The head cache after the entries of a prompt prefix's positions but its last."""
    ids: tuple[int, ...]           # the whole prefix
    state: StateCopy

    @property
    def nbytes(self) -> int:
        return self.state.nbytes


class MTPProposer(Proposer):
    name = "mtp"

    def __init__(self, head: MTPHead, target: TargetModel, state: InferenceState,
                 steps: int = 3, chunk: int = 256):
        if steps < 1:
            raise ValueError(f"mtp_steps must be >= 1, got {steps}")
        self.head = head
        self.embed = target.embed_tokens
        self.lm_head_weight = target.output_weight
        self.state = state
        self.chunk = chunk
        # the last layer, after the final norm (a Flash-Next target: its streams)
        self.tap_ids = getattr(target, "mtp_taps", (target.cfg.num_layers - 1,))
        self.block_size = steps + 1
        self.seed_rows = state.capacity               # every prompt row enters the cache
        # Normed h of committed rows not in the cache, one chunk per commit (the prompt's
        # last row a chunk of its own), and the token at each of those rows.
        self.pending_hidden: list[torch.Tensor] = []
        self.pending_tokens: list[int] = []
        self._prefix: HeadPrefix | None = None     # set by use_prefix_state for one begin
        # a fork of a batch: its cache is row `row` of `slots`, shared with the others
        self.slots: SlotStates | None = None
        self.row = 0

    def fork(self, slots: SlotStates | None = None, row: int = 0) -> MTPProposer:
        """The same head with a cache of its own (a compiled head is bound to the first):
        row `row` of `slots` (the caches of a batch's proposers, so that their drafts go
        through the head together: `propose_together`), or a state of its own."""
        s = self.state
        state = slots.view(row) if slots is not None else InferenceState(
            self.head.cfg, capacity=s.capacity, max_steps=s.max_steps, kv_dtype=s.kv.k.dtype,
            compute_dtype=s.kv.compute_dtype, device=s.device)
        clone = copy.copy(self)
        clone.state, clone.pending_hidden, clone.pending_tokens = state, [], []
        clone._prefix, clone.slots, clone.row = None, slots, row
        return clone

    def chain_parts(self) -> tuple[int, torch.nn.Embedding, torch.Tensor]:
        """What a compiled head needs to run a proposal's drafts after its first as one
        graph (`StaticHead.run_chain`): the drafts per proposal, embedding, lm_head."""
        return self.block_size - 1, self.embed, self.lm_head_weight

    def head_slots(self, rows: int) -> SlotStates:
        """Caches for `rows` forks that draft together (`fork(slots, row)`)."""
        s = self.state
        return SlotStates(self.head.cfg, rows, s.capacity, s.max_steps, s.kv.k.dtype,
                          s.kv.compute_dtype, s.device)

    def ask(self, anchor: torch.Tensor, start: int, num: int) -> torch.Tensor | DraftAsk:
        if self.slots is None:
            return self.propose(anchor, start, num)
        return DraftAsk(self, anchor, start, num)

    def together_key(self) -> object | None:
        return self.slots

    @staticmethod
    @inference
    def propose_together(asks: Sequence[DraftAsk]) -> list[torch.Tensor]:
        """The drafts of several forks sharing one `head_slots`, the head run over every
        row of them at once: first each request's rows of its last commit (padded to the
        longest), then each chain step one row each. The rows of a request that is not
        asking, or has all its drafts, are padding: written past its length and
        discarded. Catch-up rows (cycles another proposer drafted) go first, together for
        the requests whose caches are calibrated (`_catch_up_together`)."""
        slots: SlotStates = asks[0].proposer.slots
        heads = [a.proposer for a in asks]
        if not all(p._calibrates_first() for p in heads):
            return [p.propose(a.anchor, a.start, a.num) for p, a in zip(heads, asks)]
        lead = heads[0]
        device = asks[0].anchor.device
        rows = [p.row for p in heads]
        # rows 0..n-1: the highest asking row's and those below it (the batch hands out
        # the lowest rows first); compiled, up to its batch bucket, every row of it at its
        # own length (a graph's padding rows would write at positions 0.. of rows that may
        # be live), so that a lone request runs the head over one row, not every slot
        n = max(rows) + 1
        if _head_compiled_over(slots, lead.head):
            n = slots.static.batch_bucket(n)
        firsts = _catch_up_together(slots, n, heads, asks)
        width = max(t.shape[0] for t, _ in firsts)
        hidden_size = firsts[0][1].shape[-1]
        tokens = torch.zeros(n, width, dtype=torch.long, device=device)
        hidden = torch.zeros(n, width, hidden_size, dtype=firsts[0][1].dtype, device=device)
        for row, (tok, h) in zip(rows, firsts):
            tokens[row, :tok.shape[0]] = tok
            hidden[row, :tok.shape[0]] = h[0]
        state = slots.rows(n, rows)
        out = lead.head(lead.embed(tokens), hidden, state)
        last = torch.tensor([t.shape[0] - 1 for t, _ in firsts], device=device)
        _settle(slots, n, {row: t.shape[0] for row, (t, _) in zip(rows, firsts)})
        now = out[:, -1:].clone()                                   # [n, 1, H] every row
        now[rows] = out[rows, last][:, None]
        chained = None
        if _head_compiled_over(slots, lead.head):
            chained = _chained(slots.static, now, state, heads, asks)
        if chained is not None:
            return [chained[row, :a.num] for row, a in zip(rows, asks)]
        drafts = [[p._draft(now[row:row + 1], a.start + 1)]
                  for p, a, row in zip(heads, asks, rows)]
        for step in range(1, max(a.num for a in asks)):
            going = {row: 1 for row, a in zip(rows, asks) if a.num > step}
            nxt = torch.zeros(n, dtype=torch.long, device=device)
            for row, d in zip(rows, drafts):
                nxt[row] = d[-1][0]
            now = lead.head(lead.embed(nxt)[:, None], now, slots.rows(n, list(going)))
            _settle(slots, n, going)
            for i, (p, a, row) in enumerate(zip(heads, asks, rows)):
                if row in going:
                    drafts[i].append(p._draft(now[row:row + 1], a.start + 1 + step))
        for p, a in zip(heads, asks):
            p.state.truncate(a.start)     # entries from drafts: dropped before the verify
        return [torch.cat(d) for d in drafts]

    def _drafts_together_compiled(self) -> bool:
        """Whether a batch's lone asking fork drafts through the head over the slots of
        its row's batch bucket all the same: where that forward is compiled (a graph call
        per step, not an eager head forward of its row alone)."""
        return (self.slots is not None and _head_compiled_over(self.slots, self.head)
                and self._calibrates_first())

    def _calibrates_first(self) -> bool:
        """Whether this proposal's rows meet a calibrated cache: an FP8 one is calibrated
        by its first rows, which a batched forward of several requests' rows cannot do."""
        kv = self.state.kv
        return (not kv.is_fp8 or all(kv.calibrated)
                or sum(h.shape[1] for h in self.pending_hidden[:-1]) > 0)

    def _catch_up(self, anchor: torch.Tensor, start: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the committed rows before the last commit's through the head (a catch-up);
        the last commit's (tokens [T], hidden [1, T, H]), each row's next token with the
        anchor last, for the head's first forward of this proposal."""
        tokens, hidden, split = self._take_pending(anchor, start)
        t0 = time.perf_counter()
        self._commit_rows(tokens[:split], hidden[:, :split])
        self.catchup_ms = (time.perf_counter() - t0) * 1000.0
        return tokens[split:], hidden[:, split:]

    def _take_pending(self, anchor: torch.Tensor, start: int
                      ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The pending rows, taken: (each row's next token [T] with the anchor last, their
        hidden [1, T, H], how many of them are a catch-up: the rows before the last
        commit's)."""
        hidden = torch.cat(self.pending_hidden, dim=1)                 # [1, start-P, H]
        if hidden.shape[1] != start - self.state.length:
            raise RuntimeError(f"MTP head holds {self.state.length} positions and "
                               f"{hidden.shape[1]} pending rows, anchor at {start}")
        # Each pending row's next token: the following row's token, the anchor for the last.
        tokens = torch.cat((torch.tensor(self.pending_tokens[1:], dtype=torch.long,
                                         device=anchor.device), anchor))
        split = hidden.shape[1] - self.pending_hidden[-1].shape[1]
        self.pending_hidden, self.pending_tokens = [], []
        return tokens, hidden, split

    @inference
    def prefix_state(self, prefix_ids: Sequence[int], taps: dict[int, torch.Tensor]
                     ) -> dict[str, object]:
        if any(t not in taps for t in self.tap_ids):
            return {}
        hidden = torch.cat([taps[t] for t in self.tap_ids], dim=-1)   # in tap order
        n = len(prefix_ids) - 1
        if hidden.shape[1] != len(prefix_ids) or n < 1:
            return {}
        self.state.reset()
        tokens = torch.tensor(list(prefix_ids[1:]), dtype=torch.long, device=hidden.device)
        self._commit_rows(tokens, hidden[:, :n])
        head = HeadPrefix(tuple(prefix_ids), self.state.save())
        self.state.reset()
        return {self.name: head}

    def use_prefix_state(self, states: dict[str, object]) -> None:
        self._prefix = states.get(self.name)

    def begin(self, prompt_ids: Sequence[int], taps: torch.Tensor | None) -> None:
        self.state.reset()
        if taps is None or taps.shape[1] != len(prompt_ids):
            raise ValueError("MTPProposer.begin needs the last layer's output of every "
                             "prompt row")
        head, self._prefix = self._prefix, None
        start = 0
        if head is not None and tuple(prompt_ids[:len(head.ids)]) == head.ids \
                and len(prompt_ids) > len(head.ids):
            self.state.load(head.state)
            start = head.state.length
        self.pending_hidden = [taps[:, start:-1], taps[:, -1:]]
        self.pending_tokens = list(prompt_ids[start:])

    @inference
    def propose(self, anchor: torch.Tensor, start: int, num: int) -> torch.Tensor:
        if self._drafts_together_compiled():
            return self.propose_together([DraftAsk(self, anchor, start, num)])[0]
        # Rows before the last commit's (the prompt, or cycles another proposer drafted)
        # are a catch-up; the last commit's rows are this cycle's first head forward.
        tokens, hidden = self._catch_up(anchor, start)
        out = self.head(self.embed(tokens)[None], hidden, self.state)
        self.state.commit(out.shape[1])
        out = out[:, -1:]
        chained = _chained(self.head.static, out, self.state, [self],
                           [DraftAsk(self, anchor, start, num)])
        if chained is not None:
            return chained[0, :num]
        drafts = [self._draft(out, start + 1)]
        for i in range(num - 1):
            out = self.head(self.embed(drafts[-1])[None], out, self.state)
            self.state.commit(1)
            drafts.append(self._draft(out, start + 2 + i))
        self.state.truncate(start)       # entries from drafts: dropped before the verify
        return torch.cat(drafts)

    def _commit_rows(self, tokens: torch.Tensor, hidden: torch.Tensor) -> None:
        """Head entries for rows (next token, normed target h) at the cache's next
        positions, in chunks."""
        for at in range(0, tokens.shape[0], self.chunk):
            end = min(at + self.chunk, tokens.shape[0])
            self.head(self.embed(tokens[at:end])[None], hidden[:, at:end], self.state)
            self.state.commit(end - at)

    def _draft(self, out: torch.Tensor, position: int) -> torch.Tensor:
        return self.pick(self.head.logit_input(out)[0] @ self.lm_head_weight.T, position)

    @inference
    def commit(self, tokens: Sequence[int], taps: torch.Tensor | None, start: int) -> None:
        if taps is None:
            raise ValueError("MTPProposer.commit needs the committed rows' taps")
        n = len(tokens)
        self.pending_hidden.append(taps[:, :n])
        self.pending_tokens.extend(tokens)


def _head_compiled_over(slots: SlotStates, head: MTPHead) -> bool:
    """Whether the head's forwards over `slots` run through graphs compiled for them."""
    return slots.static is not None and head.batch_static is slots.static


def _chained(static: StaticHead | None, now: torch.Tensor, state: object,
             heads: list[MTPProposer], asks: Sequence[DraftAsk]) -> torch.Tensor | None:
    """Every row's drafts [rows, chain] in one compiled chain (`StaticHead.run_chain`),
    where the head has one for `state`, the longest ask drafts the whole chain (a shorter
    one would compute drafts nobody asked for) and every request drafts greedily (a
    sampled one's picker draws each draft itself); None: step by step. The chain's cache
    rows are dropped as a step's are."""
    if (static is None or any(p.picker is not None for p in heads)
            or max(a.num for a in asks) != static.chain
            or not static.accepts_chain(state, now.shape[0])):
        return None
    drafts = static.run_chain(now, state)
    for p, a in zip(heads, asks):
        p.state.truncate(a.start)
    return drafts


def _catch_up_together(slots: SlotStates, n: int, heads: list[MTPProposer],
                       asks: Sequence[DraftAsk]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each fork's catch-up (`_catch_up`), those of two or more forks whose caches are
    calibrated in head forwards over rows 0..n-1 of `slots` together, a chunk of rows at a
    time (a cache not yet calibrated is calibrated by its own first rows, alone; a lone
    catch-up runs alone, not padded to n rows); -> each fork's last commit's (tokens,
    hidden), for the first forward of this proposal."""
    taken = [p._take_pending(a.anchor, a.start) for p, a in zip(heads, asks)]
    together = [i for i, (p, (_, _, split)) in enumerate(zip(heads, taken))
                if split and (not p.state.kv.is_fp8 or all(p.state.kv.calibrated))]
    if len(together) == 1:
        # one request catching up (a newcomer's prompt): on its own row, not padded to n
        together = []
    for i, (p, (tokens, hidden, split)) in enumerate(zip(heads, taken)):
        p.catchup_ms = 0.0
        if split and i not in together:
            t0 = time.perf_counter()
            p._commit_rows(tokens[:split], hidden[:, :split])
            p.catchup_ms = (time.perf_counter() - t0) * 1000.0
    if together:
        t0 = time.perf_counter()
        lead, device = heads[together[0]], asks[0].anchor.device
        longest = max(taken[i][2] for i in together)
        for at in range(0, longest, lead.chunk):
            width = min(lead.chunk, longest - at)
            going = {heads[i].row: min(taken[i][2] - at, width) for i in together
                     if taken[i][2] > at}
            tokens = torch.zeros(n, width, dtype=torch.long, device=device)
            hidden = torch.zeros(n, width, taken[together[0]][1].shape[-1],
                                 dtype=taken[together[0]][1].dtype, device=device)
            for i in together:
                row, k = heads[i].row, going.get(heads[i].row, 0)
                tokens[row, :k] = taken[i][0][at:at + k]
                hidden[row, :k] = taken[i][1][0, at:at + k]
            lead.head(lead.embed(tokens), hidden, slots.rows(n, list(going)))
            _settle(slots, n, going)
        ms = (time.perf_counter() - t0) * 1000.0
        for i in together:        # each waited on the forwards of all
            heads[i].catchup_ms = ms
    return [(tokens[split:], hidden[:, split:]) for tokens, hidden, split in taken]


def _settle(slots: SlotStates, n: int, keep: dict[int, int]) -> None:
    """After a forward over rows 0..n-1 of `slots`: rows in `keep` keep that many rows, the
    others (padding) none."""
    for index, view in enumerate(slots.views[:n]):
        view.keep(keep.get(index, 0))
