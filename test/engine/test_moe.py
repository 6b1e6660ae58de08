"""Mixture-of-experts targets: Qwen3.5/3.6 MoE (text and multimodal layouts) and Qwen3 MoE.

Parity with transformers lives in test_parity.py (the MoE kinds are among its kinds); here:
the config, the router, the fused expert layout, losslessness of every method on an MoE
target with fp32 and FP8 KV, the MTP head's MoE layer, the routing record and the errors.
"""

from __future__ import annotations

import json

import pytest
import torch
from checkpoint_names import stored_name
from safetensors.torch import load_file, save_file
from test_mtp import VirtualClock

from flash_planner.engine.checkpoint import CheckpointError, load_checkpoint
from flash_planner.engine.config import ConfigError, ModelConfig
from flash_planner.engine.generate import GenerationSettings, generate
from flash_planner.engine.loop.auto_proposer import AutoProposer
from flash_planner.engine.loop.proposer import ReplayProposer
from flash_planner.engine.models.qwen.moe import Router, RoutingRecord, SparseMoeBlock
from flash_planner.engine.state.cache import InferenceState
from flash_planner.train.tiny import write_tiny_drafter

PROMPT = "open the top drawer, take the blue screwdriver"


def _raw(path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_config_reads_both_families(checkpoints):
    hybrid = ModelConfig.from_hf_dict(_raw(checkpoints("hybrid_moe")))
    assert hybrid.is_hybrid and hybrid.is_moe
    assert (hybrid.moe.num_experts, hybrid.moe.top_k, hybrid.moe.shared_intermediate) == (
        8, 2, 64)
    assert hybrid.moe.norm_topk and all(hybrid.is_sparse_layer(i) for i in range(4))
    vl = ModelConfig.from_hf_dict(_raw(checkpoints("hybrid_moe_vl")))
    assert vl.weight_prefix == "model.language_model." and vl.moe == hybrid.moe
    dense = ModelConfig.from_hf_dict(_raw(checkpoints("dense_moe")))
    assert not dense.is_hybrid and dense.moe.shared_intermediate == 0
    # transformers writes num_experts as num_local_experts; layer 1 is in mlp_only_layers
    assert dense.moe.num_experts == 8
    assert [dense.is_sparse_layer(i) for i in range(4)] == [True, False, True, True]


def test_decoder_sparse_step_and_missing_fields(checkpoints):
    raw = _raw(checkpoints("dense_moe"))
    stepped = ModelConfig.from_hf_dict({**raw, "decoder_sparse_step": 2, "mlp_only_layers": []})
    assert [stepped.is_sparse_layer(i) for i in range(4)] == [False, True, False, True]
    for field, value in (("moe_intermediate_size", None), ("num_experts_per_tok", 0),
                         ("num_experts_per_tok", 99)):
        bad = {**raw, field: value}
        with pytest.raises(ConfigError, match=field):
            ModelConfig.from_hf_dict(bad)
    text = _raw(checkpoints("hybrid_moe"))
    del text["shared_expert_intermediate_size"]
    with pytest.raises(ConfigError, match="shared_expert_intermediate_size"):
        ModelConfig.from_hf_dict(text)


@pytest.mark.parametrize("norm", [True, False])
def test_router_matches_the_definition(norm):
    router = Router(6, 8, 3, norm)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(5, 8)
    weights, ids = router(x)
    probs = torch.softmax(x @ router.weight.T, dim=-1)
    top = probs.topk(3, dim=-1)
    want = top.values / top.values.sum(-1, keepdim=True) if norm else top.values
    assert torch.equal(ids.long(), top.indices) and ids.dtype == torch.int32
    assert torch.allclose(weights, want, atol=1e-6)


def _tokens(engine, method, steps=40):
    prompt = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    return generate(engine, prompt, GenerationSettings(max_new_tokens=steps, ignore_eos=True,
                                                       method=method)).token_ids


@pytest.fixture(scope="module")
def moe_pair(checkpoints, tmp_path_factory):
    """A hybrid MoE target with an MoE MTP head, and a DFlash drafter for it."""
    target = checkpoints("hybrid_moe", mtp=True, init=0.25)
    drafter = write_tiny_drafter(tmp_path_factory.mktemp("moe_drafter"), target,
                                 block_size=6)
    return target, drafter


@pytest.mark.parametrize("kv", ["fp32", "fp8"])
def test_every_method_is_lossless_on_an_moe_target(moe_pair, make_engine, kv):
    target, drafter = moe_pair
    engine = make_engine(target, drafter_path=str(drafter), kv_dtype=kv)
    assert set(engine.proposers) == {"dflash", "mtp", "auto"}
    assert isinstance(engine.proposers["mtp"].head.layers[0].mlp, SparseMoeBlock)
    plain = _tokens(engine, "none")
    for method in ("dflash", "mtp", "auto"):
        assert _tokens(engine, method) == plain, method


def test_fused_expert_layout_loads_like_per_expert_tensors(checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM

    src = checkpoints("hybrid_moe")
    hf = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    fused = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in fused)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    save_file(fused, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    ids = torch.tensor([[3, 17, 42, 9, 100, 7]])
    outs = []
    for path in (src, tmp_path):
        ckpt = load_checkpoint(path)
        state = InferenceState(ckpt.config, 16, 1, torch.float32, torch.float32,
                               torch.device("cpu"))
        outs.append(ckpt.model(ids, state, all_logits=True).logits)
    assert torch.equal(outs[0], outs[1])
    with pytest.raises(CheckpointError, match="cannot be quantized at load"):
        load_checkpoint(tmp_path, weights="fp8")


@pytest.mark.parametrize("kind", ["hybrid_moe", "dense_moe"])
def test_a_sharded_moe_checkpoint_loads_and_matches_transformers(checkpoints, make_engine,
                                                                 kind):
    """Published MoE checkpoints come in many shards, one layer's experts spread over
    several: the loader opens each shard as an expert first needs it."""
    from transformers import AutoModelForCausalLM

    path = checkpoints(kind, max_shard_size="100KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    shards_of_layer0 = {file for name, file in index.items()
                        if name.startswith(stored_name(index, "model.layers.0.mlp.experts."))}
    assert len(set(index.values())) > 3 and len(shards_of_layer0) > 1
    engine = make_engine(path)
    prompt = engine.tokenizer.encode("pick up the red cup", add_special_tokens=False)
    result = generate(engine, prompt, GenerationSettings(max_new_tokens=16))
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():  # both stop at EOS and include it
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                          pad_token_id=0)
    assert result.token_ids == ref[0, len(prompt):].tolist()


def test_routing_record_counts_distinct_experts(checkpoints):
    ckpt = load_checkpoint(checkpoints("hybrid_moe"))
    state = InferenceState(ckpt.config, 32, 16, torch.float32, torch.float32,
                           torch.device("cpu"))
    record = RoutingRecord()
    ckpt.model(torch.tensor([[5, 6, 7, 8, 9]]), state, routing=record)
    assert len(record.ids) == 4 and record.ids[0].shape == (5, 2)
    counts = record.distinct_per_layer(8)
    for ids, n in zip(record.ids, counts.tolist()):
        assert n == len(set(ids.flatten().tolist()))
    assert all(block.record is None for block in ckpt.model.moe_blocks)


def test_a_missing_expert_is_named(checkpoints, tmp_path):
    src = checkpoints("hybrid_moe")
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    del tensors[stored_name(tensors, "model.layers.2.mlp.experts.5.up_proj.weight")]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"layers\.2\.mlp\.experts\.5\.up_proj"):
        load_checkpoint(tmp_path)


