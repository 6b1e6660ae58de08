"""The speculative transaction: lossless against plain greedy, state after every cycle, stops.

Exact identity is the contract. A verify over S rows and a decode over 1 row may round
differently, so a flip is tolerated only at a genuine near-tie: the reference top-2 logit
margin at the first divergence must be below 1e-3 (fp32), else the test fails.
"""

from __future__ import annotations

import pytest
import torch

from flash_planner.engine.generate import CancelToken, GenerationSettings, generate
from flash_planner.engine.loop.auto_proposer import AutoProposer
from flash_planner.engine.loop.mtp_proposer import MTPProposer
from flash_planner.engine.loop.proposer import DFlashProposer, ReplayProposer
from flash_planner.train.tiny import write_tiny_drafter

NEAR_TIE = 1e-3
PROMPT = "open the top drawer, take the blue screwdriver"


def _target(checkpoints, kind):
    """The hybrid target carries an MTP head, so its engines load dflash, mtp and auto."""
    return checkpoints(kind, **({"mtp": True} if kind == "hybrid" else {}))


@pytest.fixture(scope="module")
def drafters(tmp_path_factory, checkpoints):
    return {kind: write_tiny_drafter(tmp_path_factory.mktemp(f"drafter-{kind}"),
                                     _target(checkpoints, kind), num_layers=2, block_size=8)
            for kind in ("hybrid", "dense")}


@pytest.fixture(scope="module")
def engines(checkpoints, drafters, make_engine):
    cache = {}

    def get(kind: str, kv: str):
        if (kind, kv) not in cache:
            cache[kind, kv] = make_engine(_target(checkpoints, kind), kv_dtype=kv,
                                          drafter_path=str(drafters[kind]))
        return cache[kind, kv]

    return get


def _proposer(engine, source, block, ref):
    """A proposer of `source` drafting block-1 tokens per cycle."""
    vocab = engine.model_config.vocab_size
    if source == "replay":
        return ReplayProposer(ref, vocab, block_size=block, seed=block)
    dflash, mtp = engine.proposers["dflash"], engine.proposers.get("mtp")
    fresh = {"dflash": lambda: DFlashProposer(dflash.drafter, dflash.embed,
                                              dflash.lm_head_weight, block_size=block),
             "mtp": lambda: MTPProposer(mtp.head, engine.model, mtp.state, steps=block - 1)}
    if source != "auto":
        return fresh[source]()
    # switches every other cycle; the replay (wrong at a random offset) gives long accepts
    return AutoProposer({"dflash": fresh["dflash"](), "mtp": fresh["mtp"](),
                         "replay": ReplayProposer(ref, vocab, block_size=block, seed=block)},
                        None, probe_every=2)


def _prompt(engine):
    return engine.tokenizer.encode(PROMPT, add_special_tokens=False)


def _plain(engine, n, prompt=None):
    prompt = prompt if prompt is not None else _prompt(engine)
    return generate(engine, prompt, GenerationSettings(n, ignore_eos=True, speculative=False))


def assert_lossless(engine, prompt, ref_tokens, got_tokens):
    if got_tokens == ref_tokens:
        return
    i = next(j for j, (a, b) in enumerate(zip(ref_tokens, got_tokens)) if a != b)
    engine.state.reset()
    seq = torch.tensor([prompt + ref_tokens[:i]])
    logits = engine.model(seq, engine.state).logits[0, -1]
    engine.state.reset()
    top2 = logits.topk(2).values
    margin = (top2[0] - top2[1]).item()
    assert margin < NEAR_TIE, (f"speculative output diverges at token {i} "
                               f"({got_tokens[i]} vs {ref_tokens[i]}), top-2 margin {margin}")


SOURCES = [(kind, source) for kind in ("hybrid", "dense")
           for source in ("dflash", "replay", "mtp", "auto")
           if kind == "hybrid" or source in ("dflash", "replay")]   # dense Qwen3: no MTP


