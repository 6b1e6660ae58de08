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
    ref_state = state.clone()
    ref_out = reference.gdn_steps(q, k, v, g, beta, ref_state)
    live = state.clone()
    out = chunked.gdn_steps(q, k, v, g, beta, live)
    assert torch.isfinite(out).all()
    assert (out - ref_out).abs().max() <= 1e-4
    assert (live - ref_state).abs().max() <= 1e-4
    if t > chunked.CHUNK:
        return
    # a verify: the same outputs, the state left, the rows as the recurrence kept them
    rows = [(torch.zeros(b, t + 2, hk, dk), torch.zeros(b, t + 2, hv, dv),
             torch.zeros(b, t + 2, hv)) for _ in range(2)]
    reference.gdn_steps(q, k, v, g, beta, state.clone(), rows[0])
    kept = state.clone()
    assert (chunked.gdn_steps(q, k, v, g, beta, kept, rows[1]) - ref_out).abs().max() <= 1e-4
    assert torch.equal(kept, state)
    for ref_rows, ours in zip(*rows):
        assert (ours[:, :t] - ref_rows[:, :t]).abs().max() <= 1e-4
        assert not ours[:, t:].any()                                    # rows past T untouched


def test_chunked_keeps_the_value_dtype_and_checks_shapes():
    q, k, v, g, beta, state = _inputs(1, 5, 2, 4, 16, 12)
    out = chunked.gdn_steps(q, k, v.bfloat16(), g, beta, state.clone())
    assert out.dtype == torch.bfloat16 and out.shape == (1, 5, 4, 12)
    with pytest.raises(ValueError, match="state must be float32"):
        chunked.gdn_steps(q, k, v, g, beta, state.double())
    short = (torch.zeros(1, 3, 2, 16), torch.zeros(1, 3, 4, 12), torch.zeros(1, 3, 4))
    with pytest.raises(ValueError, match=r"k_rows must be float32 \[1, >=5, 2, 16\]"):
        chunked.gdn_steps(q, k, v, g, beta, state.clone(), short)


def test_cpu_dispatch_serves_blocks_in_chunked_form(monkeypatch):
    calls = []
    monkeypatch.setattr(dispatch, "_gdn_steps_chunked",
                        lambda *a: calls.append(a[0].shape[1]) or chunked.gdn_steps(*a))
    monkeypatch.setattr(dispatch, "_backend", "torch")
    for t in (1, 16):
        q, k, v, g, beta, state = _inputs(1, t, 2, 4, 16, 12)
        dispatch.gdn_steps(q, k, v, g, beta, state)
    assert calls == [16]          # a single decode step keeps the plain recurrence


@pytest.mark.parametrize("counts", [[16, 0, 5], [1], [0, 0], [7, 16], [2, 16, 1]])
@pytest.mark.parametrize("decay", [2.0, 200.0], ids=["decay2", "decay200"])
def test_chunked_commit_matches_the_recurrent_one(counts, decay):
    """The closed-form commit (dispatch's CPU path) against the reference's replay."""
    from flash_planner.kernels.gdn_commit import chunked as commit_chunked
    from flash_planner.kernels.gdn_commit import reference as commit_ref

    gen = torch.Generator().manual_seed(len(counts))
    layers, b, hk, hv, dk, dv, k1, c = 2, len(counts), 2, 4, 16, 12, 3, 10
    state = torch.randn(layers, b, hv, dk, dv, generator=gen) * 0.1
    kept = (torch.nn.functional.normalize(torch.randn(layers, b, 16, hk, dk, generator=gen),
                                          dim=-1),
            torch.randn(layers, b, 16, hv, dv, generator=gen),
            -torch.rand(layers, b, 16, hv, generator=gen) * decay)
    conv_rows = torch.randn(layers, b, k1 + 16, c, generator=gen)
    count = torch.tensor(counts, dtype=torch.int32)
    ours, ref = state.clone(), state.clone()
    ours_conv, ref_conv = torch.zeros(layers, b, k1, c), torch.zeros(layers, b, k1, c)
    commit_chunked.gdn_commit(ours, *kept, ours_conv, conv_rows, count)
    commit_ref.gdn_commit(ref, *kept, ref_conv, conv_rows, count)
    assert torch.isfinite(ours).all() and (ours - ref).abs().max() <= 1e-5
    assert torch.equal(ours_conv, ref_conv)
    for i, n in enumerate(counts):
        if n == 0:
            assert torch.equal(ours[:, i], state[:, i])
