"""Every Triton kernel against its torch reference (interpreted on CPU, compiled on CUDA).

Shapes include non-power-of-two head dims and blocks of S = 1, 7 and 16; edge cases: all /
none / some drafts accepted per sequence, fp8 values at rounding ties, near and beyond 448,
subnormals and signed zeros.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from flash_planner.kernels.accept import kernel as accept_k
from flash_planner.kernels.accept import reference as accept_r
from flash_planner.kernels.gdn_commit import kernel as commit_k
from flash_planner.kernels.gdn_commit import reference as commit_r
from flash_planner.kernels.gdn_steps import kernel as gdn_k
from flash_planner.kernels.gdn_steps import reference as gdn_r
from flash_planner.kernels.kv_append import kernel as kv_k
from flash_planner.kernels.kv_append import reference as kv_r

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAIRS = [(accept_k.accept_rows, accept_r.accept_rows),
         (commit_k.gdn_commit, commit_r.gdn_commit),
         (gdn_k.gdn_steps, gdn_r.gdn_steps), (kv_k.kv_append, kv_r.kv_append)]


@pytest.mark.parametrize("kernel,reference", PAIRS, ids=[r.__name__ for _, r in PAIRS])
def test_kernel_and_reference_share_the_signature(kernel, reference):
    assert inspect.signature(kernel) == inspect.signature(reference)


# ---- GDN commit (rollback by replaying the kept rows)

@pytest.mark.parametrize("layers,seqs,hk,hv,dk,dv,k1,c", [
    (1, 1, 2, 2, 8, 8, 3, 16), (3, 3, 1, 3, 5, 7, 3, 11), (2, 2, 2, 4, 16, 24, 2, 40)])
@pytest.mark.parametrize("steps", [1, 7, 16])
def test_gdn_commit(layers, seqs, hk, hv, dk, dv, k1, c, steps):
    gen = torch.Generator().manual_seed(steps)
    slots = 16

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(DEVICE)

    state = rand(layers, seqs, hv, dk, dv)
    kept = (rand(layers, seqs, slots, hk, dk), rand(layers, seqs, slots, hv, dv),
            -rand(layers, seqs, slots, hv).abs())
    conv = rand(layers, seqs, k1, c)
    conv_rows = rand(layers, seqs, k1 + slots, c)
    # per sequence: nothing kept, every row kept, something between
    choices = [0, steps, steps // 2 + 1]
    count = torch.tensor([choices[i % 3] for i in range(seqs)], dtype=torch.int32,
                         device=DEVICE)
    ref_state, ref_conv = state.clone(), conv.clone()
    commit_r.gdn_commit(ref_state, *kept, ref_conv, conv_rows, count)
    commit_k.gdn_commit(state, *kept, conv, conv_rows, count)
    assert (state - ref_state).abs().max() <= 1e-5 and torch.equal(conv, ref_conv)
    for b in range(seqs):
        n = int(count[b])
        assert torch.equal(conv[:, b], conv_rows[:, b, n:n + k1])


def test_gdn_commit_refuses_a_count_past_the_kept_rows():
    state = torch.zeros(1, 1, 2, 4, 4)
    kept = (torch.zeros(1, 1, 4, 1, 4), torch.zeros(1, 1, 4, 2, 4), torch.zeros(1, 1, 4, 2))
    conv, rows = torch.zeros(1, 1, 2, 8), torch.zeros(1, 1, 6, 8)
    for fn in (commit_r.gdn_commit, commit_k.gdn_commit):
        with pytest.raises(ValueError, match="outside 0..4"):
            fn(state, *kept, conv, rows, torch.tensor([5], dtype=torch.int32))


# ---- FP8 KV append

def _fp8_probe_values():
    ties = [1.0625, 1.1875, 17.0, 2 ** -7 * 1.0625, 3 * 2 ** -10, 5 * 2 ** -10, 0.013671875]
    edges = [448.0, 447.0, 464.0, 480.0, 1e4, 2 ** -6, 2 ** -9, 2 ** -10, 1e-8, 0.0]
    values = torch.tensor(ties + edges)
    return torch.cat((values, -values, torch.randn(200) * 30, torch.randn(100) * 1e-3))


@pytest.mark.parametrize("h,d", [(2, 8), (3, 24), (1, 48)])
def test_fp8_append_is_bit_identical_to_torch(h, d):
    values = _fp8_probe_values()
    n = values.numel() // (h * d) * h * d
    rows = values[:n].reshape(1, -1, h, d)                             # [1, T, H, D]
    t = rows.shape[1]
    scale = torch.linspace(0.5, 2.0, h)
    rows = (rows * scale[:, None]).to(DEVICE)
    scale = scale.to(DEVICE)
    positions = torch.arange(t, device=DEVICE)[None] * 2
    positions[0, 1] = -1                                                # skipped row
    ours = torch.zeros(1, 2 * t, h, d, dtype=torch.uint8, device=DEVICE)
    ref = ours.clone()
    kv_k.kv_append(ours, rows, positions, scale)
    kv_r.kv_append(ref, rows, positions, scale)
    assert torch.equal(ours, ref)
    expected = (rows[0].float() / scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(ours[0, 0], expected[0].view(torch.uint8))
    assert not ours[0, 2].any()                                         # row 1 skipped


def test_fp8_append_with_a_scale_per_sequence():
    """Batched requests each keep the scales calibrated on their own prompt: scale [B, H]
    quantizes sequence b's rows with row b of it, as a one-sequence append with that row."""
    gen = torch.Generator().manual_seed(1)
    rows = torch.randn(3, 4, 2, 16, generator=gen).to(DEVICE)
    scale = torch.tensor([[0.01, 0.02], [0.5, 1.0], [0.003, 0.2]], device=DEVICE)
    positions = torch.tensor([[0, 1, 2, 3], [5, 6, 7, -1], [2, 3, 4, 5]], device=DEVICE)
    ours = torch.zeros(3, 8, 2, 16, dtype=torch.uint8, device=DEVICE)
    ref = ours.clone()
    kv_k.kv_append(ours, rows, positions, scale)
    kv_r.kv_append(ref, rows, positions, scale)
    assert torch.equal(ours, ref)
    for b in range(3):
        alone = torch.zeros(1, 8, 2, 16, dtype=torch.uint8, device=DEVICE)
        kv_r.kv_append(alone, rows[b:b + 1], positions[b:b + 1], scale[b])
        assert torch.equal(ref[b:b + 1], alone)
    read = kv_r.kv_read(ref, 8, scale, torch.float32)
    for b in range(3):
        assert torch.equal(read[b:b + 1], kv_r.kv_read(ref[b:b + 1], 8, scale[b], torch.float32))
    with pytest.raises(ValueError, match="scale"):
        kv_k.kv_append(ours, rows, positions, scale[:2])


