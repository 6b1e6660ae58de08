"""The drafter's per-token context window: commit order, capacity, prompt seeding."""

from __future__ import annotations

import pytest
import torch

from flash_planner.engine.generate import GenerationSettings, generate
from flash_planner.engine.loop.proposer import DFlashProposer, ReplayProposer
from flash_planner.train.tiny import write_tiny_drafter


@pytest.fixture(scope="module")
def engine(tmp_path_factory, checkpoints, make_engine):
    target = checkpoints("hybrid")
    drafter = write_tiny_drafter(tmp_path_factory.mktemp("drafter"), target, block_size=8)
    return make_engine(target, drafter_path=str(drafter), window=16, method="dflash")


class TappingReplay(DFlashProposer):
    """A DFlash proposer (real window bookkeeping) whose drafts come from a replay, so that
    cycles accept many tokens and the window sees multi-row commits of every length."""

    def __init__(self, base: DFlashProposer, replay: ReplayProposer, seed_window=True):
        super().__init__(base.drafter, base.embed, base.lm_head_weight, window=16,
                         seed_window=seed_window, block_size=8)
        self.replay = replay

    def begin(self, prompt_ids, taps):
        super().begin(prompt_ids, taps)
        self.replay.begin(prompt_ids, taps)

    def propose(self, anchor, start, num):
        return self.replay.propose(anchor, start, num)


def _features_by_slow_recomputation(engine, seq):
    """fc/hidden_norm features of every position of seq, from one plain target forward."""
    proposer = engine.proposer
    engine.state.reset()
    out = engine.model(torch.tensor([seq]), engine.state, taps=proposer.tap_ids)
    engine.state.reset()
    return proposer.drafter.context_features(torch.cat(out.taps, dim=-1))[0]


@pytest.mark.parametrize("seed_window", [True, False])
def test_window_rows_are_the_committed_tokens_in_commit_order(engine, seed_window):
    prompt = engine.tokenizer.encode("open the drawer", add_special_tokens=False)
    ref = generate(engine, prompt, GenerationSettings(30, ignore_eos=True,
                                                      speculative=False)).token_ids
    replay = ReplayProposer(ref, engine.model_config.vocab_size, block_size=8,
                            error_at=[7, 2, 0, 5, 7, 1])
    proposer = TappingReplay(engine.proposer, replay, seed_window)
    lengths = []
    got = generate(engine, prompt, GenerationSettings(30, ignore_eos=True),
                   on_token=lambda ids, _: lengths.append(len(proposer.window)),
                   proposer=proposer)
    assert got.token_ids == ref
    committed = len(prompt) + len(ref) - 1       # the last published token is not run yet
    first = 0 if seed_window else len(prompt)
    n = min(16, committed - first)
    window = proposer.window
    assert window.positions.tolist() == list(range(committed - n, committed))
    slow = _features_by_slow_recomputation(engine, prompt + ref[:-1])
    assert torch.allclose(window.features[0], slow[committed - n:committed], atol=1e-4)
    # window keys/values are those of the same rows
    k_rows, _ = window.drafter.context_kv(slow[None, committed - n:committed],
                                          window.positions[None])[0]
    assert torch.allclose(window.kv[0][0], k_rows, atol=1e-4)
    assert lengths[0] == (min(16, len(prompt)) if seed_window else 0)
    assert max(lengths) == 16  # it filled and then dropped its oldest rows


def test_window_capacity_drops_oldest_first(engine):
    window = type(engine.proposer.window)(engine.proposer.drafter, capacity=5)
    taps = torch.randn(1, 7, len(engine.proposer.tap_ids) * engine.model_config.hidden_size)
    window.append(taps[:, :3], torch.arange(0, 3))
    window.append(taps[:, 3:7], torch.arange(3, 7))
    assert window.positions.tolist() == [2, 3, 4, 5, 6]
    expected = engine.proposer.drafter.context_features(taps[:, 2:7])
    assert torch.allclose(window.features, expected, atol=1e-6)
    window.append(taps, torch.arange(10, 17))       # more rows than capacity at once
    assert window.positions.tolist() == [12, 13, 14, 15, 16]
