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

from .cache import InferenceState, StateCopy
from .models.inference import inference
from .models.mtp import MTPHead
from .models.target import TargetModel
from .proposer import Proposer


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
        self.tap_ids = (target.cfg.num_layers - 1,)   # the last layer, after the final norm
        self.block_size = steps + 1
        self.seed_rows = state.capacity               # every prompt row enters the cache
        # Normed h of committed rows not in the cache, one chunk per commit (the prompt's
        # last row a chunk of its own), and the token at each of those rows.
        self.pending_hidden: list[torch.Tensor] = []
        self.pending_tokens: list[int] = []
        self._prefix: HeadPrefix | None = None     # set by use_prefix_state for one begin

    def fork(self) -> MTPProposer:
        """The same head with a cache of its own (a compiled head is bound to the first)."""
        s = self.state
        state = InferenceState(self.head.cfg, capacity=s.capacity, max_steps=s.max_steps,
                               kv_dtype=s.kv.k.dtype, compute_dtype=s.kv.compute_dtype,
                               device=s.device)
        clone = copy.copy(self)
        clone.state, clone.pending_hidden, clone.pending_tokens = state, [], []
        clone._prefix = None
        return clone

    @inference
    def prefix_state(self, prefix_ids: Sequence[int], taps: dict[int, torch.Tensor]
                     ) -> dict[str, object]:
        hidden = taps.get(self.tap_ids[0])
        n = len(prefix_ids) - 1
        if hidden is None or hidden.shape[1] != len(prefix_ids) or n < 1:
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
        hidden = torch.cat(self.pending_hidden, dim=1)                 # [1, start-P, H]
        if hidden.shape[1] != start - self.state.length:
            raise RuntimeError(f"MTP head holds {self.state.length} positions and "
                               f"{hidden.shape[1]} pending rows, anchor at {start}")
        # Each pending row's next token: the following row's token, the anchor for the last.
        tokens = torch.cat((torch.tensor(self.pending_tokens[1:], dtype=torch.long,
                                         device=anchor.device), anchor))
        # Rows before the last chunk (the prompt, or cycles another proposer drafted) are a
        # catch-up; the last chunk's rows are this cycle's first head forward.
        split = hidden.shape[1] - self.pending_hidden[-1].shape[1]
        t0 = time.perf_counter()
        self._commit_rows(tokens[:split], hidden[:, :split])
        self.catchup_ms = (time.perf_counter() - t0) * 1000.0
        out = self.head(self.embed(tokens[split:])[None], hidden[:, split:], self.state)
        self.state.commit(out.shape[1])
        self.pending_hidden, self.pending_tokens = [], []
        out = out[:, -1:]
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
        return self.pick(out[0] @ self.lm_head_weight.T, position)     # [1]

    @inference
    def commit(self, tokens: Sequence[int], taps: torch.Tensor | None, start: int) -> None:
        if taps is None:
            raise ValueError("MTPProposer.commit needs the committed rows' taps")
        n = len(tokens)
        self.pending_hidden.append(taps[:, :n])
        self.pending_tokens.extend(tokens)
