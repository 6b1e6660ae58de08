"""The one call everything above the engine uses: `generate(engine, prompt, settings,
on_token, cancel)`, and `start`, which checks and resolves a request into a `Decoding`
(decoding.py) for a caller that drives several at once (batch.py).

The prompt is token ids, a raw string (encoded as written, template markers and all), or
chat messages (`chat.encode_chat`: the template's markers are the only control tokens,
message text is plain text). After a request the state holds the prompt and every published
token except the last, which has not been run through the model; after a request that
raised, the state is empty.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from .decoding import (
    FINISH_REASONS,
    CancelToken,
    Decoding,
    GenerationResult,
    GenerationSettings,
    StopRules,
    TextStream,
    TokenCallback,
    decode_text,
)
from .engine import Engine
from .inputs.chat import encode_chat
from .inputs.images import ImagePatches
from .loop.acceptance import RelaxedThinking, StrictAcceptance, think_token_ids
from .loop.constraint import Constraint
from .loop.proposer import Proposer
from .loop.sampling import SampledAcceptance
from .prefill import prefill, prefill_chunks, run_to_end
from .state.cache import InferenceState
from .telemetry import now_ms

__all__ = ["FINISH_REASONS", "CancelToken", "Decoding", "GenerationResult",
           "GenerationSettings", "StopRules", "TextStream", "TokenCallback", "decode_text",
           "encode_prompt", "generate", "make_policy", "prefill", "prefill_chunks",
           "run_to_end", "start"]


def encode_prompt(engine: Engine, prompt: Sequence[int] | str | list[dict],
                  enable_thinking: bool | None = None,
                  reasoning_effort: str | None = None,
                  tools: Sequence[dict] = ()) -> list[int]:
    """The prompt's ids: ids as given (checked against the vocabulary), a string encoded as
    written, or chat messages through the chat template (`chat.encode_chat`) with
    `enable_thinking`, `reasoning_effort` (None: the template's default) and `tools` (the
    definitions the template renders; all three apply to chat messages only). A reasoning
    effort for a template that does not take it is a `chat.TemplateVariableError` (a
    ValueError)."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], dict)):
        tok = engine.tokenizer
        if tok is None:
            raise ValueError(f"{engine.config.model_path} ships no tokenizer: "
                             "pass token ids instead of text")
        if isinstance(prompt, str):
            return list(tok.encode(prompt, add_special_tokens=False))
        return encode_chat(tok, prompt, enable_thinking,
                           {"reasoning_effort": reasoning_effort}, list(tools) or None)
    ids = [int(i) for i in prompt]
    vocab = engine.model_config.vocab_size
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
    return ids


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


def start(engine: Engine, state: InferenceState, prompt: Sequence[int] | str | list[dict],
          settings: GenerationSettings | None = None,
          on_token: TokenCallback | None = None,
          cancel: CancelToken | None = None,
          proposer: Proposer | None = None,
          policy: StrictAcceptance | RelaxedThinking | None = None,
          constraint: Constraint | None = None,
          prefix: Sequence[int] | None = None,
          proposers: dict[str, Proposer] | None = None,
          arrived: float | None = None,
          images: Sequence[ImagePatches] = ()) -> Decoding:
    """A checked request, ready to prefill on `state`: the arguments of `generate`, plus the
    proposers to draw the request's method from (a batch slot's own; default the engine's)
    and when it arrived (time.monotonic(); its deadline counts from then)."""
    settings = settings or GenerationSettings()
    t0 = now_ms()
    arrived = time.monotonic() if arrived is None else arrived
    deadline = None if settings.deadline_s is None else arrived + settings.deadline_s
    ids = encode_prompt(engine, prompt, settings.enable_thinking, settings.reasoning_effort,
                        settings.tools)
    if images:
        ids = engine.require_vision().expand(ids, images)
    elif engine.vision is not None and engine.vision.image_token_id in ids:
        raise ValueError("the prompt holds image tokens (an image part or its token id) but "
                         "no image was given")
    engine.check_fits(len(ids), settings.max_new_tokens)
    if not settings.speculative:
        proposer = None
    elif proposer is None:
        proposer = engine.proposer_for(settings.method, proposers)
    if proposer is not None and proposer.block_size > engine.config.max_block:
        raise ValueError(f"block size {proposer.block_size} exceeds the engine's max_block "
                         f"{engine.config.max_block}")
    if constraint is not None and settings.ignore_eos:
        raise ValueError("ignore_eos cannot be combined with a grammar constraint: the "
                         "grammar ends the answer with EOS")
    prompt_images = None
    if images:
        hits, t_vision = engine.vision.hits, now_ms()
        prompt_images = engine.vision.prompt(ids, images)
        vision_ms = now_ms() - t_vision
    policy = policy or make_policy(engine, settings)
    policy.reset(ids)
    if constraint is not None:
        constraint.reset(ids)
    decoding = Decoding(engine, state, ids, settings, on_token, cancel, proposer, policy,
                        constraint, prefix, t0, deadline, prompt_images)
    if images:
        stats = decoding.stats
        stats.images, stats.image_tokens = len(images), int(prompt_images.rows.numel())
        stats.vision_ms, stats.image_cache_hits = vision_ms, engine.vision.hits - hits
    return decoding


def generate(engine: Engine, prompt: Sequence[int] | str | list[dict],
             settings: GenerationSettings | None = None,
             on_token: TokenCallback | None = None,
             cancel: CancelToken | None = None,
             proposer: Proposer | None = None,
             policy: StrictAcceptance | RelaxedThinking | None = None,
             constraint: Constraint | None = None,
             prefix: Sequence[int] | None = None,
             images: Sequence[ImagePatches] = ()) -> GenerationResult:
    """Greedy (or, with `settings.sampling`, sampled) decoding of `prompt`, speculative
    when a proposer is available, on the engine's own state.

    `proposer` overrides the engine's own (tests and benchmarks pass a replay proposer);
    `policy` overrides the acceptance policy the settings describe; `constraint` (a fresh
    one per request, e.g. `JsonSchemaGrammar.constraint()`) restricts the answer to a
    grammar; `prefix`, ids the prompt starts with (a system prompt), is prefilled apart and
    its state kept in the engine's prefix cache (`prefix.py`); `images` (a vision-language
    target's, `images.to_patches`), one per run of image tokens in the prompt, in order.
    """
    decoding = start(engine, engine.state, prompt, settings, on_token, cancel, proposer,
                     policy, constraint, prefix, images=images)
    return run_alone(decoding)


def run_alone(decoding: Decoding) -> GenerationResult:
    """Drive one request to its end on its own state."""
    proposer = decoding.proposer
    if proposer is not None:
        proposer.set_picker(getattr(decoding.policy, "pick", None))
    try:
        # one inference-mode scope for the whole request: the forwards inside skip entering
        # their own (~5 us each, a fair part of a small model's decode step on a CPU)
        with torch.inference_mode():
            run_to_end(decoding.prefill())
            while not decoding.done:
                decoding.step()
        return decoding.result
    except BaseException:
        # An exception mid-cycle (a fault, non-finite logits, an interrupt) can leave
        # uncommitted rows: clear the state now (the proposer is re-seeded by `begin`).
        decoding.state.reset()
        raise
    finally:
        if proposer is not None:
            proposer.set_picker(None)