@pytest.mark.parametrize("block", [4, 8, 16])
@pytest.mark.parametrize("kv", ["fp32", "fp8"])
@pytest.mark.parametrize("kind,source", SOURCES)
def test_strict_speculative_equals_plain_greedy(engines, kind, source, kv, block):
    engine = engines(kind, kv)
    prompt = _prompt(engine)
    ref = _plain(engine, 48).token_ids
    proposer = _proposer(engine, source, block, ref)
    got = generate(engine, prompt, GenerationSettings(48, ignore_eos=True), proposer=proposer)
    assert got.stats.cycles > 0
    assert_lossless(engine, prompt, ref, got.token_ids)
    if source == "replay":
        assert got.stats.mean_accepted > 0.5
    if source == "auto":
        assert {"dflash", "mtp", "replay"} <= set(got.stats.method_cycles)


@pytest.mark.parametrize("block", [4, 8, 16])
def test_every_accept_length_and_rollback_path_occurs(engines, block):
    engine = engines("hybrid", "fp32")
    prompt = _prompt(engine)
    ref = _plain(engine, 240).token_ids
    replay = ReplayProposer(ref, engine.model_config.vocab_size, block_size=block,
                            error_at=range(block))
    got = generate(engine, prompt, GenerationSettings(240, ignore_eos=True), proposer=replay)
    assert got.token_ids == ref
    hist = got.stats.accept_hist
    assert len(hist) == block and all(hist), f"accept lengths seen: {hist}"
    assert got.stats.tokens_per_cycle == pytest.approx(
        (len(ref) - 1) / got.stats.cycles)


@pytest.mark.parametrize("kv", ["fp32", "fp8"])
def test_committed_state_equals_plain_decode_after_every_cycle(engines, make_engine,
                                                               checkpoints, kv):
    engine = engines("hybrid", kv)
    prompt = _prompt(engine)
    ref = _plain(engine, 40).token_ids
    snapshots = []

    def snapshot(ids, _delta):
        s = engine.state
        snapshots.append((s.length, s.gdn.state.clone(), s.gdn.conv.clone(),
                          s.kv.k[:, :, :s.length].clone(), s.kv.v[:, :, :s.length].clone()))

    replay = ReplayProposer(ref, engine.model_config.vocab_size, block_size=8, seed=3)
    got = generate(engine, prompt, GenerationSettings(40, ignore_eos=True), on_token=snapshot,
                   proposer=replay)
    assert got.token_ids == ref
    plain = make_engine(checkpoints("hybrid"), kv_dtype=kv)
    seq = prompt + ref
    for length, gdn, conv, k, v in snapshots[1:]:  # [0] is the prefill token
        plain.state.reset()
        # same chunking as the request: the prompt first (FP8 scales calibrate on it)
        plain.model(torch.tensor([prompt]), plain.state)
        plain.state.commit(len(prompt))
        for t in range(len(prompt), length):
            plain.model(torch.tensor([[seq[t]]]), plain.state)
            plain.state.commit(1)
        s = plain.state
        assert torch.allclose(gdn, s.gdn.state, atol=1e-5), f"GDN state at {length}"
        # pre-conv rows come from an S-row matmul in verify, a 1-row one in plain decoding
        assert torch.allclose(conv, s.gdn.conv, atol=1e-5), f"conv window at {length}"
        if kv == "fp8":  # identical bits
            assert torch.equal(k, s.kv.k[:, :, :length]) and torch.equal(v, s.kv.v[:, :, :length])
        else:
            assert torch.allclose(k, s.kv.k[:, :, :length], atol=1e-5)
            assert torch.allclose(v, s.kv.v[:, :, :length], atol=1e-5)
        # next-token logits from the plain state, then from the snapshot loaded in its place
        anchor = torch.tensor([[seq[length]]])
        ref_logits = plain.model(anchor, s).logits
        s.commit(1)
        s.length = length
        s.gdn.state.copy_(gdn)
        s.gdn.conv.copy_(conv)
        s.kv.k[:, :, :length] = k
        s.kv.v[:, :, :length] = v
        snap_logits = plain.model(anchor, s).logits
        s.commit(1)
        assert (snap_logits - ref_logits).abs().max() <= 1e-4, f"next logits at {length}"


