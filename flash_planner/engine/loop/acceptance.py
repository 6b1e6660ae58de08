"""Acceptance policies: how many drafts of a verified block to commit.

Both policies read drafts d [k] and the verify logits [k+1, V] (row i predicts the token
after row i's input, so draft d_i is judged by row i-1) and return the accepted count n as a
device tensor; the loop's one host copy per cycle reads it together with the tokens. The
committed tokens are d_1..d_n followed by the bonus token argmax(row n).

Both decide a block with `decide(drafts, logits, position) -> (n, picks)`: the count (None
for a block without drafts) and, per row, the token published after n accepted drafts
(`picks[n]`; here the row's argmax; `position` is the first row's token position, which
sampling's noise depends on). The sampled requests' policy (`sampling.SampledAcceptance`)
has the same `decide`.

- `StrictAcceptance`: d_i accepted iff it equals argmax(row i-1) and every earlier draft was
  accepted. Greedy speculative decoding with it is lossless.
- `RelaxedThinking`: inside `<think> ... </think>`, d_i is also accepted when fewer than k
  logits of row i-1 beat its own (it is in the top-k) and it is within `delta` logits of the
  top-1 (a raw-logit margin, the same as a
  log-prob margin). A draft equal to `</think>` and everything after the thinking block is
  judged strictly, so the answer is verified exactly. The think state starts from the prompt
  (the last think marker in it) and toggles on committed markers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...kernels import dispatch
from ...kernels.accept.reference import accepted_prefix


def _accepted(drafts: torch.Tensor, logits: torch.Tensor, relaxed: torch.Tensor, topk: int,
              delta: float) -> torch.Tensor:
    ok = dispatch.accept_rows(drafts[None], logits[None], relaxed[None], topk, delta)
    return accepted_prefix(ok[0])


class ArgmaxPicks:
    """`decide` for the greedy policies: their accepted count (None without drafts: nothing
    to accept, nothing to compute on a decode step), then each row's argmax."""

    def decide(self, drafts: torch.Tensor, logits: torch.Tensor, position: int = 0
               ) -> tuple[torch.Tensor | None, torch.Tensor]:
        n = self.accept(drafts, logits) if drafts.numel() else None
        return n, logits.argmax(dim=-1)


class StrictAcceptance(ArgmaxPicks):
    relaxed = False

    def reset(self, prompt_ids: Sequence[int]) -> None:
        pass

    def accept(self, drafts: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return _accepted(drafts, logits, torch.zeros_like(drafts, dtype=torch.bool), 1, 0.0)

    @staticmethod
    def accept_together(drafts: torch.Tensor, logits: torch.Tensor, ks: torch.Tensor
                        ) -> torch.Tensor:
        """`accept` of several blocks at once: drafts [B, k] and logits [B, k+1, V] padded
        past each block's ks[b] drafts -> each one's accepted count [B]."""
        ok = dispatch.accept_rows(drafts, logits, torch.zeros_like(drafts, dtype=torch.bool),
                                  1, 0.0)
        return accepted_prefix(ok & (torch.arange(drafts.shape[1], device=ks.device)
                                     < ks[:, None]))

    def observe(self, tokens: Sequence[int]) -> None:
        pass


THINK_TOKENS = ("<think>", "</think>")


def think_token_ids(tokenizer) -> tuple[int, int] | None:
    """(<think>, </think>) ids of the tokenizer, or None when it has no such tokens."""
    if tokenizer is None:
        return None
    ids = [tokenizer.convert_tokens_to_ids(t) for t in THINK_TOKENS]
    if any(i is None or i == tokenizer.unk_token_id for i in ids):
        return None
    return ids[0], ids[1]


class ThinkTracker:
    """Whether the sequence is inside `<think> ... </think>`: from the prompt's last marker,
    then toggled by committed markers."""

    def __init__(self, think_open: int, think_close: int):
        self.open, self.close = think_open, think_close
        self.thinking = False

    def reset(self, prompt_ids: Sequence[int]) -> None:
        self.thinking = False
        self._track(prompt_ids)     # not `observe`: subclasses count committed tokens there

    def observe(self, tokens: Sequence[int]) -> None:
        self._track(tokens)

    def _track(self, tokens: Sequence[int]) -> None:
        for tok in tokens:
            if tok == self.open:
                self.thinking = True
            elif tok == self.close:
                self.thinking = False

    def thinking_before(self, drafts: torch.Tensor) -> torch.Tensor:
        """[k] bool: whether thinking is active when draft i is judged (after d_1..d_{i-1})."""
        k = drafts.shape[0]
        is_open, is_close = drafts == self.open, drafts == self.close
        idx = torch.arange(k, device=drafts.device)
        last = torch.where(is_open | is_close, idx, -1).cummax(dim=0).values
        last = torch.cat((last.new_full((1,), -1), last[:-1]))         # events strictly before
        from_event = is_open[last.clamp(min=0)]
        return torch.where(last >= 0, from_event, torch.full_like(from_event, self.thinking))


class RelaxedThinking(ThinkTracker, ArgmaxPicks):
    relaxed = True

    def __init__(self, think_open: int, think_close: int, topk: int = 3, delta: float = 1.0):
        if topk < 1:
            raise ValueError(f"relaxed top-k must be >= 1, got {topk}")
        if delta < 0:
            raise ValueError(f"relaxed delta must be >= 0, got {delta}")
        super().__init__(think_open, think_close)
        self.topk, self.delta = topk, delta

    def accept(self, drafts: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        use_relaxed = self.thinking_before(drafts) & (drafts != self.close)
        return _accepted(drafts, logits, use_relaxed, self.topk, self.delta)
