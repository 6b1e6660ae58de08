"""Prefix state snapshots (engine/state/prefix.py): restoring gives the bits of a fresh prefill.

A prompt with a declared prefix is always prefilled in two parts, so with and without a
snapshot the same chunks run: the state after the prefix, and every generated token, must
be identical, for fp32 and FP8 KV, with speculation on and off, thinking on and off.
"""

from __future__ import annotations

import logging

import pytest
import torch

from flash_planner.engine.engine import Engine
from flash_planner.engine.generate import GenerationSettings, generate
from flash_planner.engine.inputs.chat import encode_chat_parts
from flash_planner.planning.presets import ModelPreset, default_skills_path
from flash_planner.planning.prompt import build_messages
from flash_planner.planning.skills import SkillCatalog
from flash_planner.train.corpus import make_corpus


def _state(engine) -> list[torch.Tensor]:
    kv, gdn, n = engine.state.kv, engine.state.gdn, engine.state.length
    return [kv.k[:, :, :n].clone(), kv.v[:, :, :n].clone(), kv.k_scale.clone(),
            kv.v_scale.clone(), gdn.state.clone(), gdn.conv.clone()]


def _prompt(engine, catalog, example, thinking):
    ids, starts = encode_chat_parts(engine.tokenizer,
                                    build_messages(catalog, example.task, example.context),
                                    thinking)
    return ids, ids[:starts[-1]]


@pytest.fixture(scope="module")
def catalog():
    return SkillCatalog.from_yaml(default_skills_path())


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_tokens_with_the_snapshot_equal_tokens_without_it(catalog, kv):
    engines = {cache: Engine.load(ModelPreset.load("demo").engine_config(
        device="cpu", dtype="fp32", kv_dtype=kv, prefix_cache=cache)) for cache in (True, False)}
    hits = 0
    for i, example in enumerate(make_corpus(0, n_train=0, n_heldout=24)[1]):
        thinking = i % 2 == 0
        method = ("none", "dflash", "mtp")[i % 3]
        settings = GenerationSettings(160, method=method, enable_thinking=thinking)
        ids, prefix = _prompt(engines[True], catalog, example, thinking)
        got = {}
        for cache, engine in engines.items():
            got[cache] = generate(engine, ids, settings, prefix=prefix)
        assert got[True].token_ids == got[False].token_ids, (example.task, method, thinking)
        stats = got[True].stats
        assert stats.prefix_tokens == len(prefix) and got[False].stats.prefix_hit is False
        hits += stats.prefix_hit
    assert hits == 23                        # every request after the first restores it
    assert len(engines[True].prefix_cache) == 1 and engines[False].prefix_cache is None


def test_the_restored_state_is_the_fresh_prefill_bit_for_bit(checkpoints, make_engine):
    # a prefix longer than a prefill chunk, FP8 KV: chunking and calibration both matter
    engine = make_engine(checkpoints("hybrid"), kv_dtype="fp8", prefill_chunk=16)
    tok = engine.tokenizer
    prefix = tok.encode("plan with these skills: pick, place, open, close, wait, say and go "
                        "to the kitchen or the hall", add_special_tokens=False)
    assert len(prefix) > 16
    prompts = [prefix + tok.encode(f" task {t}", add_special_tokens=False)
               for t in ("bring the cup", "open the door and wait")]
    settings = GenerationSettings(1, speculative=False)
    generate(engine, prompts[0], settings, prefix=prefix)          # takes the snapshot
    snapshots = []
    for cache in (True, False):
        if not cache:
            engine.prefix_cache.clear()
        out = generate(engine, prompts[1], settings, prefix=prefix)
        assert out.stats.prefix_hit is cache
        snapshots.append(_state(engine))
    for a, b in zip(*snapshots):
        assert torch.equal(a, b)


def test_a_prompt_that_does_not_start_with_the_prefix_is_prefilled_whole(
        checkpoints, make_engine, caplog):
    engine = make_engine(checkpoints("hybrid"))
    ids = engine.tokenizer.encode("open the door", add_special_tokens=False)
    with caplog.at_level(logging.INFO, logger="flash_planner.engine.prefill"):
        out = generate(engine, ids, GenerationSettings(4, speculative=False),
                       prefix=[ids[0] + 1, ids[1]])
    assert out.stats.prefix_hit is None and out.stats.prefix_tokens == 0
    assert "token boundary" in caplog.text
    plain = generate(engine, ids, GenerationSettings(4, speculative=False))
    assert out.token_ids == plain.token_ids


