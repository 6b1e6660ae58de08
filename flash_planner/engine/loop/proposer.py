"""Draft proposers: what the speculative loop asks for candidate tokens.

The loop is method-agnostic: a proposer says which target layers it needs tapped, is seeded
at prefill, proposes `num` tokens after the anchor, and is told which rows were committed.
`DFlashProposer` runs the block-diffusion drafter over its per-token context window;
`ReplayProposer` replays a known continuation with injected errors (tests, and the
loop-overhead benchmark at a fixed acceptance length). The checkpoint's own MTP head is
`mtp_proposer.MTPProposer`; `auto_proposer.AutoProposer` routes each cycle to one of several.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..models.drafters.dflash import DFlashDrafter
from ..models.drafters.selector import walk
from ..models.graphs.compiled_drafts import EMPTY_POSITION
from ..models.qwen.inference import inference
from .window import ContextWindow


class Proposer:
    name = ""                       # the method: dflash, mtp, auto, ...
    tap_ids: tuple[int, ...] = ()   # target layers whose outputs `begin`/`commit` receive
    block_size: int = 16            # verify rows per cycle: the anchor + block_size-1 drafts
    seed_rows: int = 0              # prompt-tail rows whose taps `begin` wants
    catchup_ms: float = 0.0         # the last propose's time on rows of cycles it did not
                                    # draft (auto's switching cost, kept out of its estimates)
    # How drafts are read off the proposer's logits [n, V] for positions position..+n-1:
    # None = argmax (greedy drafts); a sampled request sets its policy's `pick`, which
    # draws them with the noise verification will use (sampling.py), so drafts agree more;
    # its keyword `among` [n, C] takes logits over those token ids only (DFlash2's walk)
    picker: Callable[..., torch.Tensor] | None = None

    def set_picker(self, picker: Callable[..., torch.Tensor] | None) -> None:
        self.picker = picker

    def pick(self, logits: torch.Tensor, position: int) -> torch.Tensor:
        return logits.argmax(dim=-1) if self.picker is None else self.picker(logits, position)

    def begin(self, prompt_ids: Sequence[int], taps: torch.Tensor | None) -> None:
        """A new request; taps [1, m, n*hidden] of the prompt's last m tokens (or None)."""

    def propose(self, anchor: torch.Tensor, start: int, num: int) -> torch.Tensor:
        """Up to `num` drafts [num] (long, on the anchor's device) following the anchor
        [1] at position `start`."""
        raise NotImplementedError

    def ask(self, anchor: torch.Tensor, start: int, num: int) -> torch.Tensor | DraftAsk:
        """`propose`; or, from a proposer that drafts in one forward with other requests'
        (a batch: `draft_together`), what it would draft."""
        return self.propose(anchor, start, num)

    def together_key(self) -> object | None:
        """What proposers that can draft in one forward share (their asks go together);
        None: this one drafts alone."""
        return None

    @staticmethod
    def propose_together(asks: Sequence[DraftAsk]) -> list[torch.Tensor]:
        """The drafts of several asks of one `together_key`, in one forward per step."""
        raise NotImplementedError

    def commit(self, tokens: Sequence[int], taps: torch.Tensor | None, start: int) -> None:
        """Rows committed to the target, in order from position `start` (the anchor first);
        taps [1, len(tokens), n*hidden]."""

    def published(self, tokens: Sequence[int]) -> None:
        """Tokens just published (the prefill's first one, then each cycle's, the bonus
        token included): what the next cycle's anchor is, before it is committed."""

    def forget(self) -> None:
        """Drop what was measured so far (after a warm-up); `auto`'s routing estimates."""

    def fork(self) -> Proposer:
        """A proposer for another request running at the same time (a slot of a batch):
        the same weights, its own per-request state."""
        raise NotImplementedError(f"{type(self).__name__} cannot draft for batched requests")

    def prefix_state(self, prefix_ids: Sequence[int], taps: dict[int, torch.Tensor]
                     ) -> dict[str, object]:
        """State worth keeping in a prefix snapshot, by method, from the prefix's ids and its
        taps by layer (`prefix.py`); {} when there is none."""
        return {}

    def use_prefix_state(self, states: dict[str, object]) -> None:
        """The prefix snapshot's states, before the `begin` of a prompt that starts with
        that prefix."""

    @property
    def last_method(self) -> str:
        """The method that drafted the last proposal (differs from `name` for auto)."""
        return self.name


