"""One request's decode as steps: prefill, then cycles of draft -> verify -> accept -> commit,
with the stop rules, streaming, cancellation and deadline between cycles.

`Decoding` is driven from outside: `prefill()` (a generator: one prefill chunk per step),
then, until `done`, either `step()` (one cycle on its own state: `generate`) or `ask()`
and `draft_from()`, a verify forward the caller runs over several requests' blocks at once,
and `finish()` (`batch.py`). Both paths draft, decide and commit through the same functions
(`speculative.py`), so a request's tokens do not depend on how it was driven. Tokens are
published in order through `on_token(ids, delta_text)` and a stop (EOS, stop string,
max_new_tokens, cancel, deadline) publishes exactly the tokens up to it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field

import torch

from .engine import Engine
from .inputs.chat import check_reasoning_effort
from .inputs.mrope import PromptImages
from .loop.acceptance import StrictAcceptance
from .loop.constraint import Constraint, masked
from .loop.proposer import DraftAsk, Proposer
from .loop.sampling import Sampling
from .loop.speculative import (
    Block,
    Cycle,
    NonFiniteLogits,
    ask_drafts,
    block_of,
    commit_cycle,
    cycle_from_row,
    decide,
    run_cycle,
)
from .methods import METHODS
from .prefill import prefill_prompt
from .state.cache import InferenceState
from .telemetry import GenerationStats, PhaseTimer, now_ms

FINISH_REASONS = ("eos", "length", "stop", "cancelled", "deadline")
TokenCallback = Callable[[list[int], str], None]


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int = 256
    ignore_eos: bool = False
    stop_strings: tuple[str, ...] = ()
    deadline_s: float | None = None     # wall-clock budget for the whole request
    speculative: bool = True            # use the engine's proposer when it has one
    method: str | None = None           # auto | dflash | mtp | none; None = the engine's
    relaxed_thinking: bool = False      # relaxed acceptance inside <think> ... </think>
    relaxed_topk: int = 3
    relaxed_delta: float = 1.0
    enable_thinking: bool | None = None  # passed to the chat template for message prompts
    profile_phases: bool = False        # exact per-phase split on CUDA (adds syncs)
    sampling: Sampling | None = None    # per-phase sampling and seed; None or 0 = greedy
    # passed to the chat template for message prompts (one that takes it: Qwen3.8's)
    reasoning_effort: str | None = None
    # tool definitions (OpenAI's function shape) the chat template renders for message prompts
    tools: tuple[dict, ...] = ()

    def __post_init__(self) -> None:
        check_reasoning_effort(self.reasoning_effort)
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive integer, "
                             f"got {self.max_new_tokens!r}")
        if self.deadline_s is not None and self.deadline_s <= 0:
            raise ValueError(f"deadline_s must be positive, got {self.deadline_s!r}")
        if any(not s for s in self.stop_strings):
            raise ValueError("stop_strings must not contain an empty string")
        if self.method is not None and self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.relaxed_topk < 1:
            raise ValueError(f"relaxed_topk must be >= 1, got {self.relaxed_topk!r}")
        if self.relaxed_delta < 0:
            raise ValueError(f"relaxed_delta must be >= 0, got {self.relaxed_delta!r}")
        if self.relaxed_thinking and self.sampled:
            raise ValueError("relaxed thinking acceptance is defined for greedy decoding only: "
                             "turn it off to sample, or set both phases' temperature to 0")

    @property
    def sampled(self) -> bool:
        return self.sampling is not None and not self.sampling.greedy


class CancelToken:
    """Set from any thread; the loop checks it between decode steps."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def cancel(self) -> None:
        self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: GenerationStats = field(default_factory=GenerationStats)


def decode_text(tokenizer, ids: list[int]) -> str:
    return "" if tokenizer is None else tokenizer.decode(ids, skip_special_tokens=True)


