"""Rotary positions of a prompt with images (Qwen3.5/3.6 mRoPE).

Each token has a (t, h, w) position. A text token's three are equal: one more than the
position before it. An image's tokens (one per merged block of its (t, h, w) patch grid,
in raster order) sit at (start + frame, start + row, start + column), `start` being the
position after the text before it; the text after the image continues at start +
max(rows, columns). So an image takes fewer positions than tokens, and every row after it
turns by its cache row plus a shift (`InferenceState.rope_shift`: the last position + 1
minus the rows, <= 0), which the decode steps carry on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ImageSpan:
    """An image's tokens in a prompt: from row `start`, its merged grid (t, h, w)."""
    start: int
    grid: tuple[int, int, int]         # in merged tokens: (t, patches h / m, patches w / m)

    @property
    def tokens(self) -> int:
        t, h, w = self.grid
        return t * h * w


def prompt_positions(length: int, spans: Sequence[ImageSpan]) -> tuple[torch.Tensor, int]:
    """(t, h, w) positions [3, length] of a prompt of `length` rows with these images (in
    order, not overlapping), and the rotary shift of the rows after it."""
    parts, row, position = [], 0, 0
    for span in spans:
        if span.start < row or span.start + span.tokens > length:
            raise ValueError(f"image tokens at rows {span.start}..{span.start + span.tokens - 1}"
                             f" overlap another image or pass the prompt's {length} rows")
        text = span.start - row
        parts.append(torch.arange(position, position + text).expand(3, text))
        position += text
        t, h, w = span.grid
        frame, r, c = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w),
                                     indexing="ij")
        parts.append(torch.stack((frame, r, c)).reshape(3, -1) + position)
        position += max(h, w)
        row = span.start + span.tokens
    text = length - row
    parts.append(torch.arange(position, position + text).expand(3, text))
    positions = torch.cat(parts, dim=1)
    shift = int(positions.max()) + 1 - length if length else 0
    return positions, shift


@dataclass(frozen=True)
class PromptImages:
    """A prompt's images as the target takes them: each image's token rows, the vision
    tower's embeddings for them (in row order), every row's (t, h, w) rotary position and
    the shift of the rows after the prompt."""
    rows: torch.Tensor              # [K] the image tokens' rows
    embeddings: torch.Tensor        # [K, hidden]
    positions: torch.Tensor         # [3, prompt length]
    shift: int

    def block(self, lo: int, hi: int) -> tuple[tuple[torch.Tensor, torch.Tensor] | None,
                                               torch.Tensor]:
        """What a forward of rows lo..hi-1 takes: (its image rows within the block and their
        embeddings, or None) and its rotary positions [3, hi - lo]."""
        inside = (self.rows >= lo) & (self.rows < hi)
        image_rows = ((self.rows[inside] - lo, self.embeddings[inside])
                      if bool(inside.any()) else None)
        return image_rows, self.positions[:, lo:hi]


def _runs(ids: Sequence[int], token: int) -> list[tuple[int, int]]:
    """(first row, length) of each run of `token` in `ids`."""
    runs, row = [], 0
    while row < len(ids):
        if ids[row] != token:
            row += 1
            continue
        start = row
        while row < len(ids) and ids[row] == token:
            row += 1
        runs.append((start, row - start))
    return runs


def expand_image_tokens(ids: Sequence[int], image_token_id: int, counts: Sequence[int]
                        ) -> list[int]:
    """`ids` with each image's single image token (what a chat template renders) repeated
    to the image's token count; ids whose runs already have those counts as they are."""
    runs = _runs(ids, image_token_id)
    if [n for _, n in runs] == list(counts) or not all(n == 1 for _, n in runs) \
            or len(runs) != len(counts):
        return list(ids)                  # expanded already, or image_spans says what's wrong
    out, row = [], 0
    for (start, _), count in zip(runs, counts):
        out += list(ids[row:start]) + [image_token_id] * count
        row = start + 1
    return out + list(ids[row:])


def image_spans(ids: Sequence[int], image_token_id: int, counts: Sequence[int]
                ) -> list[int]:
    """The first row of each image's run of `image_token_id` in `ids`, checked against the
    images' token counts (in order)."""
    runs = _runs(ids, image_token_id)
    if [n for _, n in runs] != list(counts):
        raise ValueError(f"the prompt holds image token runs of {[n for _, n in runs]} tokens "
                         f"for images of {list(counts)} tokens: each image needs exactly its "
                         "own run of image tokens, in order")
    return [start for start, _ in runs]
