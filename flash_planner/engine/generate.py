"""Prefill, the decode loop, stop rules, streaming and cancellation.

`generate(engine, prompt, settings, on_token, cancel)` is the one call everything above the
engine uses. The prompt is token ids, a string, or chat messages (rendered with the
tokenizer's chat template). Tokens are published in order through `on_token(ids, delta_text)`
and a stop (EOS, stop string, max_new_tokens, cancel, deadline) publishes exactly the tokens
up to it. After a request the state holds the prompt and every published token except the
last, which has not been run through the model.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .engine import Engine
from .telemetry import GenerationStats, now_ms

FINISH_REASONS = ("eos", "length", "stop", "cancelled", "deadline")
TokenCallback = Callable[[list[int], str], None]


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int = 256
    ignore_eos: bool = False
    stop_strings: tuple[str, ...] = ()
    deadline_s: float | None = None     # wall-clock budget for the whole request

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive integer, "
                             f"got {self.max_new_tokens!r}")
        if self.deadline_s is not None and self.deadline_s <= 0:
            raise ValueError(f"deadline_s must be positive, got {self.deadline_s!r}")
        if any(not s for s in self.stop_strings):
            raise ValueError("stop_strings must not contain an empty string")


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
                  enable_thinking: bool | None = None) -> list[int]:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], dict)):
        tok = engine.tokenizer
        if tok is None:
            raise ValueError(f"{engine.config.model_path} ships no tokenizer: "
                             "pass token ids instead of text")
        if isinstance(prompt, str):
            return list(tok.encode(prompt, add_special_tokens=False))
        kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        rendered = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False,
                                           **kwargs)
        return list(tok.encode(rendered, add_special_tokens=False))
    ids = [int(i) for i in prompt]
    vocab = engine.model_config.vocab_size
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
    return ids


def prefill(engine: Engine, ids: list[int]) -> torch.Tensor:
    """Run the prompt in chunks of `prefill_chunk`; returns the last row's logits [vocab]."""
    chunk = engine.config.prefill_chunk
    tokens = torch.tensor([ids], dtype=torch.long, device=engine.device)
    logits = None
    for start in range(0, len(ids), chunk):
        piece = tokens[:, start:start + chunk]
        logits = engine.model(piece, engine.state).logits
        engine.state.commit(piece.shape[1])
    return logits[0, -1]


class TextStream:
    """Incremental detokenizer: returns only the new text, holding back partial characters."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = ""

    def text(self) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def push(self, ids: list[int], final: bool = False) -> str:
        """New text after `ids`; until `final`, a trailing incomplete character waits."""
        self.ids.extend(ids)
        text = self.text()
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


def generate(engine: Engine, prompt: Sequence[int] | str | list[dict],
             settings: GenerationSettings | None = None,
             on_token: TokenCallback | None = None,
             cancel: CancelToken | None = None) -> GenerationResult:
    """Greedy decoding of `prompt`; see the module docstring for the contract."""
    settings = settings or GenerationSettings()
    t0 = now_ms()
    deadline = None if settings.deadline_s is None else time.monotonic() + settings.deadline_s
    ids = encode_prompt(engine, prompt)
    engine.check_fits(len(ids), settings.max_new_tokens)
    stats = GenerationStats(prompt_tokens=len(ids))
    state, model = engine.state, engine.model
    state.reset()
    logits = prefill(engine, ids)
    stats.prefill_ms = now_ms() - t0
    rules = StopRules(settings, engine.eos_ids(), engine.tokenizer)
    stream = TextStream(engine.tokenizer)
    published: list[int] = []
    reason = None
    new = [int(logits.argmax())]
    stats.ttft_ms = now_ms() - t0
    t_first = now_ms()
    def emit(ids: list[int], final: bool) -> None:
        delta = stream.push(ids, final)
        if on_token is not None and (ids or delta):
            on_token(ids, delta)

    while True:
        keep, reason = rules.first_stop(published, new)
        published.extend(new[:keep])
        emit(new[:keep], final=reason is not None)
        if reason is None:  # checked after the callback, before the next forward
            reason = _interrupted(cancel, deadline)
            if reason is not None:
                emit([], final=True)
        if reason is not None:
            break
        step = torch.tensor([[published[-1]]], dtype=torch.long, device=engine.device)
        logits = model(step, state).logits
        state.commit(1)
        new = [int(logits[0, -1].argmax())]  # one host sync per token: the loop needs it
    stats.new_tokens = len(published)
    stats.decode_ms = now_ms() - t_first
    stats.total_ms = now_ms() - t0
    return GenerationResult(published, stream.text(), reason, stats)