class TextStream:
    """Incremental detokenizer over a growing token list: returns only the new text, holding
    back a trailing partial character until the final call."""

    def __init__(self, tokenizer, ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids = ids              # the caller's list; it appends, this reads
        self.emitted = ""

    def delta(self, final: bool = False) -> str:
        text = decode_text(self.tokenizer, self.ids)
        if not final:
            text = text.rstrip("\ufffd")  # may be a multi-byte character cut short
        delta, self.emitted = text[len(self.emitted):], text
        return delta


class StopRules:
    """Finds where, inside newly committed tokens, generation must stop."""

    def __init__(self, settings: GenerationSettings, eos_ids: Sequence[int], tokenizer):
        self.settings = settings
        self.eos = frozenset(() if settings.ignore_eos else eos_ids)
        self.tokenizer = tokenizer

    def first_stop(self, published: list[int], new: list[int]) -> tuple[int, str | None]:
        """(how many of `new` to publish, finish reason or None to go on)."""
        room = self.settings.max_new_tokens - len(published)
        for i, tok in enumerate(new[:room]):
            if tok in self.eos:
                return i + 1, "eos"
        keep = min(len(new), room)
        if self.settings.stop_strings and self.tokenizer is not None:
            hit = self._stop_string(published, new[:keep])
            if hit is not None:
                return hit, "stop"
        return keep, ("length" if keep == room else None)

    def _stop_string(self, published: list[int], new: list[int]) -> int | None:
        decode = self.tokenizer.decode
        if not any(s in decode(published + new) for s in self.settings.stop_strings):
            return None
        for i in range(len(new)):  # the earliest token that completes a stop string
            text = decode(published + new[:i + 1])
            if any(s in text for s in self.settings.stop_strings):
                return i + 1
        return None


def _interrupted(cancel: CancelToken | None, deadline: float | None) -> str | None:
    if cancel is not None and cancel.cancelled:
        return "cancelled"
    if deadline is not None and time.monotonic() > deadline:
        return "deadline"
    return None


class Decoding:
    """One request's decode (its arguments checked and resolved by `generate.start`)."""

    def __init__(self, engine: Engine, state: InferenceState, ids: list[int],
                 settings: GenerationSettings, on_token: TokenCallback | None,
                 cancel: CancelToken | None, proposer: Proposer | None, policy,
                 constraint: Constraint | None, prefix: Sequence[int] | None, t0: float,
                 deadline: float | None, images: PromptImages | None = None):
        self.engine, self.state, self.ids, self.settings = engine, state, ids, settings
        self.images = images            # a vision-language target's images in the prompt
        self.on_token, self.cancel = on_token, cancel
        self.proposer, self.policy = proposer, policy
        self.constraint, self.prefix = constraint, prefix
        self.t0, self.deadline = t0, deadline          # now_ms(); time.monotonic() or None
        self.stats = GenerationStats(prompt_tokens=len(ids),
                                     moe_layers=len(engine.model.moe_blocks),
                                     compiled=engine.compile_report is not None,
                                     seed=getattr(policy, "seed", None),
                                     traffic=engine.traffic)
        self.timer = PhaseTimer(sync=settings.profile_phases)
        self.rules = StopRules(settings, engine.eos_ids(), engine.tokenizer)
        self.published: list[int] = []
        # Decoding the text so far every cycle is only worth it for a listener.
        self.stream = (TextStream(engine.tokenizer, self.published) if on_token is not None
                       else None)
        self.cycle: Cycle | None = None
        self.block: Block | None = None
        self.result: GenerationResult | None = None
        self.t_first = 0.0
        self._room = 0              # the block's room (drafts and forced tokens), from `ask`

    @property
    def done(self) -> bool:
        return self.result is not None

    @property
    def tap_ids(self) -> tuple[int, ...]:
        return self.proposer.tap_ids if self.proposer is not None else ()

    def prefill(self) -> Generator[None, None, None]:
        """Prefill (a step per chunk), then the first token, published."""
        self.state.reset()
        logits, taps = yield from prefill_prompt(self.engine, self.state, self.ids,
                                                 self.prefix, self.proposer, self.stats,
                                                 self.images)
        if self.proposer is not None:
            self.proposer.begin(self.ids, taps)
        self.stats.prefill_ms = now_ms() - self.t0
        bitmask = None
        if self.constraint is not None:
            with self.timer.phase("grammar"):
                bitmask = self.constraint.masks([])
        _, picks = self.policy.decide(logits.new_zeros(0, dtype=torch.long),
                                      masked(logits[None], bitmask), len(self.ids))
        first, finite = torch.stack((picks[0], torch.isfinite(logits).all().long())).tolist()
        if not finite:
            raise NonFiniteLogits(len(self.ids) - 1)
        new = [first]
        self.policy.observe(new)
        if self.constraint is not None:
            with self.timer.phase("grammar"):
                self.constraint.commit(new)
        if self.proposer is not None:
            self.proposer.published(new)
        self.stats.ttft_ms = now_ms() - self.t0
        self.t_first = now_ms()
        self._absorb(new)

    def _budget(self, cap: int | None = None) -> tuple[int, int]:
        """(drafts to ask the proposer for, at most `cap`; room for drafts and forced
        tokens)."""
        remaining = self.settings.max_new_tokens - len(self.published)
        drafts = 0 if self.proposer is None else min(self.proposer.block_size - 1,
                                                     remaining - 1)
        if cap is not None:
            drafts = min(drafts, cap)
        return drafts, min(self.engine.config.max_block - 1, remaining - 1)

    def step(self) -> None:
        """One cycle on this request's own state."""
        drafts, room = self._budget()
        self._after(run_cycle(self.engine.model, self.state, self.published[-1],
                              self.proposer, self.policy, drafts, self.timer,
                              self.constraint, room))

    def ask(self, cap: int | None = None) -> torch.Tensor | DraftAsk:
        """Step 1's proposal, at most `cap` drafts: drafts, or a DFlash draft to make
        together with other requests' (`draft_together`), then `draft_from`."""
        drafts, self._room = self._budget(cap)
        with self.timer.phase("draft"):
            return ask_drafts(self.state.device, self.published[-1], self.state.length,
                              self.proposer, drafts)

    def draft_from(self, drafts: torch.Tensor) -> Block:
        """Step 1's block from the drafts `ask` led to."""
        self.block = block_of(self.state.length, self.published[-1], drafts, self.timer,
                              self.constraint, self._room)
        return self.block

    def shorten(self, rows: int) -> Block:
        """The drafted block cut to its first `rows` rows (a batch verifying at fewer rows:
        batch.py); the drafts cut off are as if rejected, so the tokens do not change."""
        block = self.block
        if block.rows.shape[0] <= rows:
            return block
        n = rows - 1
        if self.constraint is not None:
            self.constraint.shorten(n)
        self.block = Block(block.start, block.anchor, block.rows[:rows], block.drafts[:n],
                           None if block.listed is None else block.listed[:n],
                           min(block.proposed, n))
        return self.block

    def finish(self, raw: torch.Tensor, finite: torch.Tensor | None,
               taps: torch.Tensor | None, experts: torch.Tensor | None = None) -> None:
        """Steps 3-4 of the drafted block over its rows of the verify (`decide`); experts:
        the distinct experts its rows chose, summed over sparse layers (MoE targets)."""
        self._after(decide(self.block, raw, finite, taps, self.proposer, self.policy,
                           self.timer, self.constraint, experts))

    @property
    def decides_strictly(self) -> bool:
        """Whether its drafts are accepted greedily and strictly (a batch decides those of
        all such requests together: `decide_strict_together`)."""
        return type(self.policy) is StrictAcceptance

    def finish_cycle(self, row: list[int] | BaseException, taps: torch.Tensor | None,
                     has_experts: bool = False) -> None:
        """`finish` of the drafted block from its row of `decide_strict_together` (or
        the error that decided it)."""
        if isinstance(row, BaseException):
            raise row
        self._after(cycle_from_row(self.block, row, taps, self.proposer, has_experts))

    def _after(self, cycle: Cycle) -> None:
        self.cycle, self.block = cycle, None
        self.stats.record_cycle(cycle.drafted, cycle.accepted, cycle.method, cycle.experts)
        self.stats.record_traffic(cycle.drafted + 1, cycle.start, cycle.accepted + 1)
        self._absorb(cycle.tokens)

    def _emit(self, ids: list[int], final: bool) -> None:
        if self.stream is None:
            return
        delta = self.stream.delta(final)
        if ids or delta:
            self.on_token(ids, delta)

    def _absorb(self, new: list[int]) -> None:
        """Publish what the stop rules keep of `new`, commit it, and stop where a rule, a
        cancel or the deadline says."""
        keep, reason = self.rules.first_stop(self.published, new)
        self.published.extend(new[:keep])
        if self.cycle is not None:
            commit_cycle(self.state, self.cycle, keep, self.proposer, self.policy,
                         self.timer, self.constraint)
        self._emit(new[:keep], final=reason is not None)
        if reason is None:  # checked after the callback, before the next forward
            reason = _interrupted(self.cancel, self.deadline)
            if reason is not None:
                self._emit([], final=True)
        if reason is not None:
            self._end(reason)

    def _end(self, reason: str) -> None:
        stats, published = self.stats, self.published
        stats.new_tokens = len(published)
        stats.decode_ms = now_ms() - self.t_first
        stats.total_ms = now_ms() - self.t0
        stats.phase_ms = dict(self.timer.ms)
        if self.constraint is not None:
            stats.forced_tokens = self.constraint.stats.forced
            stats.grammar_cut_drafts = self.constraint.stats.cut
            stats.thinking_budget_hit = self.constraint.stats.think_closed
        self.result = GenerationResult(published, decode_text(self.engine.tokenizer,
                                                              published), reason, stats)

    def interrupted(self) -> bool:
        """Whether a request still prefilling (a batch's newcomer) was cancelled or ran out
        of time; it then ends with nothing published."""
        reason = _interrupted(self.cancel, self.deadline)
        if reason is not None and not self.done:
            self._end(reason)
        return reason is not None