class DFlashProposer(Proposer):
    """The drafter's window takes committed rows when it next drafts: the rows of the last
    commit as part of the cycle, rows of cycles another proposer drafted (auto) before them
    as a catch-up (`catchup_ms`), at most a window's worth. A DFlash2 drafter's drafts are
    its candidate selector's walk; the method is dflash for both."""

    name = "dflash"

    def __init__(self, drafter: DFlashDrafter, embed: torch.nn.Embedding,
                 lm_head_weight: torch.Tensor, window: int = 128, seed_window: bool = True,
                 block_size: int | None = None):
        self.drafter = drafter
        self.embed = embed
        self.lm_head_weight = lm_head_weight
        self._window = ContextWindow(drafter, window)
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (taps, positions)
        self.catchup_ms = 0.0
        self.seed_rows = window if seed_window else 0
        self.tap_ids = drafter.cfg.tap_ids
        self.block_size = block_size or drafter.cfg.block_size
        if self.block_size < 2:
            raise ValueError(f"block size must be >= 2, got {self.block_size}")

    def fork(self) -> DFlashProposer:
        return DFlashProposer(self.drafter, self.embed, self.lm_head_weight,
                              self._window.capacity, self.seed_rows > 0, self.block_size)

    @property
    def window(self) -> ContextWindow:
        """The context window with every committed row (pending rows are added now)."""
        self._fold(len(self._pending))
        return self._window

    @inference
    def _fold(self, commits: int) -> None:
        """Add the oldest `commits` pending commits to the window, in commit order."""
        if commits <= 0:
            return
        done, self._pending = self._pending[:commits], self._pending[commits:]
        self._window.append(torch.cat([t for t, _ in done], dim=1),
                            torch.cat([p for _, p in done]))

    def begin(self, prompt_ids: Sequence[int], taps: torch.Tensor | None) -> None:
        self._window.clear()
        self._pending = []
        if taps is not None and taps.shape[1]:
            m = taps.shape[1]
            end = len(prompt_ids)
            self._window.append(taps, torch.arange(end - m, end, device=taps.device))

    def ask(self, anchor: torch.Tensor, start: int, num: int) -> DraftAsk:
        return DraftAsk(self, anchor, start, num)

    def together_key(self) -> object:
        return self.drafter

    @staticmethod
    def propose_together(asks: Sequence[DraftAsk]) -> list[torch.Tensor]:
        """One drafter forward for several requests: each block at its own start over its
        own window, the windows padded to the longest with rows at a position no block
        sees. Each request reads its drafts as it would alone (its own picker, its own
        DFlash2 walk)."""
        lead = asks[0].proposer
        drafter = lead.drafter
        prepared = [a.proposer._prepare(a.anchor) for a in asks]
        compiled = drafter.batch_static
        blocks = [(ids, a.start, kv, pos) for (ids, kv, pos), a in zip(prepared, asks)]
        if compiled is not None and compiled.accepts_rows(blocks):
            return [a.proposer._read(out, a.num, a.start)
                    for out, a in zip(compiled.propose_rows(blocks), asks)]
        width = max(pos.shape[0] for _, _, pos in prepared)
        ids = torch.stack([p[0] for p in prepared])                      # [K, block]
        device = ids.device
        positions = torch.full((len(asks), width), EMPTY_POSITION, device=device)
        layers = []
        for layer in range(drafter.cfg.num_layers):
            ks, vs = [], []
            for _, kv, _ in prepared:
                k, v = kv[layer]
                pad = width - k.shape[1]
                ks.append(torch.nn.functional.pad(k, (0, 0, 0, 0, 0, pad)))
                vs.append(torch.nn.functional.pad(v, (0, 0, 0, 0, 0, pad)))
            layers.append((torch.cat(ks), torch.cat(vs)))
        for i, (_, _, pos) in enumerate(prepared):
            positions[i, :pos.shape[0]] = pos
        starts = torch.tensor([a.start for a in asks], device=device)
        hidden = drafter(lead.embed(ids), starts, layers, positions)      # [K, block, H]
        return [a.proposer._read(drafter.draft_output(hidden[i, 1:a.num + 1],
                                                      a.proposer.lm_head_weight, a.anchor),
                                 a.num, a.start)
                for i, a in enumerate(asks)]

    def _prepare(self, anchor: torch.Tensor):
        """The block's ids [block_size] and the window's (per-layer (k, v), positions), the
        rows of earlier commits folded in first (a catch-up, `catchup_ms`)."""
        t0 = time.perf_counter()
        self._fold(len(self._pending) - 1)
        self.catchup_ms = (time.perf_counter() - t0) * 1000.0
        mask = self.drafter.cfg.mask_token_id
        # The drafter always sees the block it was trained on; shorter requests truncate.
        ids = torch.cat((anchor, anchor.new_full((self.block_size - 1,), mask)))
        return ids, *self.window.context(anchor.device, self.lm_head_weight.dtype)

    def _read(self, out, num: int, start: int) -> torch.Tensor:
        """The drafts from the drafter's output for this block (logits, or a selector's
        candidates and pair scores)."""
        if isinstance(out, torch.Tensor):
            return self.pick(out[:num], start + 1)
        return self._walk(out[0][:num], out[1][:num], start + 1)

    @inference
    def propose(self, anchor: torch.Tensor, start: int, num: int) -> torch.Tensor:
        ids, ctx_kv, ctx_pos = self._prepare(anchor)
        static = self.drafter.static
        if static is not None and static.accepts(ids, ctx_pos.shape[0]):
            out = static.propose(ids, start, ctx_kv, ctx_pos)
        else:
            hidden = self.drafter(self.embed(ids)[None], start, ctx_kv, ctx_pos)  # [1, B, H]
            out = self.drafter.draft_output(hidden[0, 1:num + 1], self.lm_head_weight, anchor)
        return self._read(out, num, start)

    def _walk(self, cand: torch.Tensor, scores: torch.Tensor, position: int) -> torch.Tensor:
        """The selector's path: greedy, or each step drawn by a sampled request's `pick`
        from the pair scores over that position's candidates (`among`: the draw over the
        vocabulary with every other token out)."""
        if self.picker is None:
            return walk(cand, scores)

        def choose(row: torch.Tensor, t: int) -> torch.Tensor:
            token = self.picker(row[None], position + t, among=cand[t][None])
            return (cand[t] == token).int().argmax()

        return walk(cand, scores, choose)

    def commit(self, tokens: Sequence[int], taps: torch.Tensor | None, start: int) -> None:
        if taps is None:
            raise ValueError("DFlashProposer.commit needs the committed rows' taps")
        n = len(tokens)
        self._pending.append((taps[:, :n], torch.arange(start, start + n, device=taps.device)))
        # a commit the newer ones already fill the window without is never needed
        while sum(t.shape[1] for t, _ in self._pending[1:]) >= self._window.capacity:
            self._pending.pop(0)


