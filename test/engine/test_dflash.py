"""The DFlash drafter: upstream-format loading, parity with a direct re-implementation, errors."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file

from flash_planner.engine.checkpoint import read_config
from flash_planner.engine.generate import prefill
from flash_planner.engine.loop.proposer import DFlashProposer
from flash_planner.engine.models.drafters.dflash import DrafterError, default_tap_ids, load_drafter
from flash_planner.train.tiny import write_tiny_drafter


@pytest.fixture(scope="module")
def target(checkpoints):
    return checkpoints("hybrid")


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory, target):
    return write_tiny_drafter(tmp_path_factory.mktemp("drafter"), target, num_layers=3,
                              block_size=8, sliding_window=5,
                              layer_types=["sliding_attention", "full_attention",
                                           "sliding_attention"])


# ---- a slow, direct re-implementation from the weights and the written description ----

def _rms(x, w, eps=1e-6):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):
    d = x.shape[-1]
    out = torch.empty_like(x)
    for j in range(d // 2):
        freq = pos * theta ** (-2 * j / d)
        c, s = math.cos(freq), math.sin(freq)
        out[j] = x[j] * c - x[j + d // 2] * s
        out[j + d // 2] = x[j + d // 2] * c + x[j] * s
    return out


def slow_attention(w, p, raw, feats, ctx_pos, h, q_pos, visible):
    """A draft layer's attention written out (weights `w`, layer prefix `p`): per head, keys
    and values of the context features and then of the block rows h (k_norm, RoPE at their
    positions), each block query over the keys at k_pos that visible(q_pos, k_pos) admits;
    returns the o_proj output [B, hidden]."""
    heads, kv_heads, d = raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"]
    theta = raw["rope_parameters"]["rope_theta"]
    block = h.shape[0]
    out = torch.zeros(block, heads * d)
    for hi in range(heads):
        kv = hi // (heads // kv_heads)
        sl_q, sl_k = slice(hi * d, (hi + 1) * d), slice(kv * d, (kv + 1) * d)
        wq, wk, wv = (w[p + f"self_attn.{n}_proj.weight"] for n in "qkv")
        keys, vals, k_pos = [], [], []
        for rows, positions in ((feats, ctx_pos), (h, q_pos)):
            for r, pos in zip(rows, positions):
                k = _rms(r @ wk[sl_k].T, w[p + "self_attn.k_norm.weight"])
                keys.append(_rope(k, pos, theta))
                vals.append(r @ wv[sl_k].T)
                k_pos.append(pos)
        for qi in range(block):
            q = _rope(_rms(h[qi] @ wq[sl_q].T, w[p + "self_attn.q_norm.weight"]),
                      q_pos[qi], theta)
            scores = [q @ k / math.sqrt(d) if visible(q_pos[qi], kp) else
                      torch.tensor(-math.inf) for k, kp in zip(keys, k_pos)]
            prob = torch.softmax(torch.stack(scores), 0)
            out[qi, sl_q] = sum(pr * v for pr, v in zip(prob, vals))
    return out @ w[p + "self_attn.o_proj.weight"].T


def slow_drafts(w, raw, embed, lm_head, taps, ctx_pos, anchor, start):
    block = raw["dflash_config"]["block_size"]
    mask_id = raw["dflash_config"]["mask_token_id"]
    window = raw["sliding_window"]
    feats = _rms(taps @ w["fc.weight"].T, w["hidden_norm.weight"])            # [C, H]
    x = embed[[anchor] + [mask_id] * (block - 1)]                              # [B, H]
    q_pos = list(range(start, start + block))
    for li, kind in enumerate(raw["layer_types"]):
        p = f"layers.{li}."
        h = _rms(x, w[p + "input_layernorm.weight"])

        def visible(qp, kp, kind=kind):
            return kind == "full_attention" or (kp <= qp and qp - kp < window)

        x = x + slow_attention(w, p, raw, feats, ctx_pos, h, q_pos, visible)
        m = _rms(x, w[p + "post_attention_layernorm.weight"])
        gate, up = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    logits = _rms(x, w["norm.weight"])[1:] @ lm_head.T
    return logits.argmax(-1).tolist(), logits


def test_drafter_matches_a_direct_reimplementation(target, drafter_dir, make_engine):
    engine = make_engine(target, drafter_path=str(drafter_dir), window=12, method="dflash")
    proposer = engine.proposer
    assert isinstance(proposer, DFlashProposer) and proposer.block_size == 8
    prompt = engine.tokenizer.encode("pick up the red cup and place it on the kitchen table",
                                     add_special_tokens=False)
    engine.state.reset()
    logits, taps = prefill(engine, prompt, proposer.tap_ids, tail=12)
    proposer.begin(prompt, taps)
    anchor = int(logits.argmax())
    ours = proposer.propose(torch.tensor([anchor]), len(prompt), 7).tolist()

    raw = json.loads((drafter_dir / "config.json").read_text())
    weights = load_file(str(drafter_dir / "model.safetensors"))
    model = engine.model
    ctx_pos = list(range(len(prompt) - 12, len(prompt)))
    slow, slow_logits = slow_drafts(weights, raw, model.embed_tokens.weight,
                                    model.lm_head.weight, taps[0], ctx_pos, anchor,
                                    len(prompt))
    assert ours == slow
    ours_logits = proposer.drafter.draft_logits(
        proposer.drafter(model.embed_tokens(torch.tensor(
            [[anchor] + [raw["dflash_config"]["mask_token_id"]] * 7])), len(prompt),
            *proposer.window.context(torch.device("cpu"), torch.float32))[0, 1:],
        model.lm_head.weight)
    assert (ours_logits - slow_logits).abs().max() < 1e-4


def test_default_tap_ids_follow_the_upstream_rule():
    assert default_tap_ids(64, 5) == (1, 16, 31, 46, 61)
    assert default_tap_ids(36, 5) == (1, 9, 17, 25, 33)
    assert default_tap_ids(36, 1) == (18,)


def test_missing_tap_ids_fall_back(tmp_path, target):
    path = write_tiny_drafter(tmp_path / "d", target, num_layers=2, omit_tap_ids=True)
    drafter = load_drafter(path, read_config(target), torch.float32, "cpu")
    assert drafter.cfg.tap_ids == default_tap_ids(4, 2)


def _edited(tmp_path, drafter_dir, edit):
    dst = tmp_path / "edited"
    shutil.copytree(drafter_dir, dst)
    raw = json.loads((dst / "config.json").read_text())
    edit(raw)
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


@pytest.mark.parametrize("edit,match", [
    (lambda r: r.update(hidden_size=32), "hidden_size 32 != target's 64"),
    (lambda r: r.update(vocab_size=1000), "vocab_size 1000"),
    (lambda r: r["dflash_config"].update(target_layer_ids=[1, 9]),
     r"target_layer_ids \[9\] outside the target's 4 layers"),
    (lambda r: r["dflash_config"].pop("mask_token_id"), "mask_token_id is missing"),
    (lambda r: r.update(architectures=["DFlash2DraftModel"]), "DFlash2"),
    (lambda r: r.update(num_target_layers=64), "trained for a 64-layer target"),
], ids=["hidden", "vocab", "taps", "mask", "dflash2", "target-layers"])
def test_drafter_that_does_not_fit_is_refused(tmp_path, target, drafter_dir, edit, match):
    path = _edited(tmp_path, drafter_dir, edit)
    with pytest.raises(DrafterError, match=match):
        load_drafter(path, read_config(target), torch.float32, "cpu")


def test_missing_or_broken_drafter_fails_at_engine_load(tmp_path, target, drafter_dir,
                                                        make_engine):
    with pytest.raises(DrafterError, match="does not exist"):
        make_engine(target, drafter_path=str(tmp_path / "nope"))
    dst = tmp_path / "broken"
    shutil.copytree(drafter_dir, dst)
    weights = load_file(str(dst / "model.safetensors"))
    weights.pop("layers.1.self_attn.o_proj.weight")
    from safetensors.torch import save_file
    save_file(weights, str(dst / "model.safetensors"))
    with pytest.raises(DrafterError, match="missing tensor.*layers.1.self_attn.o_proj.weight"):
        make_engine(target, drafter_path=str(dst))


def test_config_written_by_to_hf_dict_reads_back_identically(drafter_dir):
    from flash_planner.engine.models.drafters.dflash import DraftConfig

    raw = json.loads((drafter_dir / "config.json").read_text())
    cfg = DraftConfig.from_hf_dict(raw, "drafter")
    assert DraftConfig.from_hf_dict(cfg.to_hf_dict(), "again") == cfg
