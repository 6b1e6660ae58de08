"""The streamed (reasoning, content) split: what was sent must stay a prefix of the whole.

A `</think>` arriving after the thought's trailing newline had been streamed made the closed
reasoning (newlines stripped) no longer start with what was sent, and every later delta
re-sent the whole thought (seen as a remote plan whose steps never streamed back).
"""

from __future__ import annotations

import itertools

import pytest

from flash_planner.server.openai_api import ReasoningStream, split_reasoning

TEXT = "<think>\nFirst the cup.\n\nThen the sink.\n</think>\n\n{\"plan\": []}"


def _cuts(text: str, sizes: tuple[int, ...]) -> list[str]:
    pieces, at = [], 0
    for size in itertools.cycle(sizes):
        if at >= len(text):
            return pieces
        pieces.append(text[at:at + size])
        at += size


@pytest.mark.parametrize("sizes", [(1,), (2,), (3, 5), (7,), (22, 1, 9), (len(TEXT),)])
def test_streamed_deltas_add_up_to_the_split_of_the_whole(sizes):
    stream = ReasoningStream()
    reasoning, content = [], []
    for piece in _cuts(TEXT, sizes):
        r, c = stream.feed(piece)
        reasoning.append(r)
        content.append(c)
    r, c = stream.feed("", final=True)
    reasoning.append(r)
    content.append(c)
    assert ("".join(reasoning), "".join(content)) == split_reasoning(TEXT)
    assert split_reasoning(TEXT) == ("First the cup.\n\nThen the sink.", "{\"plan\": []}")


def test_a_thought_cut_off_keeps_its_newlines_when_final():
    stream = ReasoningStream()
    assert stream.feed("<think>\nstill thinking\n") == ("still thinking", "")
    assert stream.feed("", final=True) == ("\n", "")
