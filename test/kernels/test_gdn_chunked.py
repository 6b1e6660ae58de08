"""The chunked (parallel) gated delta rule, the CPU path, against the recurrent reference."""

from __future__ import annotations

import pytest
import torch

from flash_planner.kernels import dispatch
from flash_planner.kernels.gdn_steps import chunked, reference


def _inputs(b, t, hk, hv, dk, dv, decay=2.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, hk, dk, generator=gen)
    k = torch.randn(b, t, hk, dk, generator=gen)
    v = torch.randn(b, t, hv, dv, generator=gen)
    g = -torch.rand(b, t, hv, generator=gen) * decay      # log decay, <= 0
    beta = torch.rand(b, t, hv, generator=gen)
    state = torch.randn(b, hv, dk, dv, generator=gen) * 0.1
    return q, k, v, g, beta, state


@pytest.mark.parametrize("b,t,hk,hv,dk,dv,decay", [
    (1, 1, 2, 4, 16, 16, 2.0), (2, 7, 2, 2, 24, 20, 2.0), (1, 16, 4, 8, 32, 48, 2.0),
    (1, 16, 2, 4, 16, 16, 40.0), (2, 150, 1, 3, 8, 8, 0.2)],
    ids=["T1", "T7-nonpow2", "T16-gqa", "T16-strong-decay", "T150-three-chunks"])
def test_chunked_matches_recurrent_reference(b, t, hk, hv, dk, dv, decay):
    q, k, v, g, beta, state = _inputs(b, t, hk, hv, dk, dv, decay)
    ref_state, ref_steps = state.clone(), torch.zeros(b, t, hv, dk, dv)
    ref_out = reference.gdn_steps(q, k, v, g, beta, ref_state, ref_steps)
    live, steps = state.clone(), torch.zeros(b, t + 2, hv, dk, dv)
    out = chunked.gdn_steps(q, k, v, g, beta, live, steps)
    assert torch.isfinite(out).all()
    assert (out - ref_out).abs().max() <= 1e-4
    assert (live - ref_state).abs().max() <= 1e-4
    assert (steps[:, :t] - ref_steps).abs().max() <= 1e-4
    assert torch.equal(steps[:, t:], torch.zeros_like(steps[:, t:]))   # rows past T untouched
    # without checkpoints: same outputs and final state
    bare = state.clone()
    assert torch.allclose(chunked.gdn_steps(q, k, v, g, beta, bare), out, atol=1e-6)
    assert torch.allclose(bare, live, atol=1e-6)


def test_chunked_keeps_the_value_dtype_and_checks_shapes():
    q, k, v, g, beta, state = _inputs(1, 5, 2, 4, 16, 12)
    out = chunked.gdn_steps(q, k, v.bfloat16(), g, beta, state.clone())
    assert out.dtype == torch.bfloat16 and out.shape == (1, 5, 4, 12)
    with pytest.raises(ValueError, match="state must be float32"):
        chunked.gdn_steps(q, k, v, g, beta, state.double())
    with pytest.raises(ValueError, match="step_states holds 3 steps"):
        chunked.gdn_steps(q, k, v, g, beta, state.clone(), torch.zeros(1, 3, 4, 16, 12))


def test_cpu_dispatch_serves_blocks_in_chunked_form(monkeypatch):
    calls = []
    monkeypatch.setattr(dispatch, "_gdn_steps_chunked",
                        lambda *a: calls.append(a[0].shape[1]) or chunked.gdn_steps(*a))
    monkeypatch.setattr(dispatch, "_backend", "torch")
    for t in (1, 16):
        q, k, v, g, beta, state = _inputs(1, t, 2, 4, 16, 12)
        dispatch.gdn_steps(q, k, v, g, beta, state)
    assert calls == [16]          # a single decode step keeps the plain recurrence
