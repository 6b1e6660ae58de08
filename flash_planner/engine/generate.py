"""Prefill, the decode loop, stop rules, streaming and cancellation.

`generate(engine, prompt, settings, on_token, cancel)` is the one call everything above the
engine uses. The prompt is token ids, a raw string (encoded as written, template markers and
all), or chat messages (`chat.encode_chat`: the template's markers are the only control
tokens, message text is plain text). Tokens are published in order through
`on_token(ids, delta_text)` and a stop (EOS, stop string, max_new_tokens, cancel, deadline)
publishes exactly the tokens up to it. After a request the state holds the prompt and every
published token except the last, which has not been run through the model; after a request
that raised, the state is empty.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .acceptance import RelaxedThinking, StrictAcceptance, think_token_ids
from .chat import check_reasoning_effort, encode_chat
from .constraint import Constraint, masked
from .engine import Engine
from .methods import METHODS
from .prefix import take
from .proposer import Proposer
from .sampling import SampledAcceptance, Sampling
from .speculative import NonFiniteLogits, commit_cycle, run_cycle
from .telemetry import GenerationStats, PhaseTimer, now_ms

log = logging.getLogger(__name__)
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


def encode_prompt(engine: Engine, prompt: Sequence[int] | str | list[dict],
                  enable_thinking: bool | None = None,
                  reasoning_effort: str | None = None) -> list[int]:
    """The prompt's ids: ids as given (checked against the vocabulary), a string encoded as
    written, or chat messages through the chat template (`chat.encode_chat`) with
    `enable_thinking` and `reasoning_effort` (None: the template's default; both apply to
    chat messages only). A reasoning effort for a template that does not take it is a
    `chat.TemplateVariableError` (a ValueError)."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], dict)):
        tok = engine.tokenizer
        if tok is None:
            raise ValueError(f"{engine.config.model_path} ships no tokenizer: "
                             "pass token ids instead of text")
        if isinstance(prompt, str):
            return list(tok.encode(prompt, add_special_tokens=False))
        return encode_chat(tok, prompt, enable_thinking,
                           {"reasoning_effort": reasoning_effort})
    ids = [int(i) for i in prompt]
    vocab = engine.model_config.vocab_size
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
    return ids


