"""The engine with every hot-path op on its Triton kernel: the same tokens as the references.

Forced with `set_backend("triton")` (interpreted on a CPU, compiled on a CUDA GPU, where
the engine is built): FP8 KV appends, the GDN verify recurrence keeping its rows, the
commit that replays the accepted ones and acceptance all run as kernels inside real
speculative decoding, against the same request on the torch references.
"""

from __future__ import annotations

import pytest
import torch

from flash_planner.engine.generate import GenerationSettings, generate
from flash_planner.engine.loop.proposer import ReplayProposer
from flash_planner.kernels import dispatch
from flash_planner.kernels.specs import record_launches

# Triton runs on a CPU only in its interpreter: with a GPU the engines live on it
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Targets of one GDN and one attention layer: every kind of layer, half the interpreted
# launches of the tiny default's four
LAYERS = 2


@pytest.fixture
def triton_backend():
    dispatch.set_backend("triton")
    probe = torch.zeros(1, device=DEVICE)
    for op in ("gdn_steps", "kv_append", "gdn_commit", "accept_rows"):
        assert dispatch._pick(op, None, probe) is dispatch.TRITON_OPS[op], op
    yield
    dispatch.set_backend("auto")


def _run(engine, prompt, ref, relaxed=False):
    replay = ReplayProposer(ref, engine.model_config.vocab_size, block_size=8,
                            error_at=[0, 3, 7, 5, 1])
    return generate(engine, prompt, GenerationSettings(len(ref), ignore_eos=True,
                                                       relaxed_thinking=relaxed),
                    proposer=replay)


def _references_then_kernels(engine, request, new_tokens):
    """Plain greedy tokens, then the replayed speculative request on the references and on
    the kernels (the backend stays Triton for the rest of the test)."""
    prompt = engine.tokenizer.encode("put the apple in the fridge", add_special_tokens=False)
    ref = generate(engine, prompt, GenerationSettings(new_tokens, ignore_eos=True,
                                                      speculative=False)).token_ids
    reference = _run(engine, prompt, ref)
    request.getfixturevalue("triton_backend")
    return ref, reference, _run(engine, prompt, ref)


@pytest.mark.parametrize("kv", ["fp32", "fp8"])
def test_speculative_decoding_on_kernels_matches_the_references(checkpoints, make_engine, kv,
                                                                request):
    engine = make_engine(checkpoints("hybrid", layers=LAYERS), kv_dtype=kv, device=DEVICE)
    ref, reference, kernels = _references_then_kernels(engine, request, 24)
    assert kernels.token_ids == reference.token_ids == ref
    assert kernels.stats.accept_hist == reference.stats.accept_hist
    assert kernels.stats.cycles == reference.stats.cycles


@pytest.mark.parametrize("weights", ["fp8", "nvfp4", "int4"])
def test_quantized_weights_on_the_gemm_kernels_match_the_references(checkpoints, make_engine,
                                                                   weights, request):
    """The same speculative request with every Linear on its weight-only GEMM kernel: the
    skinny kernel for decode and verify rows, the fused gate and up projection among them,
    the tiled kernel for the prompt."""
    engine = make_engine(checkpoints("hybrid", layers=LAYERS), weights=weights, device=DEVICE)
    with record_launches() as launches:
        ref, reference, kernels = _references_then_kernels(engine, request, 12)
    op = f"{weights}_gemm"
    assert dispatch._pick(op, None, torch.zeros(1, device=DEVICE)) is dispatch.TRITON_OPS[op]
    assert kernels.token_ids == reference.token_ids == ref
    assert kernels.stats.accept_hist == reference.stats.accept_hist
    ran = {(spec.name, spec.constexprs.get("FORMAT"), spec.constexprs.get("GATED"))
           for spec in launches}
    assert {("_gemm_rows_kernel", weights, True), ("_gemm_rows_kernel", weights, False),
            ("_gemm_tiles_kernel", weights, None)} <= ran


@pytest.mark.parametrize("weights", ["auto", "fp8", "nvfp4", "int4"])
def test_moe_target_on_the_moe_kernels_matches_the_references(checkpoints, make_engine,
                                                              weights, request):
    """An MoE target's experts on the grouped GEMM kernels, full precision and quantized at
    load: the same speculative request as on the references, gate and up stacked per
    expert where they stack (not FP8 here: the tiny experts' I = 32 is under a block)."""
    engine = make_engine(checkpoints("hybrid_moe", layers=LAYERS), weights=weights,
                         device=DEVICE)
    with record_launches() as launches:
        ref, reference, kernels = _references_then_kernels(engine, request, 12)
    op = "moe_gemm" if weights == "auto" else f"moe_{weights}_gemm"
    assert dispatch._pick(op, None, torch.zeros(1, device=DEVICE)) is dispatch.TRITON_OPS[op]
    assert kernels.token_ids == reference.token_ids == ref
    assert kernels.stats.accept_hist == reference.stats.accept_hist
    fmt = "float" if weights == "auto" else weights
    gated = {spec.constexprs.get("GATED") for spec in launches
             if spec.name == "_gemm_rows_kernel" and spec.constexprs["ROUTED"]
             and spec.constexprs["FORMAT"] == fmt}
    assert gated == ({False} if weights == "fp8" else {True, False})