def test_the_cache_keeps_the_most_recently_used_prefixes(checkpoints, make_engine):
    engine = make_engine(checkpoints("hybrid"), prefix_cache_entries=2)
    tok = engine.tokenizer
    prefixes = [tok.encode(f"system {w}:", add_special_tokens=False)
                for w in ("one", "two", "three")]
    task = tok.encode(" pick the cup", add_special_tokens=False)
    settings = GenerationSettings(2, speculative=False)

    def hit(p):
        return generate(engine, p + task, settings, prefix=p).stats.prefix_hit

    assert [hit(p) for p in prefixes] == [False, False, False]
    assert len(engine.prefix_cache) == 2 and engine.prefix_cache.nbytes > 0
    out = generate(engine, prefixes[1] + task, settings, prefix=prefixes[1])
    assert out.stats.as_dict()["prefix_cache_bytes"] == engine.prefix_cache.nbytes
    assert hit(prefixes[2]) and hit(prefixes[1]) and not hit(prefixes[0])   # 0 was dropped
    assert not hit(prefixes[2])             # and 0 pushed out the least recently used, 2


def test_the_mtp_head_cache_of_the_prefix_is_restored_not_recomputed(catalog):
    engines = {cache: Engine.load(ModelPreset.load("demo").engine_config(
        device="cpu", dtype="fp32", prefix_cache=cache)) for cache in (True, False)}
    heldout = make_corpus(0, n_train=0, n_heldout=3)[1]
    settings = GenerationSettings(120, method="mtp", enable_thinking=False)
    for i, example in enumerate(heldout):
        ids, prefix = _prompt(engines[True], catalog, example, False)
        heads = {c: e.proposers["mtp"].state for c, e in engines.items()}
        n = len(prefix) - 1
        at_first_token = {}

        def first(c, seen=at_first_token, state=heads):
            return lambda _ids, _text: seen.setdefault(c, state[c].length)

        outs = {c: generate(e, ids, settings, on_token=first(c), prefix=prefix)
                for c, e in engines.items()}
        assert outs[True].token_ids == outs[False].token_ids
        assert outs[True].stats.prefix_hit is (i > 0)
        # after begin, before the first draft: with the cache the head holds the prefix's
        # entries (a miss computes them with the snapshot), without it none yet
        assert at_first_token == {True: n, False: 0}
        assert all(heads[c].length > n for c in (True, False))
        # the restored entries are the ones a catch-up computes (other chunks: fp32 close)
        for name in ("k", "v"):
            a, b = (getattr(heads[c].kv, name)[:, :, :n] for c in (True, False))
            assert torch.allclose(a, b, atol=1e-5), name
    snap = engines[True].prefix_cache.get(prefix)
    assert snap.proposer_states["mtp"].state.length == len(prefix) - 1
    assert snap.nbytes > snap.state.k.nbytes + snap.state.gdn_state.nbytes


def test_a_proposer_tapping_layers_the_snapshot_lacks_prefills_the_prefix_again(
        checkpoints, make_engine, tmp_path):
    from flash_planner.engine.loop.proposer import DFlashProposer
    from flash_planner.engine.models.drafters.dflash import load_drafter
    from flash_planner.train.tiny import write_tiny_drafter

    path = checkpoints("hybrid")
    engine = make_engine(path)                       # no proposer loaded: no taps kept
    drafter = load_drafter(write_tiny_drafter(tmp_path / "d", path, num_layers=2,
                                              block_size=4), engine.model_config,
                           torch.float32, engine.device)
    tok = engine.tokenizer
    prefix = tok.encode("plan with these skills: pick, place", add_special_tokens=False)
    ids = prefix + tok.encode(" bring the cup", add_special_tokens=False)
    settings = GenerationSettings(12, ignore_eos=True)

    def proposer():
        return DFlashProposer(drafter, engine.model.embed_tokens, engine.model.output_weight)

    generate(engine, ids, settings, prefix=prefix)
    assert len(engine.prefix_cache) == 1 and not engine.prefix_cache.get(prefix).taps
    out = generate(engine, ids, settings, proposer=proposer(), prefix=prefix)
    assert out.stats.prefix_hit is False
    assert out.token_ids == generate(engine, ids, settings, proposer=proposer()).token_ids