def prefill(engine: Engine, ids: list[int], tap_ids: tuple[int, ...] = (), tail: int = 0
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the prompt in chunks of `prefill_chunk`.

    Returns the last row's logits [vocab] and, when tap_ids are given, the concatenated taps
    [1, m, n_taps*hidden] of the prompt's last m = min(tail, len(ids)) tokens.
    """
    chunk = engine.config.prefill_chunk
    tokens = torch.tensor([ids], dtype=torch.long, device=engine.device)
    tail_from = len(ids) - min(tail, len(ids))
    logits, kept = None, []
    for start in range(0, len(ids), chunk):
        piece = tokens[:, start:start + chunk]
        want = tap_ids if tap_ids and start + piece.shape[1] > tail_from else ()
        out = engine.model(piece, engine.state, taps=want)
        engine.state.commit(piece.shape[1])
        logits = out.logits
        if want:
            kept.append(torch.cat(out.taps, dim=-1)[:, max(0, tail_from - start):])
    taps = torch.cat(kept, dim=1) if kept else None
    return logits[0, -1], taps


def _split_taps(taps: torch.Tensor | None, layers: Sequence[int]) -> dict[int, torch.Tensor]:
    if taps is None or not layers:
        return {}
    return dict(zip(layers, taps.chunk(len(layers), dim=-1)))


def prefill_prompt(engine: Engine, ids: list[int], prefix: Sequence[int] | None,
                   proposer: Proposer | None, stats: GenerationStats
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`prefill`, with a declared prefix first: restored from the engine's prefix cache when
    it holds it, else prefilled (and kept). The suffix follows. A prompt that does not start
    with the prefix's ids (its tokenization merged across the join) is prefilled whole."""
    tap_ids = proposer.tap_ids if proposer is not None else ()
    tail = proposer.seed_rows if proposer is not None else 0
    n = len(prefix) if prefix else 0
    if n and (n >= len(ids) or list(ids[:n]) != list(prefix)):
        log.info("the prompt is not longer than its declared %d-token prefix or does not "
                 "start with it at a token boundary: prefilling it whole", n)
        n = 0
    if not n:
        return prefill(engine, ids, tap_ids, tail)
    stats.prefix_tokens = n
    rows = min(tail, len(ids)) - (len(ids) - n)          # seed rows the prefix must give
    cache = engine.prefix_cache
    snap = cache.get(prefix) if cache is not None else None
    if snap is not None and rows > 0 and any(
            t not in snap.taps or snap.taps[t].shape[1] < rows for t in tap_ids):
        snap = None        # a proposer the engine did not load taps other layers or rows
    stats.prefix_hit = snap is not None
    if snap is not None:
        t0 = now_ms()
        engine.state.load(snap.state)
        stats.prefix_restore_ms = now_ms() - t0
        prefix_taps, states = snap.taps, snap.proposer_states
    else:
        layers = tuple(sorted({*engine.seed_tap_ids, *tap_ids}))
        _, taps = prefill(engine, list(prefix), layers, max(engine.seed_rows, tail))
        prefix_taps = _split_taps(taps, layers)
        states = {}
        if cache is not None:
            for p in engine.proposers.values():
                states.update(p.prefix_state(prefix, prefix_taps))
            cache.put(take(engine.state, prefix, prefix_taps, states))
    stats.prefix_cache_bytes = cache.nbytes if cache is not None else 0
    if proposer is not None:
        proposer.use_prefix_state(states)
    logits, taps = prefill(engine, ids[n:], tap_ids, tail)
    if rows > 0 and tap_ids:
        head = torch.cat([prefix_taps[t][:, -rows:] for t in tap_ids], dim=-1)
        taps = head if taps is None else torch.cat((head, taps), dim=1)
    return logits, taps


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


def make_policy(engine: Engine, settings: GenerationSettings):
    if settings.sampled:
        return SampledAcceptance(settings.sampling, engine.model_config.vocab_size,
                                 engine.device, think_token_ids(engine.tokenizer))
    if not settings.relaxed_thinking:
        return StrictAcceptance()
    ids = think_token_ids(engine.tokenizer)
    if ids is None:
        raise ValueError("relaxed thinking needs <think> and </think> tokens in the tokenizer")
    return RelaxedThinking(*ids, settings.relaxed_topk, settings.relaxed_delta)


def generate(engine: Engine, prompt: Sequence[int] | str | list[dict],
             settings: GenerationSettings | None = None,
             on_token: TokenCallback | None = None,
             cancel: CancelToken | None = None,
             proposer: Proposer | None = None,
             policy: StrictAcceptance | RelaxedThinking | None = None,
             constraint: Constraint | None = None,
             prefix: Sequence[int] | None = None) -> GenerationResult:
    """Greedy (or, with `settings.sampling`, sampled) decoding of `prompt`, speculative
    when a proposer is available.

    `proposer` overrides the engine's own (tests and benchmarks pass a replay proposer);
    `policy` overrides the acceptance policy the settings describe; `constraint` (a fresh
    one per request, e.g. `JsonSchemaGrammar.constraint()`) restricts the answer to a
    grammar; `prefix`, ids the prompt starts with (a system prompt), is prefilled apart and
    its state kept in the engine's prefix cache (`prefix.py`).
    """
    settings = settings or GenerationSettings()
    t0 = now_ms()
    deadline = None if settings.deadline_s is None else time.monotonic() + settings.deadline_s
    ids = encode_prompt(engine, prompt, settings.enable_thinking, settings.reasoning_effort)
    engine.check_fits(len(ids), settings.max_new_tokens)
    if not settings.speculative:
        proposer = None
    elif proposer is None:
        proposer = engine.proposer_for(settings.method)
    if proposer is not None and proposer.block_size > engine.config.max_block:
        raise ValueError(f"block size {proposer.block_size} exceeds the engine's max_block "
                         f"{engine.config.max_block}")
    if constraint is not None and settings.ignore_eos:
        raise ValueError("ignore_eos cannot be combined with a grammar constraint: the "
                         "grammar ends the answer with EOS")
    policy = policy or make_policy(engine, settings)
    policy.reset(ids)
    if constraint is not None:
        constraint.reset(ids)
    if proposer is not None:
        proposer.set_picker(getattr(policy, "pick", None))
    try:
        # one inference-mode scope for the whole request: the forwards inside skip entering
        # their own (~5 us each, a fair part of a small model's decode step on a CPU)
        with torch.inference_mode():
            return _decode(engine, ids, settings, on_token, cancel, proposer, policy, t0,
                           deadline, constraint, prefix)
    except BaseException:
        # An exception mid-cycle (a fault, non-finite logits, an interrupt) can leave
        # uncommitted rows: clear the state now (the proposer is re-seeded by `begin`).
        engine.state.reset()
        raise
    finally:
        if proposer is not None:
            proposer.set_picker(None)


def _decode(engine: Engine, ids: list[int], settings: GenerationSettings,
            on_token: TokenCallback | None, cancel: CancelToken | None,
            proposer: Proposer | None, policy, t0: float, deadline: float | None,
            constraint: Constraint | None, prefix: Sequence[int] | None) -> GenerationResult:
    """Prefill and the decode loop of `generate` (arguments checked and resolved there)."""
    stats = GenerationStats(prompt_tokens=len(ids), moe_layers=len(engine.model.moe_blocks),
                            compiled=engine.compile_report is not None,
                            seed=getattr(policy, "seed", None))
    timer = PhaseTimer(sync=settings.profile_phases)
    engine.state.reset()
    logits, taps = prefill_prompt(engine, ids, prefix, proposer, stats)
    if proposer is not None:
        proposer.begin(ids, taps)
    stats.prefill_ms = now_ms() - t0
    rules = StopRules(settings, engine.eos_ids(), engine.tokenizer)
    published: list[int] = []
    # Decoding the text so far every cycle is only worth it for a listener.
    stream = TextStream(engine.tokenizer, published) if on_token is not None else None
    bitmask = None
    if constraint is not None:
        with timer.phase("grammar"):
            bitmask = constraint.masks([])
    _, picks = policy.decide(logits.new_zeros(0, dtype=torch.long),
                             masked(logits[None], bitmask), len(ids))
    first, finite = torch.stack((picks[0], torch.isfinite(logits).all().long())).tolist()
    if not finite:
        raise NonFiniteLogits(len(ids) - 1)
    new = [first]
    policy.observe(new)
    if constraint is not None:
        with timer.phase("grammar"):
            constraint.commit(new)
    if proposer is not None:
        proposer.published(new)
    stats.ttft_ms = now_ms() - t0
    t_first = now_ms()
    cycle = None

    def emit(ids: list[int], final: bool) -> None:
        if stream is None:
            return
        delta = stream.delta(final)
        if ids or delta:
            on_token(ids, delta)

    while True:
        keep, reason = rules.first_stop(published, new)
        published.extend(new[:keep])
        if cycle is not None:
            commit_cycle(engine.state, cycle, keep, proposer, policy, timer, constraint)
        emit(new[:keep], final=reason is not None)
        if reason is None:  # checked after the callback, before the next forward
            reason = _interrupted(cancel, deadline)
            if reason is not None:
                emit([], final=True)
        if reason is not None:
            break
        remaining = settings.max_new_tokens - len(published)
        drafts = 0 if proposer is None else min(proposer.block_size - 1, remaining - 1)
        room = min(engine.config.max_block - 1, remaining - 1)   # drafts + forced tokens
        cycle = run_cycle(engine.model, engine.state, published[-1], proposer, policy,
                          drafts, timer, constraint, room)
        stats.record_cycle(cycle.drafted, cycle.accepted, cycle.method, cycle.experts)
        new = cycle.tokens
    stats.new_tokens = len(published)
    stats.decode_ms = now_ms() - t_first
    stats.total_ms = now_ms() - t0
    stats.phase_ms = dict(timer.ms)
    if constraint is not None:
        stats.forced_tokens = constraint.stats.forced
        stats.grammar_cut_drafts = constraint.stats.cut
        stats.thinking_budget_hit = constraint.stats.think_closed
    return GenerationResult(published, decode_text(engine.tokenizer, published), reason, stats)