def test_moe_targets_refuse_exported_segments(checkpoints, make_engine):
    with pytest.raises(ValueError, match="mixture-of-experts"):
        make_engine(checkpoints("dense_moe"), dense_backend="onnxruntime")


class _BlockCost(ReplayProposer):
    """An exact replay whose cycle costs 0.02 k^2 ms for k drafts on the virtual clock: a
    verify whose cost grows faster than its accepted tokens, as a union of experts does."""

    def __init__(self, clock, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.clock = clock

        self.drafted: list[int] = []

    def propose(self, anchor, start, num):
        self.clock.now += 0.02 * num * num / 1000
        self.drafted.append(num)
        return super().propose(anchor, start, num)


def test_auto_measures_draft_lengths_on_an_moe_target(moe_pair, make_engine):
    target, drafter = moe_pair
    engine = make_engine(target, drafter_path=str(drafter))
    auto = engine.proposers["auto"]
    # the drafter's block of 6 drafts 5; the MTP head 3 (mtp_steps); plain decoding 0
    assert auto.candidates == {"dflash:1": ("dflash", 1), "dflash:2": ("dflash", 2),
                               "dflash:4": ("dflash", 4), "dflash:5": ("dflash", 5),
                               "mtp:1": ("mtp", 1), "mtp:2": ("mtp", 2),
                               "mtp:3": ("mtp", 3), "none": ("none", 0)}
    prompt = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    ref = generate(engine, prompt, GenerationSettings(300, ignore_eos=True, method="none"))
    # (k + 1) tokens for 0.5 + 0.02 k^2 ms: k = 4 publishes most per ms (6.1 tokens/ms;
    # 2: 5.2, 8: 5.1, 15: 3.2, 1: 3.8; plain decoding 2.0)
    clock = VirtualClock()
    replay = _BlockCost(clock, ref.token_ids, engine.model_config.vocab_size, block_size=16,
                        error_at=99)
    router = AutoProposer({"replay": replay}, None, probe_every=6, clock=clock,
                          lengths={"replay": (1, 2, 4, 8, 15)})
    got = generate(engine, prompt, GenerationSettings(300, ignore_eos=True), proposer=router)
    assert got.token_ids == ref.token_ids
    by_length = {}
    for k in replay.drafted:
        by_length[k] = by_length.get(k, 0) + 1
    assert max(by_length, key=by_length.get) == 4, by_length
    assert by_length[4] > sum(by_length.values()) / 2, by_length
    # every verify block size the run used has its experts-per-verify figure
    rows = got.stats.experts_per_verify
    assert set(rows) >= {5} and all(2 <= v <= 8 for v in rows.values()), rows


def test_a_drafter_sized_for_the_35b_a3b_loads_and_drafts(tmp_path):
    """The 35B-A3B's shapes (hidden 2048, 40 target layers, its 5 taps by the upstream rule
    as z-lab's drafters place them), a narrow MLP and vocabulary to stay small."""
    from weight_bytes import QWEN3_6_35B_A3B

    from flash_planner.engine.loop.proposer import DFlashProposer
    from flash_planner.engine.models.drafters.dflash import default_tap_ids, load_drafter

    raw = dict(QWEN3_6_35B_A3B, vocab_size=512)
    target_dir = tmp_path / "target"
    target_dir.mkdir()
    (target_dir / "config.json").write_text(json.dumps(raw))
    path = write_tiny_drafter(tmp_path / "drafter", target_dir, num_layers=5, block_size=16,
                              omit_tap_ids=True, intermediate=256)
    cfg = ModelConfig.from_hf_dict(raw)
    drafter = load_drafter(path, cfg, torch.float32, "cpu", "auto")
    assert drafter.cfg.hidden_size == 2048
    assert drafter.cfg.tap_ids == default_tap_ids(40, 5) == (1, 10, 19, 28, 37)
    gen = torch.Generator().manual_seed(0)
    embed = torch.nn.Embedding(512, 2048)
    proposer = DFlashProposer(drafter, embed, torch.randn(512, 2048, generator=gen) * 0.02,
                              window=32)
    prompt = list(range(20, 32))
    proposer.begin(prompt, torch.randn(1, len(prompt), 5 * 2048, generator=gen))
    drafts = proposer.propose(torch.tensor([7]), len(prompt), 15)
    assert drafts.shape == (15,) and int(drafts.max()) < 512
