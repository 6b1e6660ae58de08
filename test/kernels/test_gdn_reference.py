"""The gated delta rule reference against transformers' torch implementation."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

from flash_planner.kernels.gdn_commit.reference import gdn_commit
from flash_planner.kernels.gdn_steps.reference import gdn_steps


def _inputs(b, t, hk, hv, dk, dv, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, hk, dk, generator=gen)
    k = torch.randn(b, t, hk, dk, generator=gen)
    v = torch.randn(b, t, hv, dv, generator=gen)
    g = -torch.rand(b, t, hv, generator=gen) * 2          # log decay, <= 0
    beta = torch.rand(b, t, hv, generator=gen)
    state = torch.randn(b, hv, dk, dv, generator=gen) * 0.1
    return q, k, v, g, beta, state


@pytest.mark.parametrize("b,t,hk,hv,dk,dv", [
    (1, 1, 2, 4, 16, 16), (2, 7, 2, 2, 24, 20), (1, 16, 4, 8, 32, 48), (1, 40, 1, 3, 8, 8)],
    ids=["S1", "S7-nonpow2", "S16-gqa", "S40-prefill"])
def test_matches_transformers_recurrent_form(b, t, hk, hv, dk, dv):
    q, k, v, g, beta, state = _inputs(b, t, hk, hv, dk, dv)
    # q and k heads repeated here, as transformers' GDN layer does before calling the rule:
    # 5.24's function repeats them itself, 5.17's does not (setup.py admits both)
    rep = hv // hk
    ref_out, ref_state = torch_recurrent_gated_delta_rule(
        q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2), v, g, beta,
        initial_state=state.clone(), output_final_state=True, use_qk_l2norm_in_kernel=True)
    live = state.clone()
    out = gdn_steps(q, k, v, g, beta, live)
    assert (out - ref_out).abs().max() <= 1e-5
    assert (live - ref_state).abs().max() <= 1e-5


def kept_rows(b, hk, hv, dk, dv, slots=16):
    return (torch.zeros(b, slots, hk, dk), torch.zeros(b, slots, hv, dv),
            torch.zeros(b, slots, hv))


def test_kept_rows_commit_to_the_state_one_token_at_a_time_reaches():
    q, k, v, g, beta, state = _inputs(1, 9, 2, 4, 16, 12, seed=1)
    rows = kept_rows(1, 2, 4, 16, 12)
    block_state = state.clone()
    out = gdn_steps(q, k, v, g, beta, block_state, rows)
    assert torch.equal(block_state, state)                  # a verify leaves the state
    live = state.clone()
    conv, conv_rows = torch.zeros(1, 1, 3, 5), torch.randn(1, 1, 3 + 16, 5)
    for i in range(9):
        o = gdn_steps(q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1], g[:, i:i + 1],
                      beta[:, i:i + 1], live)
        assert torch.allclose(o[:, 0], out[:, i], atol=1e-6)
        kept = state.clone()[None]
        gdn_commit(kept, *(r[None] for r in rows), conv, conv_rows,
                   torch.tensor([i + 1], dtype=torch.int32))
        assert torch.allclose(kept[0], live, atol=1e-6), f"step {i}"
        assert torch.equal(conv[0, 0], conv_rows[0, 0, i + 1:i + 4])
