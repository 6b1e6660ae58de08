"""Our models against transformers' reference implementation on the same checkpoints."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    AutoModelForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForConditionalGeneration,
)

from flash_planner.engine.checkpoint import load_checkpoint
from flash_planner.engine.generate import GenerationSettings, generate
from flash_planner.engine.state.cache import InferenceState

CUDA = torch.cuda.is_available()
KINDS = ["hybrid", "hybrid_vl", "dense", "hybrid_moe", "hybrid_moe_vl", "dense_moe"]
WRAPPED = {"hybrid_vl": Qwen3_5ForConditionalGeneration,
           "hybrid_moe_vl": Qwen3_5MoeForConditionalGeneration}
TOL = {torch.float32: 1e-4, torch.bfloat16: 0.15}


def _reference(path, kind, device, dtype):
    cls = WRAPPED.get(kind, AutoModelForCausalLM)
    return cls.from_pretrained(str(path), dtype=dtype).to(device).eval()


def _state(ckpt, device, dtype, capacity=256):
    return InferenceState(ckpt.config, capacity, 16, dtype, dtype, torch.device(device))


# CPU runs fp32 (the engine's CPU default); CUDA runs both fp32 and bf16 (and the CPU the
# MoE kinds in bf16 too: test_bf16_moe_differs_from_transformers_only_after_a_routing_tie).
PLACES = [("cpu", torch.float32)] + [
    pytest.param("cuda", dt, marks=pytest.mark.skipif(not CUDA, reason="no CUDA GPU"),
                 id=f"cuda-{name}") for dt, name in ((torch.float32, "fp32"),
                                                    (torch.bfloat16, "bf16"))]


def first_routing_flip(ckpt, path, kind, ids, device, dtype) -> bool:
    """Whether our MoE routes some row to other experts than transformers does; if so, the
    first layer where that happens must show a tie, not a defect: for each such row,
    transformers' gap between its k-th and (k+1)-th router logits is within the difference
    our router logits have from its (bf16 rounding carried from the layers before, each
    within bf16 noise of the reference), and every layer before routes every row alike."""
    ours, theirs = {}, {}
    ref = _reference(path, kind, device, dtype)
    for i, (mine, their) in enumerate(zip(ckpt.model.layers, _text_layers(ref))):
        if getattr(mine.mlp, "gate", None) is None:
            continue                                   # a dense MLP layer (mlp_only_layers)
        mine.mlp.gate.register_forward_hook(
            lambda m, a, o, i=i: ours.__setitem__(i, F.linear(a[0], m.weight).float()))
        # from the router's input: what its forward returns first changed over transformers'
        # versions (5.2: the softmax; 5.24: the logits)
        their.mlp.gate.register_forward_hook(lambda m, a, o, i=i: theirs.__setitem__(
            i, F.linear(a[0].reshape(-1, m.weight.shape[1]), m.weight).float()))
    ckpt.model(ids, _state(ckpt, device, dtype), all_logits=True)
    with torch.no_grad():
        ref(input_ids=ids)
    k = ckpt.config.moe.top_k
    for i in sorted(ours):
        mine, ref_logits = ours[i].reshape(theirs[i].shape), theirs[i]
        # up to the first flip every router sees what the reference's sees, to bf16 noise
        moved = (mine - ref_logits).abs().amax(-1)
        assert moved.max().item() <= TOL[dtype], (
            f"layer {i}: router logits off by {moved.max().item()} before any expert differs")
        flips = (mine.topk(k).indices.sort().values
                 != ref_logits.topk(k).indices.sort().values).any(-1).nonzero().flatten()
        for row in flips.tolist():
            ranked = ref_logits[row].sort(descending=True).values
            gap = (ranked[k - 1] - ranked[k]).item()
            assert gap <= 2 * moved[row].item(), (
                f"layer {i} row {row}: experts differ although the reference's top-{k} gap "
                f"{gap} exceeds twice our router's difference {moved[row].item()}")
        if len(flips):
            return True
    return False


def _text_layers(model):
    inner = model.model
    return (inner.language_model if hasattr(inner, "language_model") else inner).layers


@pytest.mark.parametrize("device,dtype", PLACES)
@pytest.mark.parametrize("kind", KINDS)
def test_prefill_logits_and_taps_match_transformers(checkpoints, kind, dtype, device):
    path = checkpoints(kind)
    ckpt = load_checkpoint(path, dtype=dtype, device=device)
    n = ckpt.config.num_layers
    ids = torch.randint(0, ckpt.config.vocab_size, (1, 24), generator=torch.Generator()
                        .manual_seed(1)).to(device)
    out = ckpt.model(ids, _state(ckpt, device, dtype), all_logits=True,
                     taps=tuple(range(n)))
    with torch.no_grad():
        ref = _reference(path, kind, device, dtype)(input_ids=ids, output_hidden_states=True)
    tol = TOL[dtype]
    if dtype == torch.bfloat16 and "moe" in kind and first_routing_flip(ckpt, path, kind,
                                                                        ids, device, dtype):
        return      # a bf16 near-tie chose another expert (checked there); past it, no parity
    assert (out.logits - ref.logits.float()).abs().max().item() <= tol
    # hidden_states[L+1] is the output of decoder layer L; the last one is after the final
    # norm in transformers, and so is our tap of the last layer (what drafters consume)
    for layer in range(n):
        diff = (out.taps[layer] - ref.hidden_states[layer + 1]).float().abs().max().item()
        assert diff <= tol * 10, f"tap {layer}: {diff}"


@pytest.mark.parametrize("kind", [k for k in KINDS if "moe" in k])
def test_bf16_moe_differs_from_transformers_only_after_a_routing_tie(checkpoints, kind):
    """In bf16 the tiny hybrid MoE's logits differ from transformers' by ~1 (on CUDA as on a
    CPU): bf16 rounding, different in the two implementations, meets a near-tie of two
    experts' router logits and one row takes another expert; the check is that exactly this
    happened (`first_routing_flip`), or else that the logits agree."""
    dtype = torch.bfloat16
    ckpt = load_checkpoint(checkpoints(kind), dtype=dtype)
    ids = torch.randint(0, ckpt.config.vocab_size, (1, 24), generator=torch.Generator()
                        .manual_seed(1))
    if first_routing_flip(ckpt, checkpoints(kind), kind, ids, "cpu", dtype):
        return
    out = ckpt.model(ids, _state(ckpt, "cpu", dtype), all_logits=True)
    with torch.no_grad():
        ref = _reference(checkpoints(kind), kind, "cpu", dtype)(input_ids=ids)
    assert (out.logits - ref.logits.float()).abs().max().item() <= TOL[dtype]


@pytest.mark.parametrize("kind", ["hybrid", "dense", "hybrid_moe"])
def test_chunked_prefill_and_stepwise_decode_match_full_forward(checkpoints, kind):
    ckpt = load_checkpoint(checkpoints(kind))
    ids = torch.randint(0, ckpt.config.vocab_size, (1, 30),
                        generator=torch.Generator().manual_seed(2))
    state = _state(ckpt, "cpu", torch.float32)
    full = ckpt.model(ids, state, all_logits=True).logits[0]
    state.reset()
    for start in range(0, 18, 7):  # chunks of 7, 7, 4
        piece = ids[:, start:min(start + 7, 18)]
        out = ckpt.model(piece, state, all_logits=True).logits[0]
        state.commit(piece.shape[1])
        assert (out - full[start:start + piece.shape[1]]).abs().max() <= 1e-4
    for t in range(18, 30):
        out = ckpt.model(ids[:, t:t + 1], state).logits[0, -1]
        state.commit(1)
        assert (out - full[t]).abs().max() <= 1e-4, f"decode step {t}"


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_generation_equals_transformers_generate(checkpoints, make_engine, kind):
    path = checkpoints(kind)
    engine = make_engine(path, prefill_chunk=5)
    prompt = engine.tokenizer.encode("pick up the red cup", add_special_tokens=False)
    result = generate(engine, prompt, GenerationSettings(max_new_tokens=32))
    hf = _reference(path, kind, "cpu", torch.float32)
    with torch.no_grad():  # both stop at EOS and include it
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                          pad_token_id=0)
    assert result.token_ids == ref[0, len(prompt):].tolist()
    expected = "eos" if result.token_ids[-1] in engine.eos_ids() else "length"
    assert result.finish_reason == expected
