"""DFlash2 drafters: the published layout, the forward against a reference written here from
the architecture's description, the selector's walk, lossless drafting, config checks."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file
from test_dflash import _rms, slow_attention

from flash_planner.engine.generate import GenerationSettings, generate, prefill
from flash_planner.engine.loop.proposer import DFlashProposer
from flash_planner.engine.models.drafters.dflash import DraftConfig, DrafterError
from flash_planner.engine.models.drafters.selector import walk
from flash_planner.train.tiny import write_tiny_drafter

BLOCK, WINDOW = 8, 5           # a window shorter than the block: both of its sides matter
PROMPT = "open the top drawer, take the blue screwdriver"


@pytest.fixture(scope="module")
def target(checkpoints):
    return checkpoints("hybrid", init=0.25)


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory, target):
    return write_tiny_drafter(tmp_path_factory.mktemp("dflash2"), target, num_layers=2,
                              block_size=BLOCK, sliding_window=WINDOW,
                              layer_types=["sliding_attention"] * 2, dflash2={})


@pytest.fixture(scope="module")
def engine(target, drafter_dir, make_engine):
    return make_engine(target, drafter_path=str(drafter_dir), method="dflash", window=12)


# ---- the reference: one position, one channel group, one candidate at a time -------------

def _conv(rows, base, proj_rows, side, kernel, group):
    """Side `side` of the grouped dynamic conv over block rows [T, H]: row i, tap t, channel
    c: (base[side, t, c] + delta of c's group) * rows[i - t, c], zero before the block."""
    t_len, hidden = rows.shape
    groups = hidden // group
    out = torch.zeros_like(rows)
    for i in range(t_len):
        delta = proj_rows[i].reshape(2, kernel, groups)
        for t in range(kernel):
            if i - t < 0:
                continue
            for c in range(hidden):
                out[i, c] += (base[side, t, c] + delta[side, t, c // group]) * rows[i - t, c]
    return out


def reference_scores(w, raw, embed, lm_head, taps, ctx_pos, anchor, start):
    """(candidates [B-1, K], the drafter's logits [B-1, V], the pair-score function)."""
    cfg = raw["dflash_config"]
    block, kernel, group = cfg["block_size"], cfg["conv_kernel_size"], cfg["conv_group_size"]
    feats = _rms(taps @ w["fc.weight"].T, w["hidden_norm.weight"])
    x = embed[[anchor] + [cfg["mask_token_id"]] * (block - 1)].clone()
    q_pos = list(range(start, start + block))
    for li in range(raw["num_hidden_layers"]):
        p = f"layers.{li}."

        def sandwich(conv, u, sublayer, p=p):
            base, proj = w[p + f"{conv}.base_kernel"], w[p + f"{conv}.kernel_projection.weight"]
            deltas = u @ proj.T
            inner = sublayer(_conv(u, base, deltas, 0, kernel, group))
            return _conv(inner, base, deltas, 1, kernel, group)

        def attention(h, p=p):
            return slow_attention(w, p, raw, feats, ctx_pos, h, q_pos,
                                  lambda qp, kp: abs(qp - kp) < raw["sliding_window"])

        def mlp(m, p=p):
            gate, up = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
            return (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T

        x = x + sandwich("attention_conv", _rms(x, w[p + "input_layernorm.weight"]), attention)
        x = x + sandwich("mlp_conv", _rms(x, w[p + "post_attention_layernorm.weight"]), mlp)
    hidden = _rms(x, w["norm.weight"])[1:]
    logits = hidden @ lm_head.T
    cand = logits.topk(cfg["selector_top_k"]).indices
    proj = hidden @ w["candidate_selector.hidden_projection.weight"].T
    pred_book = w["candidate_selector.predecessor_codebook"]
    succ_book = w["candidate_selector.successor_codebook"]

    def score(t, a, b):
        return logits[t, b] + (pred_book[a] * proj[t] * succ_book[b]).sum()

    return cand, logits, score


def reference_walk(cand, score, anchor):
    path, prev = [], anchor
    for t in range(cand.shape[0]):
        values = [float(score(t, prev, int(b))) for b in cand[t]]
        prev = int(cand[t][values.index(max(values))])
        path.append(prev)
    return path


def test_drafter_matches_the_reference_forward(engine, drafter_dir):
    proposer = engine.proposer
    assert isinstance(proposer, DFlashProposer) and proposer.drafter.cfg.selects
    prompt = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    engine.state.reset()
    logits, taps = prefill(engine, prompt, proposer.tap_ids, tail=12)
    proposer.begin(prompt, taps)
    anchor = int(logits.argmax())
    ours = proposer.propose(torch.tensor([anchor]), len(prompt), BLOCK - 1).tolist()

    raw = json.loads((drafter_dir / "config.json").read_text())
    weights = load_file(str(drafter_dir / "model.safetensors"))
    model = engine.model
    ctx_pos = list(range(len(prompt) - 12, len(prompt)))
    with torch.no_grad():
        cand, ref_logits, score = reference_scores(
            weights, raw, model.embed_tokens.weight, model.lm_head.weight, taps[0], ctx_pos,
            anchor, len(prompt))
    assert ours == reference_walk(cand, score, anchor)
    # the selector changed at least one draft from the plain argmax (else it went untested)
    assert ours != ref_logits.argmax(-1).tolist()

    drafter = proposer.drafter
    mask_id = raw["dflash_config"]["mask_token_id"]
    ids = torch.tensor([[anchor] + [mask_id] * (BLOCK - 1)])
    with torch.no_grad():
        hidden = drafter(model.embed_tokens(ids), len(prompt),
                         *proposer.window.context(torch.device("cpu"), torch.float32))[0, 1:]
        our_cand, our_scores = drafter.draft_output(hidden, model.lm_head.weight,
                                                    torch.tensor([anchor]))
    assert (drafter.draft_logits(hidden, model.lm_head.weight) - ref_logits).abs().max() < 1e-4
    assert torch.equal(our_cand, cand)
    for t in range(BLOCK - 1):
        preds = [anchor] * cand.shape[1] if t == 0 else cand[t - 1].tolist()
        for i, a in enumerate(preds):
            for j, b in enumerate(cand[t].tolist()):
                assert abs(float(our_scores[t, i, j]) - float(score(t, a, b))) < 1e-3


def test_the_walk_follows_pair_scores_not_the_best_of_each_row():
    cand = torch.tensor([[10, 11, 12], [20, 21, 22], [30, 31, 32]])
    scores = torch.zeros(3, 3, 3)
    scores[0, :] = torch.tensor([1.0, 3.0, 2.0])        # from the anchor: 11
    scores[1, 1] = torch.tensor([5.0, 0.0, 4.0])        # after 11: 20
    scores[1, 0] = torch.tensor([0.0, 9.0, 0.0])        # (after 10, never taken)
    scores[2, 0] = torch.tensor([0.0, 0.0, 7.0])        # after 20: 32
    scores[2, 1] = torch.tensor([8.0, 0.0, 0.0])
    assert walk(cand, scores).tolist() == [11, 20, 32]
    # a tie goes to the earlier candidate (the higher unary score: candidates are sorted)
    assert walk(cand[:1], torch.ones(1, 3, 3)).tolist() == [10]
    # a chooser sees the row after the predecessor it chose, with the position
    seen = []

    def last(row, t):
        seen.append((t, row.tolist()))
        return torch.tensor(2)

    assert walk(cand, scores, last).tolist() == [12, 22, 32]
    assert seen == [(0, [1.0, 3.0, 2.0]), (1, [0.0, 0.0, 0.0]), (2, [0.0, 0.0, 0.0])]


@pytest.mark.parametrize("block", [2, 4, 8])
@pytest.mark.parametrize("kv", ["fp32", "fp8"])
def test_greedy_drafting_is_lossless(engine, target, drafter_dir, make_engine, kv, block):
    eng = engine if kv == "fp32" else make_engine(target, drafter_path=str(drafter_dir),
                                                  method="dflash", kv_dtype=kv)
    prompt = eng.tokenizer.encode(PROMPT, add_special_tokens=False)
    ref = generate(eng, prompt, GenerationSettings(48, ignore_eos=True, speculative=False))
    dflash = eng.proposers["dflash"]
    proposer = DFlashProposer(dflash.drafter, dflash.embed, dflash.lm_head_weight,
                              block_size=block)
    got = generate(eng, prompt, GenerationSettings(48, ignore_eos=True), proposer=proposer)
    assert got.stats.drafted > 0
    assert got.token_ids == ref.token_ids


# ---- the published config ------------------------------------------------------------------

# z-lab/Qwen3.8-27B-DFlash2's config.json as published (fields and values)
PUBLISHED = {
    "architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "dtype": "bfloat16",
    "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 5,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 248320, "num_target_layers": 64, "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6, "rope_parameters": {"rope_theta": 10000000, "rope_type": "default"},
    "is_causal": False, "layer_types": ["sliding_attention"] * 5, "sliding_window": 2048,
    "use_sliding_window": True, "max_window_layers": 5, "attention_bias": False,
    "tie_word_embeddings": False, "hidden_act": "silu",
    "dflash_config": {"block_size": 8, "conv_group_size": 16, "conv_kernel_size": 2,
                      "mask_token_id": 248070, "selector_rank": 256, "selector_top_k": 16,
                      "target_layer_ids": [5, 19, 33, 47, 61]},
}


def test_the_published_config_is_read_field_by_field():
    cfg = DraftConfig.from_hf_dict(PUBLISHED, "config.json")
    assert (cfg.architecture, cfg.block_size, cfg.mask_token_id) == (
        "DFlash2DraftModel", 8, 248070)
    assert cfg.tap_ids == (5, 19, 33, 47, 61) and cfg.num_target_layers == 64
    assert cfg.layer_causal == (False,) * 5 and cfg.layer_window == (2048,) * 5
    assert (cfg.conv_kernel_size, cfg.conv_group_size) == (2, 16)
    assert (cfg.selector_rank, cfg.selector_top_k) == (256, 16) and cfg.selects
    assert cfg.rope.theta == 1e7 and cfg.rms_norm_eps == 1e-6
    assert (cfg.output_multiplier, cfg.final_logit_softcapping) == (1.0, None)
    again = DraftConfig.from_hf_dict(cfg.to_hf_dict(), "written")
    assert again == cfg


def test_the_module_has_the_published_tensor_names_and_shapes():
    from flash_planner.engine.models.drafters.dflash import DFlashDrafter

    with torch.device("meta"):
        model = DFlashDrafter(DraftConfig.from_hf_dict(PUBLISHED, "config.json"))
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    assert shapes["layers.0.attention_conv.base_kernel"] == (2, 2, 5120)
    assert shapes["layers.4.mlp_conv.kernel_projection.weight"] == (1280, 5120)
    assert shapes["candidate_selector.hidden_projection.weight"] == (256, 5120)
    assert shapes["candidate_selector.predecessor_codebook"] == (248320, 256)
    assert shapes["candidate_selector.successor_codebook"] == (248320, 256)
    assert shapes["fc.weight"] == (5120, 5 * 5120)
    assert len(shapes) == 3 + 15 * 5 + 3


def test_logit_settings_in_dflash_config_are_honoured():
    raw = copy.deepcopy(PUBLISHED)
    raw["dflash_config"].update(output_multiplier=0.25, final_logit_softcapping=20.0)
    cfg = DraftConfig.from_hf_dict(raw, "config.json")
    assert (cfg.output_multiplier, cfg.final_logit_softcapping) == (0.25, 20.0)


def _without(key):
    raw = copy.deepcopy(PUBLISHED)
    raw["dflash_config"].pop(key)
    return raw


@pytest.mark.parametrize("raw,match", [
    (_without("block_size"), r"needs block_size .*never taken as 16"),
    (_without("selector_top_k"), r"needs selector_top_k"),
    (_without("conv_kernel_size"), r"needs conv_kernel_size"),
    ({**PUBLISHED, "layer_types": None}, r"needs layer_types"),
    ({**PUBLISHED, "dflash_config": {**PUBLISHED["dflash_config"], "selector_beam": 4}},
     r"dflash_config selector_beam not supported"),
    ({**PUBLISHED, "attention_bias": True}, r"attention_bias"),
    ({**PUBLISHED, "hidden_act": "gelu"}, r"hidden_act 'gelu'"),
    ({**PUBLISHED, "architectures": ["DFlash3DraftModel"]}, r"DFlash3DraftModel.*supported"),
])
def test_a_config_field_we_cannot_honour_is_refused_by_name(raw, match):
    with pytest.raises(DrafterError, match=match):
        DraftConfig.from_hf_dict(raw, "config.json")


@pytest.mark.parametrize("edit,match", [
    ({"conv_group_size": 24}, r"conv_group_size 24.*dividing hidden_size 64"),
    ({"selector_top_k": 100000}, r"selector_top_k 100000"),
])
def test_settings_that_do_not_fit_the_target_are_refused(tmp_path, target, make_engine, edit,
                                                         match):
    path = write_tiny_drafter(tmp_path / "d", target, num_layers=1, block_size=4,
                              layer_types=["sliding_attention"], dflash2={})
    raw = json.loads((path / "config.json").read_text())
    raw["dflash_config"].update(edit)
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(DrafterError, match=match):
        make_engine(target, drafter_path=str(path), method="dflash")


def test_a_dflash_drafter_grown_into_dflash2_drafts_as_before(tmp_path, make_engine):
    """grow(): identity convs and a zero successor codebook leave the pair scores equal to
    the head's logits, so the demo's drafter grown into DFlash2 (before any training) gives
    the same tokens and the same acceptance."""
    from flash_planner.planning.presets import asset_path
    from flash_planner.train.drafter import save_drafter
    from flash_planner.train.drafter2 import SelectorSpec, grow

    target, drafter = asset_path("@assets/demo/target"), asset_path("@assets/demo/drafter")
    grown = save_drafter(grow(drafter, SelectorSpec()), tmp_path / "grown")
    runs = []
    for path in (drafter, grown):
        engine = make_engine(target, drafter_path=str(path), method="dflash")
        assert engine.proposer.drafter.cfg.selects == (path == grown)
        runs.append(generate(engine, "bring the red cup to the sink",
                             GenerationSettings(48, ignore_eos=True)))
    assert runs[0].token_ids == runs[1].token_ids
    assert runs[0].stats.accept_hist == runs[1].stats.accept_hist
    assert runs[0].stats.accepted > 0


def test_auto_routes_between_the_dflash2_drafter_mtp_and_plain(checkpoints, drafter_dir,
                                                                make_engine):
    """auto measures the DFlash2 drafter as it measures a DFlash one: lossless, and it
    routes cycles to it among MTP and plain decoding."""
    from flash_planner.engine.loop.auto_proposer import AutoProposer

    target = checkpoints("hybrid", init=0.25, mtp=True)
    drafter = write_tiny_drafter(drafter_dir.parent / "auto2", target, num_layers=2,
                                 block_size=BLOCK, sliding_window=WINDOW,
                                 layer_types=["sliding_attention"] * 2, dflash2={})
    engine = make_engine(target, drafter_path=str(drafter), method="auto")
    assert isinstance(engine.proposer, AutoProposer)
    assert set(engine.proposers) == {"dflash", "mtp", "auto"}
    prompt = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    ref = generate(engine, prompt, GenerationSettings(64, ignore_eos=True, speculative=False))
    got = generate(engine, prompt, GenerationSettings(64, ignore_eos=True))
    assert got.token_ids == ref.token_ids
    assert got.stats.method_cycles.get("dflash", 0) > 0
