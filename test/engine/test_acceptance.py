"""Acceptance math: strict prefix matching and relaxed thinking (top-k + logit margin)."""

from __future__ import annotations

import torch

from flash_planner.engine.loop.acceptance import RelaxedThinking, StrictAcceptance

OPEN, CLOSE = 3, 4
V = 10


def _logits(rows):
    """rows: per verify row, a dict token -> logit (others -inf-ish)."""
    out = torch.full((len(rows), V), -10.0)
    for i, row in enumerate(rows):
        for tok, value in row.items():
            out[i, tok] = value
    return out


def test_strict_counts_the_leading_matches():
    logits = _logits([{5: 1.0}, {6: 1.0}, {7: 1.0}, {8: 1.0}])
    strict = StrictAcceptance()
    assert strict.accept(torch.tensor([5, 6, 7]), logits).item() == 3
    assert strict.accept(torch.tensor([5, 9, 7]), logits).item() == 1
    assert strict.accept(torch.tensor([0, 6, 7]), logits).item() == 0


def test_relaxed_accepts_within_topk_and_margin_inside_thinking():
    policy = RelaxedThinking(OPEN, CLOSE, topk=3, delta=1.0)
    policy.reset([1, OPEN])                          # the prompt opened a thinking block
    row = {5: 2.0, 6: 1.5, 7: 0.9, 8: 0.8}           # top-3: 5, 6, 7
    logits = _logits([row] * 5)
    assert policy.accept(torch.tensor([6, 5, 5, 5]), logits).item() == 4  # margin 0.5
    assert policy.accept(torch.tensor([5, 7, 5, 5]), logits).item() == 1  # margin 1.1
    assert policy.accept(torch.tensor([5, 8, 5, 5]), logits).item() == 1  # not in top-3
    policy.topk = 4
    policy.delta = 1.5
    assert policy.accept(torch.tensor([5, 8, 5, 5]), logits).item() == 4


def test_relaxed_is_strict_outside_thinking_and_from_the_close_marker_on():
    policy = RelaxedThinking(OPEN, CLOSE, topk=3, delta=1.0)
    policy.reset([1, OPEN, 2, CLOSE])                # thinking already closed in the prompt
    row = {5: 2.0, 6: 1.5}
    assert policy.accept(torch.tensor([6]), _logits([row, row])).item() == 0

    policy.reset([OPEN])
    # CLOSE is judged strictly; after it, strict matching
    logits = _logits([{5: 2.0, CLOSE: 1.8}, {6: 2.0, 7: 1.9}, {8: 1.0}])
    assert policy.accept(torch.tensor([CLOSE, 7]), logits).item() == 0
    logits = _logits([{CLOSE: 2.0}, {6: 2.0, 7: 1.9}, {8: 1.0}])
    assert policy.accept(torch.tensor([CLOSE, 7]), logits).item() == 1
    assert policy.accept(torch.tensor([CLOSE, 6]), logits).item() == 2
    # an OPEN draft re-opens thinking for the drafts after it
    policy.reset([OPEN, CLOSE])
    logits = _logits([{OPEN: 2.0}, {6: 2.0, 7: 1.9}, {8: 1.0}])
    assert policy.accept(torch.tensor([OPEN, 7]), logits).item() == 2


def test_think_state_follows_committed_tokens():
    policy = RelaxedThinking(OPEN, CLOSE)
    policy.reset([1, 2])
    assert not policy.thinking
    policy.observe([5, OPEN, 6])
    assert policy.thinking
    policy.observe([CLOSE, 7])
    assert not policy.thinking
    drafts = torch.tensor([5, OPEN, 6, CLOSE, 7])
    assert policy.thinking_before(drafts).tolist() == [False, False, True, True, False]
