"""The proposers' forwards as compiled graphs: the MTP head's rows and the DFlash drafter's
block, on the same footing as the target's (compiled.py: buckets, padding, warm-up, the
on-disk cache, CUDA-graph capture)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ...progress import ProgressLine
from ...state.cache import InferenceState
from ..qwen.layers import rope_cos_sin
from .captured import CapturedGraph, run_graph
from .compiled import span_forward
from .direct import check_direct
from .static_graphs import (
    StaticGraphs,
    batch_rows,
    compile_cache_dir,
    compile_graph,
    compile_in_turn,
    layer_cache,
)
from .warm_up_report import CompileReport, warm_up_report


class StaticHead(StaticGraphs):
    """Runs `MTPHead.forward` for up to max_block rows as one compiled graph per bucket on
    the head's own state: the MTP proposer's drafting steps and its per-cycle catch-up. Or
    on a batch's head slots (`MTPProposer.head_slots`), whose drafts go through the head
    together over slots 0.. up to the highest asking one's batch bucket (`propose_together`):
    `batches`, as the target's.

    With `chain` (the proposer's drafts per proposal, embed and lm_head given), a greedy
    proposal's drafts after its first forward are one graph call per batch bucket
    (`run_chain`): each draft's logits and argmax, and the head's row for the next, inside
    the graph. Drafted one step at a time instead, a chain of 9 is 8 graph calls with the
    logits, argmax and embedding between them on the host: on a CPU batch of 8, more than
    the verify."""

    part = "MTP head"

    def __init__(self, head: nn.Module, state: InferenceState, max_block: int,
                 cache_dir: str | None = None, batches: tuple[int, ...] = (1,),
                 chain: int = 0, embed: nn.Embedding | None = None,
                 lm_head_weight: torch.Tensor | None = None):
        weight = head.pre_fc_norm_hidden.weight
        super().__init__(state, max_block, cache_dir, weight.device, batches)
        if batches != (1,):
            self.part = f"batch of {batches[-1]}'s MTP head"
        self.head = head
        self.caches = {bb: (batch_rows(layer_cache(state, 0, False), bb,
                                       state.kv.k.shape[1]),) for bb in batches}
        self.graph = self._compile(_mtp_head)
        hidden, dtype = head.cfg.hidden_size, head.fc.weight.dtype
        self.inputs = {key: (torch.zeros(*key, hidden, dtype=dtype, device=self.device),
                             torch.zeros(*key, hidden, dtype=dtype, device=self.device))
                       for key in self.keys}
        self.chain = chain if chain > 1 and embed is not None else 0
        self.chain_calls = 0
        self.embed, self.lm_head_weight = embed, lm_head_weight
        if self.chain:
            self.chain_graph = self._compile(_mtp_chain)
            # per batch bucket: the first draft's head output [bb, 1, H] and each row's
            # position for the second [bb, 1]; per chain step, the cache rows its attention
            # reads (a host tensor, as `key_rows`)
            self.chain_inputs = {bb: (torch.zeros(bb, 1, hidden, dtype=dtype,
                                                  device=self.device),
                                      torch.zeros(bb, 1, dtype=torch.long, device=self.device))
                                 for bb in batches}
            self.chain_rows = torch.zeros(self.chain - 1, dtype=torch.long)
            self._chain_steps = torch.arange(1, self.chain)       # step j reads j + 1 more
            self.chains: dict[tuple[int, int], CapturedGraph] = {}   # (bb, key bucket)

    def accepts(self, embedded: torch.Tensor, state: InferenceState) -> bool:
        return self.fits(state, embedded.shape[0], embedded.shape[1])

    def run(self, embedded: torch.Tensor, hidden: torch.Tensor, state: object
            ) -> torch.Tensor:
        """`MTPHead.forward` of rows `accepts` took -> normed outputs [B, T, H]."""
        b, t = embedded.shape[:2]
        key, valid, window_rows = self._begin(state, t, False)
        for buffer, rows in zip(self.inputs[key], (embedded, hidden)):
            buffer[:b, :t].copy_(rows)
        out = self._run(key, valid, window_rows)[:b, :t]
        return out.clone() if self.cuda_graphs else out

    def _forward(self, key: tuple[int, int], valid: torch.Tensor, window_rows: torch.Tensor):
        rope = self.head.cfg.rope
        return self.graph.call(key, self.head, self.caches[key[0]], *self.inputs[key],
                               self.positions[key], self.key_rows, rope.rotary_dim,
                               rope.theta, valid, window_rows)

    def _prepare(self, key: tuple) -> None:
        """`key`'s graph compiled without running it (a deferred bucket or chain)."""
        rope = self.head.cfg.rope
        if key[0] == "chain":
            bb = key[1]
            self.chain_graph.prepare(self.head, self.embed, self.lm_head_weight,
                                     self.caches[bb], *self.chain_inputs[bb], self.chain_rows,
                                     rope.rotary_dim, rope.theta, *self.padding(bb, 1, bb, 1))
            return
        self.graph.prepare(self.head, self.caches[key[0]], *self.inputs[key],
                           self.positions[key], self.key_rows, rope.rotary_dim, rope.theta,
                           *self.padding(*key, *key))

    def what(self, key: tuple) -> str:
        if key[0] != "chain":
            return super().what(key)
        rows = "" if key[1] == 1 else f"{key[1]} x "
        return f"{rows}{self.chain}-draft chain"

    def _extra_keys(self) -> tuple[tuple[str, int], ...]:
        return tuple(("chain", bb) for bb in self.batches) if self.chain else ()

    def accepts_chain(self, state: object, batch: int) -> bool:
        """Whether `run_chain` takes a proposal over these `batch` rows of `state` (the
        chain's rows, written past each row's length, fit its cache)."""
        if ("chain", self._batch_of.get(batch)) not in self.ready:
            return False                  # no chain, or its graph not compiled yet
        slots = self._slots(state, batch)
        return slots is not None and all(s.length + self.chain <= s.capacity for s in slots)

    def run_chain(self, now: torch.Tensor, state: object) -> torch.Tensor:
        """A greedy proposal's `chain` drafts [B, chain] from the head's output now [B, 1, H]
        for each row's first draft (the rows of its last commit just kept): each further
        draft from the head's row at the next position, the argmax of the one before fed
        in. The chain's cache rows lie past each row's length (nothing is kept: the
        proposer forgets drafts' entries before the verify)."""
        b = now.shape[0]
        lengths = [s.length for s in self._slots(state, b)]
        bb = self._batch_of[b]
        now_in, first = self.chain_inputs[bb]
        now_in[:b].copy_(now)
        first.zero_()
        first[:b, 0].copy_(torch.tensor(lengths))
        torch.add(self._chain_steps, max(lengths), out=self.chain_rows)
        self.calls += 1
        self.chain_calls += 1
        out = self._call(partial(self._chain_forward, bb), self.chains, (bb,),
                         int(self.chain_rows[-1]), *self.padding(bb, 1, b, 1))
        return out[:b].clone() if self.cuda_graphs else out[:b]

    def _chain_forward(self, bb: int, valid: torch.Tensor, window_rows: torch.Tensor):
        rope = self.head.cfg.rope
        return self.chain_graph.call(("chain", bb), self.head, self.embed,
                                     self.lm_head_weight, self.caches[bb],
                                     *self.chain_inputs[bb], self.chain_rows,
                                     rope.rotary_dim, rope.theta, valid, window_rows)

    def _warm_extra(self, progress: Callable[[str], None] | None,
                    keys: tuple[tuple[str, int], ...]) -> None:
        """The chain's graph per batch bucket of `keys`, from the empty state (on CUDA
        captured per key bucket; on a CPU run through its entry, then checked by direct
        calls)."""
        kv = self.state.kv
        for i, (_, bb) in enumerate(keys):
            t0 = time.perf_counter()
            valid, window_rows = self.padding(bb, 1, bb, 1)
            for kb in self.key_buckets or (self.chain,):
                self._warm_state((bb, 1))
                for x in self.chain_inputs[bb]:
                    x.zero_()
                self.chain_rows.fill_(kb)
                forward = partial(self._chain_forward, bb, valid, window_rows)
                if self.cuda_graphs:
                    self.chains[bb, kb] = CapturedGraph(partial(self._chain_forward, bb),
                                                        valid, window_rows)
                elif self.compiled[0].direct:
                    check_direct(self.compiled, self.part, (forward(), kv.k, kv.v),
                                 lambda again=forward: (again(), kv.k, kv.v))
                else:
                    forward()
            self.ready.add(("chain", bb))
            if progress is not None:
                progress(ProgressLine(f"compiled the {self.part}'s {self.what(('chain', bb))} "
                                      f"({time.perf_counter() - t0:.1f} s)", "compiling",
                                      i + 1, len(keys)))


def _mtp_head(head: nn.Module, caches: tuple[tuple[torch.Tensor, ...], ...],
              embedded: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
              key_rows: torch.Tensor, rotary_dim: int, theta: float, valid: torch.Tensor,
              window_rows: torch.Tensor) -> torch.Tensor:
    x = head.fuse(embedded, hidden)
    cos, sin = rope_cos_sin(positions, rotary_dim, theta, x.dtype)
    outs, _ = span_forward(tuple(head.layers), caches, x, cos, sin, positions, key_rows,
                           valid, window_rows)
    return head.norm(outs[-1])


def _mtp_chain(head: nn.Module, embed: nn.Embedding, lm_head_weight: torch.Tensor,
               caches: tuple[tuple[torch.Tensor, ...], ...], now: torch.Tensor,
               first: torch.Tensor, key_rows: torch.Tensor, rotary_dim: int, theta: float,
               valid: torch.Tensor, window_rows: torch.Tensor) -> torch.Tensor:
    """`StaticHead.run_chain`: drafts [bb, 1 + key_rows' length], each the argmax of the
    target's lm_head over the head's output (as `MTPProposer._draft` picks greedily), the
    head run at positions first + j for draft j + 2."""
    drafts = []
    steps = key_rows.shape[0]
    for j in range(steps + 1):
        token = (head.logit_input(now) @ lm_head_weight.T).argmax(dim=-1)      # [bb, 1]
        drafts.append(token)
        if j == steps:
            break
        positions = first + j
        x = head.fuse(embed(token), now)
        cos, sin = rope_cos_sin(positions, rotary_dim, theta, x.dtype)
        outs, _ = span_forward(tuple(head.layers), caches, x, cos, sin, positions,
                               key_rows[j:j + 1], valid, window_rows)
        now = head.norm(outs[-1])
    return torch.cat(drafts, dim=1)


class StaticDrafter:
    """The DFlash drafter's proposal (block forward and logits, or a DFlash2 selector's
    candidates and pair scores) as one compiled graph:
    the block is the proposer's fixed block size and the context window is padded to its
    capacity, its empty rows at a position no block precedes (so the drafter's own mask
    hides them). With `batches` (group sizes, e.g. 2, 4, 8), the blocks of several requests
    drafted together instead (`propose_rows`; a batch's `propose_together`), each at its own
    start over its own window, a group padded to the smallest size that holds it; on a CPU
    with `lazy` warm-ups, those groups' graphs compile in the background (a first request
    drafts alone)."""

    part = "DFlash drafter"

    def __init__(self, drafter: nn.Module, embed: nn.Embedding, lm_head_weight: torch.Tensor,
                 block_size: int, window: int, cache_dir: str | None = None,
                 batches: tuple[int, ...] = ()):
        self.drafter, self.embed, self.lm_head_weight = drafter, embed, lm_head_weight
        self.block_size, self.window = block_size, window
        self.cache_dir = compile_cache_dir(cache_dir)
        self.cuda_graphs = lm_head_weight.device.type == "cuda"
        # 0: one request's block, its tensors without a batch dimension
        self.keys = batches or (0,)
        if batches:
            self.part = f"batch of {batches[-1]}'s DFlash drafter"
        self.inputs = {bb: self._inputs(bb) for bb in self.keys}
        fn = _dflash_drafts_rows if batches else _dflash_drafts
        self.graph = compile_graph(fn, self.cuda_graphs, block_size, self.cache_dir,
                                   f"{self.part} {fn.__name__}")
        self.captured: dict[int, CapturedGraph] = {}
        self.report: CompileReport | None = None
        self.ready: set[int] = set()        # keys whose graphs are compiled
        self.later: tuple[int, ...] = ()    # keys warm-up left to compile_later
        self.calls = 0

    def _inputs(self, bb: int) -> tuple[torch.Tensor, torch.Tensor, list, torch.Tensor]:
        """(ids, start, per-layer context (k, v), context positions) of a key's graph."""
        device, dtype = self.lm_head_weight.device, self.lm_head_weight.dtype
        cfg, lead = self.drafter.cfg, (bb,) if bb else ()
        shape = (max(bb, 1), self.window, cfg.num_kv_heads, cfg.head_dim)
        ctx_kv = [(torch.zeros(shape, dtype=dtype, device=device),
                   torch.zeros(shape, dtype=dtype, device=device))
                  for _ in range(cfg.num_layers)]
        return (torch.zeros(*lead, self.block_size, dtype=torch.long, device=device),
                torch.zeros(max(bb, 1), dtype=torch.long, device=device), ctx_kv,
                torch.full((*lead, self.window), EMPTY_POSITION, device=device))

    def accepts(self, ids: torch.Tensor, window_rows: int) -> bool:
        return (self.report is not None and ids.shape[0] == self.block_size
                and window_rows <= self.window)

    def accepts_rows(self, blocks: list) -> bool:
        """Whether `propose_rows` takes these (ids, start, ctx_kv, ctx_pos) blocks."""
        bb = next((b for b in self.keys if b >= len(blocks)), None)
        return (self.report is not None and bb in self.ready
                and all(self.accepts(ids, pos.shape[0]) for ids, _, _, pos in blocks))

    def propose(self, ids: torch.Tensor, start: int, ctx_kv, ctx_pos: torch.Tensor):
        """`draft_output` of the block ids [block_size] at `start` (logits [block_size - 1,
        V], or a selector's candidates and pair scores), over the window's per-layer (k, v)
        [1, n, Hkv, D] at positions ctx_pos [n] (the proposer picks the drafts)."""
        self._stage(0, [(ids, start, ctx_kv, ctx_pos)])
        return self._call(0)

    def propose_rows(self, blocks: list) -> list:
        """`propose` of several requests' blocks (ids, start, ctx_kv, ctx_pos) in one
        graph call: each one's `draft_output`."""
        bb = next(b for b in self.keys if b >= len(blocks))
        self._stage(bb, blocks)
        return list(self._call(bb)[:len(blocks)])

    def _stage(self, bb: int, blocks: list) -> None:
        self.calls += 1
        ids_in, start_in, ctx_in, pos_in = self.inputs[bb]
        for i, (ids, start, ctx_kv, ctx_pos) in enumerate(blocks):
            n = ctx_pos.shape[0]
            row = i if bb else slice(None)
            for (k, v), (ck, cv) in zip(ctx_in, ctx_kv):
                k[i:i + 1, :n].copy_(ck)
                v[i:i + 1, :n].copy_(cv)
            pos_in[row][:n].copy_(ctx_pos)
            pos_in[row][n:].fill_(EMPTY_POSITION)
            ids_in[row].copy_(ids)
            start_in[i] = start
        if bb:   # padding rows: empty windows, so nothing a real row reads
            pos_in[len(blocks):].fill_(EMPTY_POSITION)

    def _call(self, bb: int):
        if self.graph.direct:
            return self._forward(bb)
        out = run_graph(self.captured.get(bb), partial(self._forward, bb))
        if bb not in self.captured:
            return out
        return tree_map(lambda t: t.clone(), out)

    def _forward(self, bb: int):
        ids, start, ctx_kv, ctx_pos = self.inputs[bb]
        return self.graph.call(bb, self.drafter, self.embed, self.lm_head_weight, ids, start,
                               ctx_kv, ctx_pos)

    def what(self, bb: int) -> str:
        """What a key's graph computes, for progress lines: e.g. "2 x 16-row block"."""
        rows = f"{bb} x " if bb else ""
        return f"{rows}{self.block_size}-row block"

    def warm_up(self, progress: Callable[[str], None] | None = None,
                lazy: bool = False) -> CompileReport:
        """Compile (or read) each key's graph and run it once; `lazy` (on a CPU): a group
        of several requests' blocks only afterwards (`compile_later`), drafted eagerly
        until its graph is ready."""
        keys = self.keys
        if lazy and not self.cuda_graphs:
            keys = tuple(bb for bb in self.keys if bb <= 1)
        later = tuple(bb for bb in self.keys if bb not in keys)
        if progress is not None and later:
            progress(f"the {self.part}'s {len(later)} blocks of several requests compile "
                     "in the background")

        def every_key() -> None:
            for i, bb in enumerate(keys):
                t0 = time.perf_counter()
                forward = partial(self._forward, bb)
                if self.cuda_graphs:
                    self.captured[bb] = CapturedGraph(forward)
                elif self.graph.direct:   # a block twice: through its entry, then directly
                    check_direct([self.graph], self.part, forward(), forward)
                else:
                    forward()
                self.ready.add(bb)
                if progress is not None:
                    progress(ProgressLine(
                        f"compiled the {self.part}'s {self.what(bb)} "
                        f"({time.perf_counter() - t0:.1f} s)", "compiling", i + 1, len(keys)))

        report = warm_up_report(every_key, [self.graph], self.part, self.cuda_graphs,
                                (self.block_size,), 1, self.cache_dir,
                                tuple(b or 1 for b in self.keys))
        self.report = replace(report, captured=len(self.captured), deferred=len(later))
        self.later = later
        return self.report

    def compiled_all(self) -> bool:
        return set(self.keys) <= self.ready

    def compile_later(self) -> None:
        """The groups warm-up deferred, compiled (or read) without running (the engine's
        background thread); each serves from its next proposal on."""
        for bb in compile_in_turn(self.part, self.later, self._prepare, self.what):
            self.ready.add(bb)
        self.later = ()

    def _prepare(self, bb: int) -> None:
        ids, start, ctx_kv, ctx_pos = self.inputs[bb]
        self.graph.prepare(self.drafter, self.embed, self.lm_head_weight, ids, start, ctx_kv,
                           ctx_pos)


# A context row at this position follows every block, so the drafter's mask hides it.
EMPTY_POSITION = 1 << 40


def _dflash_drafts(drafter: nn.Module, embed: nn.Embedding, lm_head_weight: torch.Tensor,
                   ids: torch.Tensor, start: torch.Tensor, ctx_kv, ctx_pos: torch.Tensor):
    hidden = drafter(embed(ids)[None], start, ctx_kv, ctx_pos)          # [1, B, H]
    return drafter.draft_output(hidden[0, 1:], lm_head_weight, ids[:1])


def _dflash_drafts_rows(drafter: nn.Module, embed: nn.Embedding, lm_head_weight: torch.Tensor,
                        ids: torch.Tensor, start: torch.Tensor, ctx_kv, ctx_pos: torch.Tensor):
    """`_dflash_drafts` of bb blocks ids [bb, block] at starts [bb] over windows ctx_pos
    [bb, W]: a tuple of each block's draft output."""
    hidden = drafter(embed(ids), start, ctx_kv, ctx_pos)               # [bb, B, H]
    return tuple(drafter.draft_output(hidden[i, 1:], lm_head_weight, ids[i, :1])
                 for i in range(ids.shape[0]))