def test_full_precision_append_and_batches():
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(3, 5, 2, 12, generator=gen).to(DEVICE)
    positions = torch.tensor([[0, 1, 2, 3, 4], [4, 3, -1, 1, 0], [-1, -1, -1, -1, 9]],
                             device=DEVICE)
    ours = torch.zeros(3, 10, 2, 12, device=DEVICE)
    ref = ours.clone()
    kv_k.kv_append(ours, rows, positions, None)
    kv_r.kv_append(ref, rows, positions, None)
    assert torch.equal(ours, ref)


# ---- GDN verify steps

@pytest.mark.parametrize("b,t,hk,hv,dk,dv", [
    (1, 1, 2, 4, 16, 16), (2, 7, 2, 2, 24, 20), (1, 16, 4, 8, 32, 48), (1, 16, 1, 3, 7, 5)],
    ids=["S1", "S7-nonpow2", "S16-gqa", "S16-odd"])
@pytest.mark.parametrize("record", [False, True], ids=["final", "rows"])
def test_gdn_steps(b, t, hk, hv, dk, dv, record):
    gen = torch.Generator().manual_seed(t)
    q, k = (torch.randn(b, t, hk, dk, generator=gen) for _ in range(2))
    v = torch.randn(b, t, hv, dv, generator=gen)
    g = -torch.rand(b, t, hv, generator=gen) * 2
    beta = torch.rand(b, t, hv, generator=gen)
    state = torch.randn(b, hv, dk, dv, generator=gen) * 0.1
    args = [x.to(DEVICE) for x in (q, k, v, g, beta)]
    ours_state, ref_state = state.clone().to(DEVICE), state.clone().to(DEVICE)
    rows = [(torch.zeros(b, 16, hk, dk, device=DEVICE), torch.zeros(b, 16, hv, dv, device=DEVICE),
             torch.zeros(b, 16, hv, device=DEVICE)) if record else None for _ in range(2)]
    out = gdn_k.gdn_steps(*args, ours_state, rows[0])
    ref = gdn_r.gdn_steps(*args, ref_state, rows[1])
    assert (out - ref).abs().max() <= 1e-5
    assert (ours_state - ref_state).abs().max() <= 1e-5
    if record:
        assert torch.equal(ours_state, state.to(DEVICE))     # a verify leaves the state
        for ours, theirs in zip(*rows):
            assert (ours - theirs).abs().max() <= 1e-5
            assert not ours[:, t:].any()                      # rows past T untouched


