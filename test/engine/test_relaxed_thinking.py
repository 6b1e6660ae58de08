"""Relaxed thinking end to end: it changes only the thinking; the answer is verified strictly.

The random tiny target never writes a thinking block by itself, so the test scripts one. The
prompt opens thinking; the proposer drafts junk (accepted only because relaxed acceptance is
maximally loose here), and each cycle's bonus token is the target's own argmax. Pass 1 finds
a bonus token to play the closing marker; pass 2 runs again with that marker, after which the
proposer drafts the strict continuation with one wrong draft per cycle. Every wrong draft
after the marker must be rejected: the answer equals strict decoding of the same thinking.
"""

from __future__ import annotations

import random

import pytest
import torch

from flash_planner.engine.generate import GenerationSettings, generate
from flash_planner.engine.loop.acceptance import RelaxedThinking, StrictAcceptance
from flash_planner.engine.loop.proposer import Proposer
from flash_planner.train.tiny import write_tiny_drafter

BLOCK = 8


class ScriptedThinking(Proposer):
    """Junk drafts (fixed per position) until `answer_from`, then `answer` with mistakes."""

    def __init__(self, vocab, answer_from=10**9, answer=(), seed=0):
        self.vocab, self.answer_from, self.answer = vocab, answer_from, list(answer)
        self.block_size = BLOCK
        self.rng = random.Random(seed)

    def junk(self, index):
        return 20 + (index * 37) % (self.vocab - 40)

    def begin(self, prompt_ids, taps):
        self.prompt_len = len(prompt_ids)

    def propose(self, anchor, start, num):
        idx = range(start + 1 - self.prompt_len, start + 1 - self.prompt_len + num)
        drafts = [self.junk(i) if i < self.answer_from else
                  (self.answer + [0] * BLOCK)[i - self.answer_from] for i in idx]
        wrong = self.rng.randrange(num)
        if idx[wrong] >= self.answer_from:
            drafts[wrong] = (drafts[wrong] + 1) % self.vocab
        return torch.tensor(drafts)


def _greedy(engine, prompt, n):
    return generate(engine, prompt, GenerationSettings(n, ignore_eos=True,
                                                       speculative=False)).token_ids


@pytest.fixture(scope="module")
def engine(tmp_path_factory, checkpoints, make_engine):
    target = checkpoints("hybrid")
    return make_engine(target, drafter_path=str(write_tiny_drafter(
        tmp_path_factory.mktemp("drafter"), target)))


def test_answer_after_thinking_is_exactly_strict_decoding(engine):
    tok = engine.tokenizer
    think_open = tok.convert_tokens_to_ids("<think>")
    prompt = tok.encode("pick up the red cup", add_special_tokens=False) + [think_open]
    vocab = engine.model_config.vocab_size
    n = 48

    def loose(close):
        return RelaxedThinking(think_open, close, topk=vocab, delta=1e9)

    junk_run = generate(engine, prompt, GenerationSettings(n, ignore_eos=True),
                        proposer=ScriptedThinking(vocab), policy=loose(close=vocab - 1))
    out = junk_run.token_ids
    assert junk_run.stats.accepted == junk_run.stats.drafted   # all junk accepted
    # bonus tokens sit at indices BLOCK, 2*BLOCK, ...; take one that first occurs there
    end = next(b for b in range(BLOCK, n, BLOCK) if out.index(out[b]) == b
               and out[b] != think_open)
    close, thinking = out[end], out[:end + 1]
    answer = _greedy(engine, prompt + thinking, n - len(thinking))
    if think_open in answer:  # a committed <think> would legitimately reopen thinking
        answer = answer[:answer.index(think_open)]
    n = len(thinking) + len(answer)

    policy = loose(close)
    got = generate(engine, prompt, GenerationSettings(n, ignore_eos=True),
                   proposer=ScriptedThinking(vocab, end + 1, answer), policy=policy)
    assert got.token_ids == thinking + answer
    assert not policy.thinking
    assert got.stats.accepted < got.stats.drafted   # the answer's mistakes were rejected
    assert len(answer) >= 8

    strict = generate(engine, prompt, GenerationSettings(n, ignore_eos=True),
                      proposer=ScriptedThinking(vocab, end + 1, answer),
                      policy=StrictAcceptance())
    assert strict.token_ids == _greedy(engine, prompt, n)     # strict ignores the junk
    assert strict.token_ids[:len(thinking)] != thinking


def test_relaxed_settings_need_think_tokens_and_valid_knobs(engine):
    with pytest.raises(ValueError, match="relaxed_topk"):
        GenerationSettings(relaxed_thinking=True, relaxed_topk=0)
    with pytest.raises(ValueError, match="relaxed_delta"):
        GenerationSettings(relaxed_thinking=True, relaxed_delta=-1.0)
    got = generate(engine, [5, 6, 7], GenerationSettings(6, ignore_eos=True,
                                                         relaxed_thinking=True))
    assert len(got.token_ids) == 6   # the tiny tokenizer has <think>/</think>: it runs
