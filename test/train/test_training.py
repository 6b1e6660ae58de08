"""Training smoke test: tiny dimensions, a few steps; the loss falls and the outputs load."""

from __future__ import annotations

import random

import torch

from flash_planner.engine.checkpoint import load_checkpoint
from flash_planner.engine.models.dflash import load_drafter
from flash_planner.train.drafter import DrafterSpec, train_drafter
from flash_planner.train.target import TargetSpec, TrainSettings, train_target

VOCAB, PAD, EOS, MASK = 48, 0, 1, 2
SPEC = TargetSpec(hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1,
                  head_dim=16, linear_key_heads=2, linear_key_dim=8, linear_value_heads=2,
                  linear_value_dim=16)


def _examples(n=64):
    """Prompt 'a b c' then the answer: the prompt's tokens counted up by one."""
    rng = random.Random(0)
    out = []
    for _ in range(n):
        prompt = [rng.randrange(3, VOCAB - 8) for _ in range(6)]
        answer = [t + 1 for t in prompt] + [EOS]
        out.append((prompt + answer, [0] * len(prompt) + [1] * len(answer)))
    return out


def test_target_and_drafter_training_reduce_loss_and_write_loadable_checkpoints(tmp_path):
    data = _examples()
    steps = TrainSettings(steps=40, batch_size=16, lr=5e-3, warmup=5, log_every=5)
    losses = train_target(data, VOCAB, EOS, PAD, tmp_path / "target", SPEC, steps,
                          log=lambda _: None)
    assert losses[-1] < losses[0] * 0.8
    target = load_checkpoint(tmp_path / "target", with_tokenizer=False)
    assert target.config.is_hybrid and target.config.tie_word_embeddings

    spec = DrafterSpec(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                       intermediate_size=64, block_size=4, tap_ids=(1, 3),
                       anchors_per_sequence=4)
    d_losses = train_drafter(data, tmp_path / "target", MASK, PAD, tmp_path / "drafter", spec,
                             TrainSettings(steps=30, batch_size=8, lr=5e-3, warmup=5,
                                           log_every=5), log=lambda _: None)
    assert d_losses[-1] < d_losses[0]
    drafter = load_drafter(tmp_path / "drafter", target.config, torch.float32, "cpu")
    assert drafter.cfg.block_size == 4 and drafter.cfg.tap_ids == (1, 3)
