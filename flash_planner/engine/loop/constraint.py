"""Grammar constraints inside the speculative loop.

A `TokenMatcher` is a grammar's parse state over token ids: it accepts a token (or says the
grammar forbids it), rolls back, fills the bitmask of the tokens allowed next, and names the
tokens the grammar forces next (jump-forward). `grammar.py` builds one with xgrammar; the
loop only sees this interface.

`Constraint` is one request's use of a matcher. The grammar covers the answer only: thinking
(`<think> ... </think>`) stays free but for two rules: it cannot end the output (a stop
token there would leave no answer), and from generated token `think_budget` on (if set) the
only token it allows is `</think>`, so the answer keeps the tokens reserved for it. Only
tokens after the last `</think>` (in the prompt or generated) go through the matcher; the
think markers themselves are never part of an answer. With no think marker in the prompt
the first token may open a thinking block or start the answer. Per cycle:

1. `block(drafts, room)`: the proposer's drafts the grammar allows (the block ends at the
   first forbidden one: no verify work is spent past it), then the tokens the grammar forces
   after them (jump-forward), up to `room` drafts in all. Forced tokens are drafts nobody
   had to propose: the verify forward checks them like any other draft, so jump-forward
   never changes the output.
2. `masks(block)`: for each verify row, the tokens allowed after the anchor and the drafts
   before it. Called after the verify forward is launched, so on CUDA the mask work
   overlaps the forward.
3. `commit(tokens)`: the published tokens advance the matcher.

With masked logits, strict acceptance compares each draft with the masked argmax of its
row, so constrained speculative greedy decoding publishes exactly the tokens that
constrained greedy decoding, one masked argmax per token, publishes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

START, THINK, ANSWER = "start", "think", "answer"


class TokenMatcher(Protocol):
    vocab_size: int

    def accept(self, token: int) -> bool:
        """Advance by `token`; False (and no change) when the grammar forbids it."""

    def rollback(self, count: int) -> None:
        """Undo the last `count` accepted tokens."""

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (int32 words, bit j of word w =
        token 32 w + j)."""

    def forced_tokens(self) -> list[int]:
        """Tokens of the longest text the grammar allows next and nothing else ([] if none)."""

    def terminated(self) -> bool:
        """Whether a stop token was accepted: nothing may follow."""


class GrammarViolation(RuntimeError):
    """A token the loop was about to publish is outside the grammar: a bug, never a model's
    choice (masked logits cannot choose it)."""


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 bitmask [rows, words] -> bool allowed [rows, vocab_size] (on its device)."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab_size]


def token_row(vocab_size: int, tokens: Sequence[int], allowed: bool) -> torch.Tensor:
    """An int32 bitmask row [words]: only `tokens` allowed, or all but them."""
    row = torch.full((mask_words(vocab_size),), 0 if allowed else -1, dtype=torch.int32)
    for token in tokens:
        word, bit = divmod(token, 32)
        value = int(row[word]) & 0xFFFFFFFF
        value = value | (1 << bit) if allowed else value & ~(1 << bit)
        row[word] = value - (1 << 32) if value >= 1 << 31 else value   # int32 wrap
    return row


def masked(logits: torch.Tensor, bitmask: torch.Tensor | None) -> torch.Tensor:
    """Logits [rows, vocab] with every token the int32 bitmask [rows, words] forbids at -inf
    (a new tensor). The bitmask, 1/32 of a bool mask, is what crosses to the device."""
    if bitmask is None:
        return logits
    allowed = unpack_bitmask(bitmask.to(logits.device, non_blocking=True), logits.shape[-1])
    return logits.masked_fill(~allowed, float("-inf"))


@dataclass
class ConstraintStats:
    forced: int = 0          # published tokens that came from jump-forward
    forced_drafted: int = 0  # jump-forward tokens put into verify blocks
    cut: int = 0             # proposer drafts dropped: the grammar forbids them or one before
    think_closed: bool = False   # the thinking budget ran out and </think> was forced


