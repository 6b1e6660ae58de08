"""In-flight batched speculative decoding: up to `max_batch` requests decode together, one
target verify per cycle for all of them, each accepting, stopping and rolling back on its own.

A cycle (`Batch.step`):
1. waiting requests take free slots (`slots.py`) and prefill, one chunk after another,
   within a budget of `prefill_budget` tokens per cycle while others are running (so a long
   prompt never stalls them for its whole prefill; with none running, without a limit);
2. every running request drafts its block with its own proposers (forks of the engine's:
   `Proposer.fork`), the drafts of those sharing a drafter or an MTP head's slots in one
   forward per step (`draft_together`), and its grammar cuts it;
3. one target forward verifies every block, padded to the longest with rows that the
   commit makes harmless: a request commits at most its own rows, its GDN state replayed
   from its accepted rows alone, so the padding never reaches the recurrent state, while
   the KV rows past its length are overwritten before anything reads them. A compiled
   forward computes the padding rows too, so there the blocks are first cut to the row
   bucket that verifies the most rows a second of the cycle (`StaticGraphs.best_rows`:
   the forwards timed at warm-up, the cycle's other work measured as it runs): a cut
   block loses drafts or forced tokens, as a rejection would;
4. each request accepts, applies its stop rules, publishes and commits on its own slot
   (`Decoding.finish`), exactly as it does alone; the greedy strict ones decide together
   (one masking, argmax and host copy for all: `decide_strict_together`).

A request whose step raises (its grammar, its callback, non-finite logits) ends alone with
that error; the others go on. A failed verify forward fails every request in it (their
state is no longer reliable). A request that ends frees its slot: the last running slot is
moved into it, so running slots stay rows 0..m-1.

The slots belong to the engine (`Engine.batch_slots`); where it compiles, the verify, the
MTP head's steps and the DFlash drafter's groups run through graphs compiled for the slots
per batch bucket (models/graphs/compiled.py), a lone request included.

The batch is driven by one thread (`step`, `run`); `submit` and cancellation may come from
any thread.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from .decoding import CancelToken, Decoding, GenerationResult, GenerationSettings, TokenCallback
from .engine import Engine
from .generate import start
from .inputs.images import ImagePatches
from .loop.auto_proposer import AutoProposer
from .loop.constraint import Constraint
from .loop.proposer import DraftAsk, Proposer, draft_together
from .loop.proposers import fork_proposers
from .loop.speculative import Block, decide_strict_together
from .models.qwen.moe import RoutingRecord
from .state.slots import SlotStates
from .telemetry import SharedPhase

log = logging.getLogger(__name__)

OVERHEAD_SMOOTHING = 0.2     # of the moving average of a cycle's work besides its verify


@dataclass
class BatchRequest:
    """What `generate` takes, for a batch (a fresh constraint per request)."""
    prompt: Sequence[int] | str | list[dict]
    settings: GenerationSettings = field(default_factory=GenerationSettings)
    on_token: TokenCallback | None = None
    cancel: CancelToken | None = None
    constraint: Constraint | None = None
    prefix: Sequence[int] | None = None
    proposer: Proposer | None = None     # tests: a replay proposer of the request's own
    images: Sequence[ImagePatches] = ()  # a vision-language target's, one per image run
    arrived: float = field(default_factory=time.monotonic)
    future: Future = field(default_factory=Future)


@dataclass
class _Running:
    request: BatchRequest
    decoding: Decoding
    proposers: dict[str, Proposer]       # a set of the pool, returned when it ends
    prefill: Iterator[None] | None       # its prefill's chunks, until they are done


@dataclass
class CycleStats:
    """What the last cycles did (diagnostics)."""
    cycles: int = 0
    verify_rows: int = 0          # rows of the batched forwards, padding included
    block_rows: int = 0           # of those, the requests' own (anchor and drafts)
    tokens: int = 0               # tokens published by running requests
    shortened: int = 0            # blocks cut to a compiled batch's rows (`best_rows`)


class Batch:
    def __init__(self, engine: Engine, max_batch: int | None = None,
                 prefill_budget: int | None = None, draft_cap: int | None = None):
        """draft_cap: at most this many drafts per cycle for `auto` requests (None: each
        request's own routing decides; measured best on this project's CPU at every batch
        size once drafts go through their drafter together, docs/performance.md)."""
        self.engine = engine
        self.max_batch = max_batch or engine.config.resolve_max_batch(engine.device)
        self.prefill_budget = prefill_budget or engine.config.prefill_chunk
        if self.max_batch == 1:
            # the engine's own state and proposers: what `generate` runs, compiled included
            self.slots = SlotStates.around(engine.state)
            self._pool = [engine.proposers]
        else:
            # slots 0..max_batch-1 for running requests, the last for prefilling newcomers
            self.slots = engine.batch_slots(self.max_batch)
            # the forks' MTP caches are rows of one state (`slots.heads`), so their drafts
            # go through the head together; the lowest rows are taken first, so that the
            # head runs over as few rows as the requests drafting with it need
            self._pool = [fork_proposers(engine.proposers, self.slots.heads, i)
                          for i in reversed(range(self.max_batch))]
        self._rank = {id(p): i for i, p in enumerate(self._pool)}   # pop: the last
        self._active: list[_Running] = []    # running requests, by slot
        self._staged: _Running | None = None  # the newcomer prefilling on the staging slot
        self._waiting: collections.deque[BatchRequest] = collections.deque()
        self._lock = threading.Lock()             # guards _waiting: submit from any thread
        self.stats = CycleStats()
        self.draft_cap = draft_cap
        self._overhead = 0.0      # seconds of a batched cycle besides its verify (moving)

    # ---- any thread
    def submit(self, request: BatchRequest) -> Future:
        """Queue a request; its future holds the GenerationResult or the error that ended it."""
        with self._lock:
            self._waiting.append(request)
        return request.future

    @property
    def running(self) -> int:
        return len(self._active) + (self._staged is not None)

    @property
    def waiting(self) -> int:
        with self._lock:
            return len(self._waiting)

    # ---- the driving thread
    def run(self, requests: Sequence[BatchRequest]) -> list[GenerationResult]:
        """Submit `requests` and decode until all have ended (tests, benchmarks, the CLI);
        the first error of any is raised after all have ended."""
        futures = [self.submit(r) for r in requests]
        while any(not f.done() for f in futures):
            self.step()
        return [f.result() for f in futures]

    def step(self) -> None:
        """One cycle: newcomers prefill within the budget, then one verify for every
        running request."""
        with torch.inference_mode():
            self._prefill()
            self._cycle()

    def _stage(self) -> _Running | None:
        """The next waiting request, started on the staging slot (None: none waits or no
        slot is free)."""
        while len(self._active) < self.max_batch:
            with self._lock:
                if not self._waiting:
                    return None
                request = self._waiting.popleft()
            if not request.future.set_running_or_notify_cancel():
                continue                      # cancelled by its caller while it waited
            proposers = self._pool.pop()
            # with none running, straight into slot 0 (no other request can run before it
            # has prefilled); else on the staging slot, so running rows never move under it
            slot = self.max_batch if self._active else 0
            try:
                decoding = start(self.engine, self.slots.view(slot),
                                 request.prompt, request.settings, request.on_token,
                                 request.cancel, request.proposer, None, request.constraint,
                                 request.prefix, proposers, request.arrived,
                                 request.images)
            except Exception as exc:          # a request the engine refuses: its error alone
                self._give_back(proposers)
                request.future.set_exception(exc)
                continue
            if decoding.proposer is not None:
                decoding.proposer.set_picker(getattr(decoding.policy, "pick", None))
            return _Running(request, decoding, proposers, decoding.prefill())
        return None

    def _prefill(self) -> None:
        """Newcomers prefill on the staging slot, a chunk at a time, oldest first: within
        the budget while requests are running, every newcomer's whole prompt when none is.
        A prefilled request moves into the next running row."""
        budget = self.prefill_budget if self._active else None
        spent = 0
        while budget is None or spent < budget:
            r = self._staged = self._staged or self._stage()
            if r is None:
                return
            if r.decoding.interrupted():
                self._end(r)
                continue
            before = r.decoding.state.length
            try:
                next(r.prefill)
            except StopIteration:
                r.prefill = None
            except Exception as exc:
                self._end(r, exc)
                continue
            spent += max(r.decoding.state.length - before, 1)
            if r.prefill is not None:
                continue
            self._staged = None
            if r.decoding.done:               # its first token ended it
                self._end(r)
                continue
            slot = len(self._active)
            if r.decoding.state is not self.slots.view(slot):
                self.slots.move(self.slots.views.index(r.decoding.state), slot)
                r.decoding.state = self.slots.view(slot)
            self._active.append(r)

    def _cycle(self) -> None:
        if not self._active:
            return
        t0 = time.perf_counter()
        blocks = self._draft(self.draft_cap)
        running = list(self._active)
        if not running:
            return
        m = len(running)
        lengths = [int(blocks[id(r)].rows.shape[0]) for r in running]
        if m > 1 and self.slots.static is not None and max(lengths) > 1:
            # a compiled forward pads every block to the longest: verify at the rows that
            # check the most of them a second of the cycle, longer blocks cut
            # (StaticGraphs.best_rows)
            cut = self.slots.static.best_rows(lengths, self._overhead)
            for r in running:
                blocks[id(r)] = r.decoding.shorten(cut)
            self.stats.shortened += sum(n > cut for n in lengths)
        rows = [blocks[id(r)].rows for r in running]
        lengths = [int(x.shape[0]) for x in rows]
        t = max(lengths)
        ids = torch.stack([torch.cat((x, x[-1:].expand(t - x.shape[0]))) for x in rows])
        tap_ids = tuple(sorted({i for r in running for i in r.decoding.tap_ids}))
        # one request verifies on its own state (compiled where that is the engine's or
        # where the slots have compiled forwards of their own)
        alone = m == 1 and self.slots.static is None
        state = running[0].decoding.state if alone else self.slots.rows(m)
        model = self.engine.model
        routing = RoutingRecord() if model.moe_blocks else None
        try:
            t1 = time.perf_counter()
            with SharedPhase([r.decoding.timer for r in running], "verify"):
                out = model(ids, state, record_steps=t > 1, taps=tap_ids, all_logits=True,
                            routing=routing, real_rows=lengths if m > 1 else None)
            t2 = time.perf_counter()
        except Exception as exc:
            for r in running:
                self._end(r, exc)
            return
        self.stats.cycles += 1
        self.stats.verify_rows += m * t
        self.stats.block_rows += sum(lengths)
        ended: list[tuple[_Running, BaseException | None]] = []
        before = sum(len(r.decoding.published) for r in running)
        # each slot's kept count, committed for all slots at once after their commits (one
        # GDN commit per layer, not one per layer and slot); a slot that commits nothing
        # (it failed) keeps its state as it was before the verify
        counts = [0] * m
        if m > 1 and t > 1:
            for i, r in enumerate(running):
                r.decoding.state.defer_commit = functools.partial(counts.__setitem__, i)
        taps, experts = [], None if routing is None else []
        for i, r in enumerate(running):
            d, n = r.decoding, lengths[i]
            taps.append(None if not d.tap_ids else torch.cat(
                [out.taps[tap_ids.index(j)][i:i + 1, :n] for j in d.tap_ids], dim=-1))
            if experts is not None:      # the experts its own rows chose, as alone
                own = RoutingRecord()
                own.ids = [_own_rows(x, lengths, i) for x in routing.ids]
                experts.append(own.distinct_per_layer(model.moe_blocks[0].num_experts).sum())
        decided = self._decide_strict(running, out, experts)
        for i, r in enumerate(running):
            d = r.decoding
            try:
                if i in decided:
                    d.finish_cycle(decided[i], taps[i], experts is not None)
                else:
                    d.finish(out.logits[i, :lengths[i]], None, taps[i],
                             None if experts is None else experts[i])
            except Exception as exc:
                ended.append((r, exc))
                continue
            if d.done:
                ended.append((r, None))
        if m > 1 and t > 1:
            for r in running:
                r.decoding.state.defer_commit = None
            self.slots.rows(m).gdn.commit(torch.tensor(counts, dtype=torch.int32,
                                                       device=ids.device))
        self.stats.tokens += sum(len(r.decoding.published) for r in running) - before
        for r, exc in ended:      # a failed request's rows were never committed: emptied
            if exc is not None:   # before any slot moves (a move takes committed rows only),
                r.decoding.state.reset()         # and its KV rows cleared (KVCache.clear)
                r.decoding.state.kv.clear()
        for r, exc in ended:      # after every slot has committed: the moves need that
            self._end(r, exc)
        if m > 1:
            # the cycle's work besides its verify (`best_rows`), a moving average
            rest = time.perf_counter() - t2 + t1 - t0
            self._overhead += OVERHEAD_SMOOTHING * (rest - self._overhead)

    @staticmethod
    def _decide_strict(running: list[_Running], out, experts: list | None
                       ) -> dict[int, list[int] | BaseException]:
        """Step 3 of the greedy strict requests (every request of a greedy batch) at once
        (`decide_strict_together`): by batch row, each one's host row or its error; the
        others decide alone (`Decoding.finish`)."""
        rows = [i for i, r in enumerate(running) if r.decoding.decides_strictly]
        if len(rows) < 2:
            return {}
        every = len(rows) == len(running)
        pick = slice(None) if every else torch.tensor(rows, device=out.logits.device)
        finite = None if out.finite is None else out.finite[pick]
        decided = decide_strict_together(
            [running[i].decoding.block for i in rows], out.logits[pick], finite,
            [running[i].decoding.constraint for i in rows],
            [running[i].decoding.timer for i in rows],
            None if experts is None else [experts[i] for i in rows])
        return dict(zip(rows, decided))

    def abort(self, error: BaseException) -> None:
        """End every request in the batch with `error` (after a fault of the batch itself:
        nothing of its state is trusted), and every waiting one."""
        for r in list(self._active) + ([self._staged] if self._staged else []):
            self._end(r, error)
        with self._lock:
            waiting, self._waiting = list(self._waiting), collections.deque()
        for request in waiting:
            if request.future.set_running_or_notify_cancel():
                request.future.set_exception(error)

    def _draft(self, cap: int | None) -> dict[int, Block]:
        """Every running request's block (by id of its entry): the drafts of requests whose
        proposers share a drafter (DFlash) or a head's slots (MTP) in one forward per step
        (`draft_together`), the others each its own."""
        self._route_together()
        asked: dict[int, torch.Tensor | DraftAsk] = {}
        for r in list(self._active):
            d = r.decoding
            try:
                asked[id(r)] = d.ask(cap if d.proposer is not None
                                     and d.proposer.name == "auto" else None)
            except Exception as exc:
                self._end(r, exc)
        groups: dict[int, list[_Running]] = {}
        for r in self._active:
            if isinstance(asked[id(r)], DraftAsk):
                groups.setdefault(id(asked[id(r)].proposer.together_key()), []).append(r)
        for members in groups.values():
            try:
                with SharedPhase([r.decoding.timer for r in members], "draft"):
                    drafts = draft_together([asked[id(r)] for r in members])
            except Exception as exc:
                for r in members:
                    self._end(r, exc)
                continue
            asked.update({id(r): x for r, x in zip(members, drafts)})
        blocks = {}
        for r in list(self._active):
            try:
                blocks[id(r)] = r.decoding.draft_from(asked[id(r)])
            except Exception as exc:
                self._end(r, exc)
        return blocks

    def _route_together(self) -> None:
        """`auto` requests draft this cycle with the candidate most of them prefer: one
        drafter's forward for all of them instead of one per proposer, and blocks of one
        length to verify (what each router measures then is its own cycles)."""
        routers = [r.decoding.proposer for r in self._active
                   if isinstance(r.decoding.proposer, AutoProposer)]
        if len(routers) < 2:
            return
        votes = collections.Counter(p.preferred() for p in routers)
        common = votes.most_common(1)[0][0]
        for p in routers:
            p.route(common)

    def _give_back(self, proposers: dict[str, Proposer]) -> None:
        """A set of proposers back in the pool, which hands out the lowest rows first."""
        self._pool.append(proposers)
        self._pool.sort(key=lambda p: self._rank[id(p)])

    def _end(self, r: _Running, error: BaseException | None = None) -> None:
        """A request leaves: its slot emptied (the last running slot moved into it), its
        proposers back in the pool, its future resolved."""
        d = r.decoding
        d.state.reset()
        if d.proposer is not None:
            d.proposer.set_picker(None)
        self._give_back(r.proposers)
        if r is self._staged:
            self._staged = None
        elif r in self._active:
            index = self._active.index(r)
            last = self._active.pop()
            if last is not r:
                self.slots.move(len(self._active), index)
                last.decoding.state = self.slots.view(index)
                self._active[index] = last
        if error is not None:
            log.info("a batched request ended with an error: %s", error)
            r.request.future.set_exception(error)
        else:
            r.request.future.set_result(d.result)


def _own_rows(x: torch.Tensor, lengths: list[int], i: int) -> torch.Tensor:
    """Batch row i's real rows of a per-row record of a verify: padded ([B*T, ...], a
    compiled forward) or packed (the real rows alone, an eager one; packing.py)."""
    t = max(lengths)
    if x.shape[0] == len(lengths) * t:      # padded (packing without padding is the same)
        return x.view(len(lengths), t, -1)[i, :lengths[i]]
    start = sum(lengths[:i])
    return x[start:start + lengths[i]]