@pytest.mark.parametrize("t,keep", [(16, 16), (16, 5), (7, 1), (9, 0)])
def test_verify_rows_then_commit_equal_the_steps_run_alone(t, keep):
    """Kernels end to end: a verify keeping its rows, then a commit of the first `keep`,
    reach the state of those rows run as a plain block; the conv window is rebuilt."""
    gen = torch.Generator().manual_seed(t + keep)
    b, hk, hv, dk, dv = 2, 2, 4, 16, 12
    q, k = (torch.randn(b, t, hk, dk, generator=gen).to(DEVICE) for _ in range(2))
    v = torch.randn(b, t, hv, dv, generator=gen).to(DEVICE)
    g = (-torch.rand(b, t, hv, generator=gen) * 2).to(DEVICE)
    beta = torch.rand(b, t, hv, generator=gen).to(DEVICE)
    state = (torch.randn(b, hv, dk, dv, generator=gen) * 0.1).to(DEVICE)
    rows = (torch.zeros(1, b, 16, hk, dk, device=DEVICE),
            torch.zeros(1, b, 16, hv, dv, device=DEVICE), torch.zeros(1, b, 16, hv, device=DEVICE))
    live = state.clone()
    gdn_k.gdn_steps(q, k, v, g, beta, live, tuple(r[0] for r in rows))
    conv_rows = torch.randn(1, b, 3 + 16, 8, generator=gen).to(DEVICE)
    conv = torch.zeros(1, b, 3, 8, device=DEVICE)
    commit_k.gdn_commit(live[None], *rows, conv, conv_rows,
                        torch.full((b,), keep, dtype=torch.int32, device=DEVICE))
    alone = state.clone()
    if keep:
        gdn_k.gdn_steps(q[:, :keep], k[:, :keep], v[:, :keep], g[:, :keep], beta[:, :keep],
                        alone)
    assert torch.equal(live, alone)          # the same float32 operations, in order
    assert torch.equal(conv[0], conv_rows[0, :, keep:keep + 3])


def test_gdn_steps_bf16_inputs_compute_in_fp32():
    gen = torch.Generator().manual_seed(4)
    q, k = (torch.randn(1, 5, 2, 16, generator=gen).bfloat16() for _ in range(2))
    v = torch.randn(1, 5, 2, 16, generator=gen).bfloat16()
    g, beta = -torch.rand(1, 5, 2, generator=gen), torch.rand(1, 5, 2, generator=gen)
    s1, s2 = torch.zeros(1, 2, 16, 16, device=DEVICE), torch.zeros(1, 2, 16, 16, device=DEVICE)
    args = [x.to(DEVICE) for x in (q, k, v, g, beta)]
    out = gdn_k.gdn_steps(*args, s1)
    ref = gdn_r.gdn_steps(*args, s2)
    assert out.dtype == torch.bfloat16
    assert torch.allclose(s1, s2, atol=1e-5)
    assert (out.float() - ref.float()).abs().max() <= 2e-2   # the bf16 rounding of o


# ---- acceptance

@pytest.mark.parametrize("vocab", [50, 1000, 3000])
def test_accept_rows_strict_and_relaxed(vocab):
    gen = torch.Generator().manual_seed(vocab)
    b, k = 3, 6
    logits = torch.randn(b, k + 1, vocab, generator=gen) * 3
    order = logits[:, :-1].argsort(dim=-1, descending=True)
    # seq 0: all drafts are the argmax; seq 1: second-best everywhere; seq 2: mixed ranks
    ranks = torch.tensor([[0] * k, [1] * k, [0, 2, 1, 5, 0, 3]])
    drafts = order.gather(-1, ranks[..., None])[..., 0]
    logits[2, 4, :] = 0.0                       # a row of exact ties: argmax is index 0
    drafts[2, 4] = 0
    for relaxed in (torch.zeros(b, k, dtype=torch.bool), torch.ones(b, k, dtype=torch.bool),
                    torch.tensor([[True, False] * 3] * b)):
        for topk, delta in ((1, 0.0), (3, 1.0), (3, 100.0), (vocab, 1e9)):
            args = [x.to(DEVICE) for x in (drafts, logits, relaxed)]
            ours = accept_k.accept_rows(*args, topk, delta)
            ref = accept_r.accept_rows(*args, topk, delta)
            assert torch.equal(ours, ref), (relaxed, topk, delta)
    strict = accept_r.accept_rows(drafts, logits, torch.zeros(b, k, dtype=torch.bool), 1, 0.0)
    assert accept_r.accepted_prefix(strict).tolist() == [k, 0, 1]


def test_accept_rows_split_over_the_vocabulary_keeps_the_first_maximum():
    """Few rows over a long vocabulary: each row's reductions are split over programs (five
    chunks here) and combined in order. The maximum recurs in a later chunk, so the
    combination must keep the earlier index; draft ranks straddle the chunks."""
    from flash_planner.kernels.accept.kernel import BLOCK_V, split

    gen = torch.Generator().manual_seed(5)
    vocab = 4 * BLOCK_V + 100
    logits = torch.randn(1, 3, vocab, generator=gen)
    logits[0, 0, [1500, 3900]] = 9.0                  # a tie across chunks: 1500 wins
    logits[0, 1, 4150] = 9.0                          # the maximum in the last chunk
    drafts = torch.tensor([[3900, 4150]])
    chunk, splits = split(2, vocab, torch.device(DEVICE))
    assert splits > 1 and chunk % BLOCK_V == 0
    for relaxed in (torch.zeros(1, 2, dtype=torch.bool), torch.ones(1, 2, dtype=torch.bool)):
        args = [x.to(DEVICE) for x in (drafts, logits, relaxed)]
        for topk, delta in ((1, 0.0), (2, 0.5)):
            ours = accept_k.accept_rows(*args, topk, delta)
            assert torch.equal(ours, accept_r.accept_rows(*args, topk, delta))
    assert accept_k.accept_rows(*args[:2], torch.zeros_like(args[2]), 1, 0.0).tolist() == [
        [False, True]]
