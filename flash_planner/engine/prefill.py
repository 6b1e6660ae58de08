"""Prefill: the prompt run through the target in chunks, a declared prefix restored from the
engine's prefix cache (`prefix.py`) or prefilled and kept.

The chunked loops are generators that yield after each chunk, so a scheduler can run a
newcomer's prefill a chunk at a time between the running requests' cycles (`batch.py`);
`prefill` runs one to the end. Each works on the state it is given: the engine's own, or a
slot of a batch (`slots.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Generator, Sequence

import torch

from .engine import Engine
from .inputs.mrope import PromptImages
from .loop.proposer import Proposer
from .state.cache import InferenceState
from .state.prefix import take
from .telemetry import GenerationStats, now_ms

log = logging.getLogger(__name__)

Taps = torch.Tensor | None
Chunks = Generator[None, None, tuple[torch.Tensor, Taps]]


def prefill_chunks(engine: Engine, state: InferenceState, ids: list[int],
                   tap_ids: tuple[int, ...] = (), tail: int = 0,
                   images: PromptImages | None = None, offset: int = 0) -> Chunks:
    """`prefill` on `state`, yielding after each chunk; returns what `prefill` returns.
    images: the whole prompt's (`ids` are its rows from `offset` on); a chunk may end
    inside an image. The rows after the prompt then turn with the images' shift."""
    chunk = engine.config.prefill_chunk
    tokens = torch.tensor([ids], dtype=torch.long, device=engine.device)
    tail_from = len(ids) - min(tail, len(ids))
    logits, kept = None, []
    for start in range(0, len(ids), chunk):
        if start:
            yield
        piece = tokens[:, start:start + chunk]
        want = tap_ids if tap_ids and start + piece.shape[1] > tail_from else ()
        if images is None:
            out = engine.model(piece, state, taps=want)
        else:
            lo = offset + start
            image_rows, positions = images.block(lo, lo + piece.shape[1])
            out = engine.model(piece, state, taps=want, image_rows=image_rows,
                               rope_positions=positions)
        state.commit(piece.shape[1])
        logits = out.logits
        if want:
            kept.append(torch.cat(out.taps, dim=-1)[:, max(0, tail_from - start):])
    taps = torch.cat(kept, dim=1) if kept else None
    if images is not None:
        state.rope_shift = images.shift
    return logits[0, -1], taps


def prefill(engine: Engine, ids: list[int], tap_ids: tuple[int, ...] = (), tail: int = 0,
            state: InferenceState | None = None) -> tuple[torch.Tensor, Taps]:
    """Run the prompt in chunks of `prefill_chunk` (on the engine's state by default).

    Returns the last row's logits [vocab] and, when tap_ids are given, the concatenated taps
    [1, m, n_taps*hidden] of the prompt's last m = min(tail, len(ids)) tokens.
    """
    return run_to_end(prefill_chunks(engine, state or engine.state, ids, tap_ids, tail))


def run_to_end(steps: Generator):
    """Drive a chunked generator to its end; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def _split_taps(taps: Taps, layers: Sequence[int]) -> dict[int, torch.Tensor]:
    if taps is None or not layers:
        return {}
    return dict(zip(layers, taps.chunk(len(layers), dim=-1)))


def prefill_prompt(engine: Engine, state: InferenceState, ids: list[int],
                   prefix: Sequence[int] | None, proposer: Proposer | None,
                   stats: GenerationStats, images: PromptImages | None = None) -> Chunks:
    """`prefill_chunks`, with a declared prefix first: restored from the engine's prefix
    cache when it holds it, else prefilled (and kept). The suffix follows, images included.
    A prompt that does not start with the prefix's ids (its tokenization merged across the
    join), or whose first image starts inside the prefix, is prefilled whole."""
    tap_ids = proposer.tap_ids if proposer is not None else ()
    tail = proposer.seed_rows if proposer is not None else 0
    n = len(prefix) if prefix else 0
    if n and (n >= len(ids) or list(ids[:n]) != list(prefix)):
        log.info("the prompt is not longer than its declared %d-token prefix or does not "
                 "start with it at a token boundary: prefilling it whole", n)
        n = 0
    if n and images is not None and int(images.rows.min()) < n:
        log.info("an image starts inside the declared %d-token prefix: prefilling it whole", n)
        n = 0
    if not n:
        return (yield from prefill_chunks(engine, state, ids, tap_ids, tail, images))
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
        state.load(snap.state)
        stats.prefix_restore_ms = now_ms() - t0
        prefix_taps, states = snap.taps, snap.proposer_states
    else:
        layers = tuple(sorted({*engine.seed_tap_ids, *tap_ids}))
        _, taps = yield from prefill_chunks(engine, state, list(prefix), layers,
                                            max(engine.seed_rows, tail))
        prefix_taps = _split_taps(taps, layers)
        states = {}
        if cache is not None:
            for p in engine.proposers.values():
                states.update(p.prefix_state(prefix, prefix_taps))
            cache.put(take(state, prefix, prefix_taps, states))
    stats.prefix_cache_bytes = cache.nbytes if cache is not None else 0
    if proposer is not None:
        proposer.use_prefix_state(states)
    yield
    logits, taps = yield from prefill_chunks(engine, state, ids[n:], tap_ids, tail, images, n)
    if rows > 0 and tap_ids:
        head = torch.cat([prefix_taps[t][:, -rows:] for t in tap_ids], dim=-1)
        taps = head if taps is None else torch.cat((head, taps), dim=1)
    return logits, taps
