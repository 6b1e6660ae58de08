"""FP8 e4m3 KV cache against a full-precision cache on the same model."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flash_planner.engine.generate import GenerationSettings, generate
from flash_planner.kernels.kv_append.reference import FP8_MAX, kv_append, kv_read

STEPS = 64


def test_fp8_kv_greedy_continuation_tracks_full_precision(checkpoints, make_engine):
    # A trained LM's logits spread widely (std of several units); the default tiny random
    # model's are nearly flat (std ~0.7), which would make the unavoidable ~3% e4m3 rounding
    # of V look like a large change of the output distribution. init=0.25 gives std ~2.
    path = checkpoints("hybrid", init=0.25)
    full = make_engine(path, kv_dtype="fp32")
    fp8 = make_engine(path, kv_dtype="fp8")
    prompt = full.tokenizer.encode("open the top drawer, take the blue screwdriver",
                                   add_special_tokens=False)
    ref = generate(full, prompt, GenerationSettings(max_new_tokens=STEPS, ignore_eos=True))
    ours = generate(fp8, prompt, GenerationSettings(max_new_tokens=STEPS, ignore_eos=True))
    agree = sum(a == b for a, b in zip(ref.token_ids, ours.token_ids))
    print(f"FP8 vs fp32 KV: {agree}/{STEPS} greedy tokens agree")

    # Teacher-forced on the full-precision continuation, so every step sees the same input.
    seq = torch.tensor([prompt + ref.token_ids])
    cosines = []
    for engine in (full, fp8):
        engine.state.reset()
    out_full = full.model(seq, full.state, all_logits=True).logits[0]
    out_fp8 = fp8.model(seq, fp8.state, all_logits=True).logits[0]
    for t in range(len(prompt) - 1, seq.shape[1]):
        cosines.append(F.cosine_similarity(out_full[t], out_fp8[t], dim=0).item())
    print(f"FP8 vs fp32 KV: min logits cosine {min(cosines):.5f} over {len(cosines)} steps")
    assert min(cosines) >= 0.999
    assert fp8.memory.kv_cache < full.memory.kv_cache / 3


def test_fp8_append_is_bit_exact_with_torch_e4m3_and_saturates():
    h, d = 2, 8
    scale = torch.tensor([0.5, 2.0])
    # ties between e4m3 grid points, values near and beyond 448 * scale, subnormals, zero
    values = torch.tensor([0.0, 1.0625, 1.1875, -3.25, 447.0, 448.0, 500.0, -1e4,
                           2 ** -9, 2 ** -7, 3 * 2 ** -10, 1e-3, 240.0, -17.0, 0.3, 5.5])
    rows = values.reshape(1, 1, h, d).repeat(1, 3, 1, 1) * scale[:, None]
    cache = torch.zeros(1, 6, h, d, dtype=torch.uint8)
    kv_append(cache, rows, torch.tensor([[0, -1, 4]]), scale)
    expected = (rows[0, 0] / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    assert torch.equal(cache[0, 0], expected.view(torch.uint8))
    assert torch.equal(cache[0, 4], expected.view(torch.uint8))
    assert not cache[0, 1].any()  # position -1 skipped, nothing else written
    back = kv_read(cache, 1, scale, torch.float32)[0, 0]
    assert torch.isfinite(back).all()
    assert back.abs().max() <= FP8_MAX * scale.max()
