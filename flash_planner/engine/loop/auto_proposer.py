"""`auto`: route each speculative cycle to the proposer expected to publish tokens fastest.

The candidates are the loaded proposers and plain decoding (a cycle with no drafts), so
text no proposer predicts decodes at plain speed. Per phase (thinking, answer: from the
published tokens, the anchor included) and candidate the router keeps a moving estimate of
tokens published per cycle and of the cycle's cost in wall time (propose -> commit: draft,
verify, accept and the host sync; a proposer's catch-up over the rows of cycles it did not
draft, `catchup_ms`, is a switching cost and left out). A cycle goes to the candidate with
the most tokens per millisecond. A candidate runs `SETTLED` cycles in a phase before its
estimate counts; after that every other candidate drafts once after `probe_every / r^2`
cycles without it (at most 8 probe_every), r being its rate over the best one's, so a change
in the text (plan JSON, prose, repeated lines) is noticed while a candidate far behind costs
little: probing loses at most (1 - r) r^2 / probe_every of the
time, under 1.2% at the default of 12. Wall time only ever errs upward (the process waits
or is preempted), so the cost estimate takes a lower sample at once and moves toward a
higher one by the moving average, a stall counting at most 3x: one stall cannot shut a
candidate out. The estimates persist across requests (one router per engine).

On a mixture-of-experts target a verify block of n rows reads the union of the experts its
rows chose, so a longer block costs more, by how much depending on how correlated the routing
is. There a candidate is a proposer *and a draft length* (`lengths`, e.g. 1, 2, 4, 8, 15): each
length's cycle cost is measured when it runs; its tokens per cycle come from the proposer's
survival curve, P(draft i accepted | drafted), pooled over every cycle of any length (the
first k drafts are the same whether more follow, so a cycle of k drafts informs every
position up to k): tokens(k) = 1 + sum over i <= k of the survival. The router picks the
length that publishes most per millisecond under the routing it measures.

Every proposer sees every `begin` and `commit`, whichever drafted, so each one's state (the
drafter's window, the MTP head's cache) is exact when it is next chosen. Verification does
not depend on who drafted, so greedy output with strict acceptance is still exactly the
target's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .acceptance import ThinkTracker
from .proposer import DraftAsk, Proposer, drafts_of

# Cycles a candidate runs in a phase before its estimate is trusted: a process's first
# cycles of a proposer pay first-call costs (on a GPU, hundreds of ms) and one cycle's
# acceptance is luck; trusted at once, such a sample shut a proposer out for up to
# 8 probe_every cycles, longer than a whole one-shot plan.
SETTLED = 3


@dataclass
class Estimate:
    tokens: float        # published tokens per cycle (moving average)
    ms: float | None     # wall ms per cycle (moving average); None: never ran (tokens were
                         # inferred from a longer draft of the same proposer)
    last_cycle: int      # router cycle count when this candidate last ran in the phase
    samples: int = SETTLED   # cycles measured (one built by hand counts as settled)

    @property
    def rate(self) -> float:
        return self.tokens / max(self.ms or 0.0, 1e-6)


class PlainDecoding(Proposer):
    """The router's no-draft candidate: a cycle verifies the anchor alone."""

    name = "none"
    block_size = 1

    def propose(self, anchor: torch.Tensor, start: int, num: int) -> torch.Tensor:
        return anchor[:0]