@dataclass
class DraftAsk:
    """A draft a batch makes in one forward with other requests' (`draft_together`)."""
    proposer: Proposer
    anchor: torch.Tensor          # [1]
    start: int
    num: int


def drafts_of(asked: torch.Tensor | DraftAsk) -> torch.Tensor:
    """What `Proposer.ask` answered, as drafts (a lone ask drafts now)."""
    if isinstance(asked, DraftAsk):
        return asked.proposer.propose(asked.anchor, asked.start, asked.num)
    return asked


@inference
def draft_together(asks: Sequence[DraftAsk]) -> list[torch.Tensor]:
    """The drafts of several requests' asks that share one `together_key` (a DFlash
    drafter, an MTP head's slots), from one forward per step."""
    if len(asks) == 1:
        return [drafts_of(asks[0])]
    key = asks[0].proposer.together_key()
    if key is None or any(a.proposer.together_key() is not key for a in asks):
        raise ValueError("draft_together: every ask must share one together_key")
    return asks[0].proposer.propose_together(asks)


class ReplayProposer(Proposer):
    """Proposes the true continuation with one wrong token per cycle at a chosen offset.

    continuation[j] is the reference token at position prompt_len + j. `error_at` picks the
    offset of the wrong draft in each cycle (>= num means none): by default uniformly at
    random over 0..num; a constant gives a fixed acceptance length; a sequence is used
    round-robin (e.g. range(block_size) walks every accepted length and rollback path).
    """

    name = "replay"

    def __init__(self, continuation: Sequence[int], vocab_size: int, block_size: int = 16,
                 error_at: int | Sequence[int] | None = None, seed: int = 0):
        self.continuation = list(continuation)
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.error_at = error_at
        self.rng = random.Random(seed)
        self.prompt_len = 0
        self.accept_lengths: list[int] = []   # the error offset chosen per cycle

    def begin(self, prompt_ids: Sequence[int], taps: torch.Tensor | None) -> None:
        self.prompt_len = len(prompt_ids)

    def fork(self) -> ReplayProposer:
        return ReplayProposer(self.continuation, self.vocab_size, self.block_size,
                              self.error_at)

    def propose(self, anchor: torch.Tensor, start: int, num: int) -> torch.Tensor:
        first = start + 1 - self.prompt_len    # continuation index of the first draft
        drafts = [self.continuation[j] if j < len(self.continuation) else 0
                  for j in range(first, first + num)]
        if self.error_at is None:
            err = self.rng.randint(0, num)
        elif isinstance(self.error_at, int):
            err = self.error_at
        else:
            err = self.error_at[len(self.accept_lengths) % len(self.error_at)]
        if err < num:
            drafts[err] = (drafts[err] + 1) % self.vocab_size
        self.accept_lengths.append(min(err, num))
        return torch.tensor(drafts, dtype=torch.long, device=anchor.device)