def _all_accepting(engine, ref, block=8):
    return ReplayProposer(ref, engine.model_config.vocab_size, block_size=block,
                          error_at=block)   # never wrong: every cycle accepts block-1 drafts


@pytest.mark.parametrize("offset", range(8))
def test_eos_at_every_offset_of_an_accepted_run(engines, offset):
    engine = engines("hybrid", "fp32")
    prompt = _prompt(engine)
    ref = _plain(engine, 24).token_ids
    # cycle 1 publishes ref[1..8]; make the token at offset `offset` of that run the EOS
    eos = ref[1 + offset]
    expected = ref[:ref.index(eos) + 1]
    cfg = engine.model_config
    engine.model_config = cfg.__class__(**{**cfg.__dict__, "eos_token_ids": (eos,)})
    try:
        got = generate(engine, prompt, GenerationSettings(24), proposer=_all_accepting(
            engine, ref))
    finally:
        engine.model_config = cfg
    assert got.finish_reason == "eos"
    assert got.token_ids == expected
    assert engine.state.length == len(prompt) + len(expected) - 1
    assert engine.state.pending == 0


def test_stop_string_inside_an_accepted_run(engines):
    engine = engines("hybrid", "fp32")
    prompt = _prompt(engine)
    ref = _plain(engine, 24).token_ids
    tok = engine.tokenizer
    text = tok.decode(ref[:6], skip_special_tokens=True)
    stop = text[-2:]
    expected_len = next(i for i in range(1, 25)
                        if stop in tok.decode(ref[:i], skip_special_tokens=True))
    got = generate(engine, prompt, GenerationSettings(24, ignore_eos=True,
                                                      stop_strings=(stop,)),
                   proposer=_all_accepting(engine, ref))
    assert got.finish_reason == "stop"
    assert got.token_ids == ref[:expected_len]
    assert engine.state.length == len(prompt) + expected_len - 1


@pytest.mark.parametrize("max_new", [2, 5, 9, 13])
def test_max_new_tokens_landing_mid_run(engines, max_new):
    engine = engines("hybrid", "fp32")
    prompt = _prompt(engine)
    ref = _plain(engine, 24).token_ids
    got = generate(engine, prompt, GenerationSettings(max_new, ignore_eos=True),
                   proposer=_all_accepting(engine, ref))
    assert got.finish_reason == "length"
    assert got.token_ids == ref[:max_new]
    assert engine.state.length == len(prompt) + max_new - 1


def test_cancel_between_cycles(engines):
    engine = engines("hybrid", "fp32")
    prompt = _prompt(engine)
    ref = _plain(engine, 40).token_ids
    cancel = CancelToken()
    calls = []

    def on_token(ids, _):
        calls.append(list(ids))
        if len(calls) == 3:  # after the prefill token and two cycles
            cancel.cancel()

    got = generate(engine, prompt, GenerationSettings(40, ignore_eos=True), on_token, cancel,
                   proposer=_all_accepting(engine, ref))
    assert got.finish_reason == "cancelled"
    assert got.token_ids == ref[:1 + 8 + 8]
    assert sum(len(c) for c in calls) == len(got.token_ids)
    assert got.stats.cycles == 2


def test_speculation_off_is_plain_decoding(engines):
    engine = engines("dense", "fp32")
    got = generate(engine, _prompt(engine), GenerationSettings(12, ignore_eos=True,
                                                               speculative=False))
    assert got.stats.cycles == 11 and got.stats.drafted == 0
    assert got.token_ids == _plain(engine, 12).token_ids