class AutoProposer(Proposer):
    name = "auto"

    def __init__(self, proposers: dict[str, Proposer], think_ids: tuple[int, int] | None,
                 probe_every: int = 12, smoothing: float = 0.3,
                 clock: Callable[[], float] = time.perf_counter,
                 lengths: dict[str, Sequence[int]] | None = None):
        """lengths: the draft lengths to choose among per proposer (default: its longest)."""
        if not proposers:
            raise ValueError("auto needs a proposer to choose against plain decoding")
        self.proposers = {**proposers, PlainDecoding.name: PlainDecoding()}
        # candidate -> (proposer, drafts per cycle); a proposer with one length is named
        # alone ("dflash"), one with several once per length ("dflash:4")
        self.candidates: dict[str, tuple[str, int]] = {}
        for name, p in self.proposers.items():
            ks = sorted({min(max(k, 0), p.block_size - 1)
                         for k in (lengths or {}).get(name, (p.block_size - 1,))})
            self.candidates.update({(f"{name}:{k}" if len(ks) > 1 else name): (name, k)
                                    for k in ks})
        self.tap_ids = tuple(sorted({t for p in proposers.values() for t in p.tap_ids}))
        self.block_size = max(p.block_size for p in proposers.values())
        self.seed_rows = max(p.seed_rows for p in proposers.values())
        # each proposer's tap layers as slots of the union, in the proposer's order
        self._slots = {name: [self.tap_ids.index(t) for t in p.tap_ids]
                       for name, p in self.proposers.items()}
        self._index: dict[str, torch.Tensor] = {}
        self.phase = ThinkTracker(*think_ids) if think_ids is not None else None
        self.probe_every = probe_every
        self.smoothing = smoothing
        self.clock = clock                 # seconds; tests pass a virtual one
        self.estimates: dict[tuple[str, str], Estimate] = {}     # (phase, candidate)
        self.cycles = 0
        self._method = ""                # the proposer that drafted the current cycle
        self._routed: str | None = None  # the candidate a batch chose for the next ask
        self._drafting: tuple[str, str, float] | None = None  # (phase, candidate, start)
        # (phase, proposer) -> per draft position [decayed cycles that drafted it, that
        # accepted it], for proposers with several lengths
        self._survival: dict[tuple[str, str], list[list[float]]] = {}

    @property
    def last_method(self) -> str:
        return self._method

    def fork(self, forks: dict[str, Proposer] | None = None) -> AutoProposer:
        """Routing of its own among forks of the same proposers (given, or made here); its
        estimates start empty: each fork measures its own cycles."""
        if forks is None:
            forks = {name: p.fork() for name, p in self.proposers.items()
                     if name != PlainDecoding.name}
        think = None if self.phase is None else (self.phase.open, self.phase.close)
        lengths = {}
        for owner, k in self.candidates.values():
            lengths.setdefault(owner, []).append(k)
        return AutoProposer(forks, think, self.probe_every, self.smoothing, self.clock,
                            lengths)

    def forget(self) -> None:
        """Drop every estimate (after a warm-up, whose cycles paid first calls and were cut
        short): the next requests measure each candidate afresh."""
        self.estimates.clear()
        self._survival.clear()

    def _phase(self) -> str:
        return "think" if self.phase is not None and self.phase.thinking else "answer"

    def _taps_for(self, name: str, taps: torch.Tensor | None, rows: int | None = None
                  ) -> torch.Tensor | None:
        """The columns of the union taps [1, T, n*H] that proposer `name` asked for: a view
        when its layers are adjacent in the union (always, for dflash + mtp), else a gather
        with an index built once."""
        slots = self._slots[name]
        if taps is None or not slots:
            return None
        if rows is not None:
            taps = taps[:, taps.shape[1] - min(rows, taps.shape[1]):]
        width = taps.shape[-1] // len(self.tap_ids)
        if slots == list(range(slots[0], slots[0] + len(slots))):
            return taps[..., slots[0] * width:(slots[0] + len(slots)) * width]
        index = self._index.get(name)
        if index is None or index.device != taps.device:
            index = self._index[name] = torch.tensor(slots, device=taps.device)
        split = taps.view(*taps.shape[:2], len(self.tap_ids), width)
        return split.index_select(2, index).flatten(2)

    def choose(self, phase: str) -> str:
        known = {c: self.estimates.get((phase, c)) for c in self.candidates}
        for cand, est in known.items():
            if est is None or est.ms is None or est.samples < SETTLED:
                return cand                        # never measured here, or not enough
        best = max(known, key=lambda c: known[c].rate)
        top = known[best].rate
        stale = [c for c, est in known.items() if c != best
                 and self.cycles - est.last_cycle >= min(
                     8 * self.probe_every, self.probe_every * (top / max(est.rate, 1e-9)) ** 2)]
        return stale[0] if stale else best

    def begin(self, prompt_ids: Sequence[int], taps: torch.Tensor | None) -> None:
        if self.phase is not None:
            self.phase.reset(prompt_ids)
        self._drafting = None
        for name, p in self.proposers.items():
            p.begin(prompt_ids, self._taps_for(name, taps, p.seed_rows) if p.seed_rows else None)

    def use_prefix_state(self, states: dict[str, object]) -> None:
        for p in self.proposers.values():
            p.use_prefix_state(states)

    def set_picker(self, picker) -> None:
        super().set_picker(picker)
        for p in self.proposers.values():
            p.set_picker(picker)

    def propose(self, anchor: torch.Tensor, start: int, num: int) -> torch.Tensor:
        return drafts_of(self.ask(anchor, start, num))

    def preferred(self) -> str:
        """The candidate the next `ask` would draft with (no state changes)."""
        return self.choose(self._phase())

    def route(self, candidate: str | None) -> None:
        """Draft the next `ask` with `candidate` (a batch's common choice: requests that draft
        with one proposer share its forward) instead of this router's own."""
        self._routed = candidate

    def ask(self, anchor: torch.Tensor, start: int, num: int) -> torch.Tensor | DraftAsk:
        phase = self._phase()
        cand = self._routed or self.choose(phase)
        self._routed = None
        self._method, drafts = self.candidates[cand]
        self._drafting = (phase, cand, self.clock())
        return self.proposers[self._method].ask(anchor, start, min(num, drafts))

    def commit(self, tokens: Sequence[int], taps: torch.Tensor | None, start: int) -> None:
        if self._drafting is not None:
            phase, cand, t0 = self._drafting
            ms = (self.clock() - t0) * 1000.0
            # the catch-up is another candidate's debt; never let it make a cycle free
            ms = max(ms - self.proposers[self.candidates[cand][0]].catchup_ms, 0.05 * ms)
            self._record(phase, cand, len(tokens), ms)
            self._drafting = None
        for name, p in self.proposers.items():
            p.commit(tokens, self._taps_for(name, taps), start)

    def published(self, tokens: Sequence[int]) -> None:
        if self.phase is not None:
            self.phase.observe(tokens)

    def _record(self, phase: str, cand: str, tokens: int, ms: float) -> None:
        self.cycles += 1
        name, drafts = self.candidates[cand]
        lengths = {k: c for c, (owner, k) in self.candidates.items() if owner == name}
        if len(lengths) == 1:
            self._update(phase, cand, tokens, ms)
            return
        curve = self._survival.setdefault((phase, name), [[0.0, 0.0] for _ in
                                                          range(max(lengths))])
        keep = 1.0 - self.smoothing / 4           # decay: the text may change
        for i, counts in enumerate(curve):
            counts[0] *= keep
            counts[1] *= keep
            if i < drafts:
                counts[0] += 1.0
                counts[1] += float(i < tokens - 1)
        self._update(phase, cand, tokens, ms)
        for k, other in lengths.items():
            if all(t for t, _ in curve[:k]):
                est = self.estimates.setdefault((phase, other), Estimate(0.0, None, 0, 0))
                est.tokens = 1.0 + sum(a / t for t, a in curve[:k])

    def _update(self, phase: str, cand: str, tokens: int, ms: float) -> None:
        est = self.estimates.get((phase, cand))
        if est is None:
            self.estimates[(phase, cand)] = Estimate(float(tokens), ms, self.cycles, 1)
            return
        est.samples += 1
        a = self.smoothing
        est.tokens += a * (tokens - est.tokens)
        # a length whose tokens the survival curve gave has no cost until it first runs
        est.ms = ms if est.ms is None else min(ms, est.ms + a * (min(ms, 3 * est.ms) - est.ms))
        est.last_cycle = self.cycles
