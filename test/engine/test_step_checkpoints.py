"""Committing step n of a recorded S-token forward equals a forward over only n tokens."""

from __future__ import annotations

import pytest
import torch

from flash_planner.engine.checkpoint import load_checkpoint
from flash_planner.engine.state.cache import InferenceState

S = 8


def _run(model, state, ids, **kwargs):
    return model(ids, state, **kwargs)


@pytest.fixture(scope="module", params=["hybrid", "dense"])
def setup(request, checkpoints):
    ckpt = load_checkpoint(checkpoints(request.param))
    state = InferenceState(ckpt.config, 128, S, torch.float32, torch.float32,
                           torch.device("cpu"))
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, ckpt.config.vocab_size, (1, 11), generator=gen)
    block = torch.randint(0, ckpt.config.vocab_size, (1, S), generator=gen)
    probe = torch.randint(0, ckpt.config.vocab_size, (1, 1), generator=gen)
    return ckpt.model, state, prompt, block, probe


def _prefill(model, state, prompt):
    state.reset()
    model(prompt, state)
    state.commit(prompt.shape[1])


@pytest.mark.parametrize("n", range(1, S + 1))
def test_commit_step_n_equals_forward_over_n_tokens(setup, n):
    model, state, prompt, block, probe = setup
    # reference: run only the first n block tokens, then the probe token
    _prefill(model, state, prompt)
    model(block[:, :n], state)
    state.commit(n)
    ref_state = state.gdn.state.clone()
    ref_conv = state.gdn.conv.clone()
    ref_logits = model(probe, state).logits
    state.commit(1)

    # speculative shape: run all S tokens recording steps, keep n, run the probe
    _prefill(model, state, prompt)
    model(block, state, record_steps=True, all_logits=True)
    state.commit(n)
    assert state.length == prompt.shape[1] + n
    assert torch.allclose(state.gdn.state, ref_state, atol=1e-5)
    # 1e-5, not exact: n tokens run as one chunk vs S tokens in chunked form sum in other orders
    assert torch.allclose(state.gdn.conv, ref_conv, atol=1e-5)
    logits = model(probe, state).logits
    state.commit(1)
    assert (logits - ref_logits).abs().max().item() <= 1e-4


def test_partial_commit_needs_recorded_steps(setup):
    model, state, prompt, block, _ = setup
    _prefill(model, state, prompt)
    model(block, state)
    with pytest.raises(RuntimeError, match="record_steps"):
        state.commit(3)
    state.commit(S)
    with pytest.raises(ValueError, match="outside"):
        state.commit(1)  # nothing pending


def test_recording_more_steps_than_buffers_hold_is_refused(setup):
    model, state, prompt, _, _ = setup
    _prefill(model, state, prompt)
    too_long = torch.zeros(1, S + 1, dtype=torch.long)
    with pytest.raises(ValueError, match="checkpoints hold"):
        model(too_long, state, record_steps=True)