class Constraint:
    def __init__(self, matcher: TokenMatcher, think_ids: tuple[int, int] | None,
                 stop_ids: Sequence[int], think_budget: int | None = None):
        self.matcher = matcher
        self.think_budget = think_budget
        self.stop_ids = frozenset(stop_ids)
        self.vocab_size = matcher.vocab_size
        self.think_open, self.think_close = think_ids if think_ids is not None else (-1, -1)
        # a think marker in the answer would make it read as thinking: never part of one
        self.markers = frozenset(think_ids or ())
        # the mask rows that do not depend on the grammar's state, built once
        v = self.vocab_size
        self._thinking_row = token_row(v, self.stop_ids, allowed=False)
        self._closing_row = token_row(v, [self.think_close] if think_ids else [], allowed=True)
        self._no_markers = token_row(v, self.markers, allowed=False)
        self._open_row = token_row(v, [self.think_open] if think_ids else [], allowed=True)
        self.phase = ANSWER
        self.position = 0        # tokens published in this request
        self.stats = ConstraintStats()
        self._forced_from = 0    # index in the last block where forced tokens begin
        self._drafted = 0        # the last block's drafts, forced tokens included

    def reset(self, prompt_ids: Sequence[int]) -> None:
        """Start a request: the phase follows the prompt's last think marker."""
        self.phase = START if self.think_open >= 0 else ANSWER
        for tok in reversed(prompt_ids):
            if tok in (self.think_open, self.think_close):
                self.phase = THINK if tok == self.think_open else ANSWER
                break
        self.position = 0
        self.stats = ConstraintStats()

    def _next_phase(self, phase: str, token: int) -> str:
        if phase == THINK:
            return ANSWER if token == self.think_close else THINK
        if phase == START and token == self.think_open:
            return THINK
        return ANSWER

    def _closing(self, phase: str, position: int) -> bool:
        """Whether only </think> may come at `position` (the thinking budget is spent)."""
        return (phase == THINK and self.think_budget is not None
                and position >= self.think_budget)

    def _step(self, phase: str, token: int, position: int) -> tuple[bool, bool, str]:
        """(allowed, fed to the matcher, phase after) for `token` at generated `position`."""
        if self._closing(phase, position):
            return token == self.think_close, False, self._next_phase(phase, token)
        if phase == THINK or (phase == START and token == self.think_open):
            return token not in self.stop_ids, False, self._next_phase(phase, token)
        ok = (token not in self.markers and not self.matcher.terminated()
              and self.matcher.accept(token))
        return ok, ok, ANSWER

    def block(self, drafts: Sequence[int], room: int) -> list[int]:
        """The drafts to verify: the allowed prefix of `drafts`, then forced tokens, at most
        `room` in all. The matcher is left where it was."""
        phase, fed, out = self.phase, 0, []
        for tok in list(drafts)[:room]:
            ok, used, phase_after = self._step(phase, tok, self.position + len(out))
            if not ok:
                break
            out.append(tok)
            fed += used
            phase = phase_after
        self.stats.cut += min(len(drafts), room) - len(out)
        self._forced_from = len(out)
        if self._closing(phase, self.position + len(out)) and len(out) < room:
            out.append(self.think_close)
            phase = ANSWER
        if phase == ANSWER and not self.matcher.terminated():
            for tok in self.matcher.forced_tokens()[:room - len(out)]:
                if not self.matcher.accept(tok):
                    break
                out.append(tok)
                fed += 1
        self.stats.forced_drafted += len(out) - self._forced_from
        self._drafted = len(out)
        self.matcher.rollback(fed)
        return out

    def shorten(self, drafts: int) -> None:
        """The last block verifies only its first `drafts` (a batch cut it: batch.py)."""
        self.stats.forced_drafted -= max(0, self._drafted - max(drafts, self._forced_from))
        self._forced_from = min(self._forced_from, drafts)
        self._drafted = min(self._drafted, drafts)

    def masks(self, block: Sequence[int]) -> torch.Tensor:
        """int32 bitmask [len(block)+1, words] of the tokens allowed at each verify row (row i
        follows the anchor and block[:i]; `unpack_bitmask` reads it). The matcher is left
        where it was."""
        rows = len(block) + 1
        bitmask = torch.full((rows, mask_words(self.vocab_size)), -1, dtype=torch.int32)
        phase, fed = self.phase, 0
        for row in range(rows):
            if self._closing(phase, self.position + row):
                bitmask[row] = self._closing_row
            elif phase == THINK:
                bitmask[row] = self._thinking_row
            elif not self.matcher.terminated():   # after a stop token nothing is published
                self.matcher.fill_mask(bitmask, row)
                bitmask[row] &= self._no_markers
                if phase == START:                 # or open a thinking block
                    bitmask[row] |= self._open_row
            if row < len(block):
                _, used, phase = self._step(phase, block[row], self.position + row)
                fed += used
        self.matcher.rollback(fed)
        return bitmask

    def commit(self, tokens: Sequence[int], drafts_published: int = 0) -> None:
        """The published tokens (the last cycle's first `drafts_published` drafts, then
        possibly its bonus token) advance the matcher."""
        self.stats.forced += max(0, drafts_published - self._forced_from)
        for tok in tokens:
            closing = self._closing(self.phase, self.position)
            ok, _, self.phase = self._step(self.phase, tok, self.position)
            if not ok:
                raise GrammarViolation(f"token {tok} was published although the grammar "
                                       "forbids it")
            self.stats.think_closed |= closing
            self.position += 1
