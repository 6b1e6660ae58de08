"""The MTP proposer against a from-scratch reference of the head, its cache under rollback,
losslessness with switches between proposers, both checkpoint layouts and its errors.

The reference below reads the `mtp.*` tensors straight from the safetensors file and runs
the head in plain tensor math over every row at once (no cache); the target's hidden states
come from transformers. Neither shares code with the engine.
"""

from __future__ import annotations

import functools
import json
import math

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, Qwen3_5ForConditionalGeneration

from flash_planner.engine.checkpoint import CheckpointError, weight_map
from flash_planner.engine.config import ConfigError
from flash_planner.engine.engine import Engine, EngineConfig
from flash_planner.engine.generate import GenerationSettings, encode_prompt, generate
from flash_planner.engine.loop.auto_proposer import AutoProposer, Estimate
from flash_planner.engine.loop.proposer import Proposer, ReplayProposer
from flash_planner.planning.presets import ModelPreset, default_skills_path
from flash_planner.planning.prompt import build_messages
from flash_planner.planning.skills import SkillCatalog
from flash_planner.train.corpus import make_corpus
from flash_planner.train.tiny import write_tiny_drafter

PROMPT = "open the top drawer, take the blue screwdriver"
NEAR_TIE = 1e-4


@functools.cache
def reference(path, kind="hybrid"):
    """One `Reference` per checkpoint (it loads transformers' model)."""
    return Reference(path, kind)


class Reference:
    """The head from its raw tensors: rows (next-token id, hidden) at positions 0..T-1."""

    def __init__(self, path, kind):
        raw = json.loads((path / "config.json").read_text())
        self.cfg = raw.get("text_config") or raw
        self.w = {}
        for name, shard in weight_map(path).items():
            if name.startswith("mtp.") or name.endswith("embed_tokens.weight"):
                with safe_open(str(shard), "pt") as f:
                    self.w[name] = f.get_tensor(name).float()
        self.embed = next(v for k, v in self.w.items() if k.endswith("embed_tokens.weight"))
        cls = Qwen3_5ForConditionalGeneration if kind == "hybrid_vl" else AutoModelForCausalLM
        self.target = cls.from_pretrained(str(path), dtype=torch.float32).eval()
        self.lm_head = self.target.lm_head.weight.float()

    def hidden(self, ids):
        """The target's last hidden states after the final norm, [T, H]."""
        with torch.no_grad():
            out = self.target(input_ids=torch.tensor([ids]), output_hidden_states=True)
        return out.hidden_states[-1][0]

    def _norm(self, x, name):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg["rms_norm_eps"])
        return x * (1 + self.w[name])

    def _rope(self, x, positions):
        d = x.shape[-1]
        rot = int(d * self.cfg["rope_parameters"]["partial_rotary_factor"])
        theta = self.cfg["rope_parameters"]["rope_theta"]
        freqs = positions[:, None].float() / theta ** (torch.arange(0, rot, 2) / rot)
        cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
        cos, sin = cos[:, None], sin[:, None]
        xr, xp = x[..., :rot], x[..., rot:]
        half = torch.cat((-xr[..., rot // 2:], xr[..., :rot // 2]), -1)
        return torch.cat((xr * cos + half * sin, xp), -1)

    def rows(self, tokens, hidden):
        """tokens [T] (each row's next token), hidden [T, H] -> (outputs [T, H], keys)."""
        w, c = self.w, self.cfg
        p = "mtp.layers.0."
        nh, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        t = len(tokens)
        x = torch.cat((self._norm(self.embed[tokens], "mtp.pre_fc_norm_embedding.weight"),
                       self._norm(hidden, "mtp.pre_fc_norm_hidden.weight")), -1)
        x = x @ w["mtp.fc.weight"].T
        h = self._norm(x, p + "input_layernorm.weight")
        q, gate = (h @ w[p + "self_attn.q_proj.weight"].T).view(t, nh, 2 * hd).chunk(2, -1)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).view(t, nkv, hd)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(t, nkv, hd)
        pos = torch.arange(t)
        q = self._rope(self._norm(q, p + "self_attn.q_norm.weight"), pos)
        k = self._rope(self._norm(k, p + "self_attn.k_norm.weight"), pos)
        kr, vr = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, kr) / math.sqrt(hd)
        scores = scores.masked_fill(torch.ones(t, t).triu(1).bool(), float("-inf"))
        att = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vr).reshape(t, nh * hd)
        att = att * torch.sigmoid(gate.reshape(t, nh * hd))
        x = x + att @ w[p + "self_attn.o_proj.weight"].T
        m = self._norm(x, p + "post_attention_layernorm.weight")
        m = (torch.nn.functional.silu(m @ w[p + "mlp.gate_proj.weight"].T)
             * (m @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
        return self._norm(x + m, "mtp.norm.weight"), k

    def drafts(self, seq, start, given):
        """Draft logits for the proposal at `start` (seq[start] is the anchor), chaining on
        the proposer's own drafts `given` so a difference cannot cascade."""
        h = self.hidden(seq[:start])
        tokens, hidden = list(seq[1:start + 1]), h
        logits = []
        for j in range(len(given)):
            out, _ = self.rows(tokens, hidden)
            logits.append(out[-1] @ self.lm_head.T)
            tokens.append(given[j])
            hidden = torch.cat((hidden, out[-1:]))
        return logits


class Recording(Proposer):
    """Passes everything to `inner` and keeps each proposal."""

    def __init__(self, inner):
        self.inner = inner
        self.tap_ids, self.block_size = inner.tap_ids, inner.block_size
        self.seed_rows, self.name = inner.seed_rows, inner.name
        self.proposals = []

    def begin(self, prompt_ids, taps):
        self.inner.begin(prompt_ids, taps)

    def propose(self, anchor, start, num):
        drafts = self.inner.propose(anchor, start, num)
        self.proposals.append((start, drafts.tolist()))
        return drafts

    def commit(self, tokens, taps, start):
        self.inner.commit(tokens, taps, start)

    @property
    def last_method(self):
        return self.inner.last_method

    @property
    def catchup_ms(self):
        return self.inner.catchup_ms


def assert_draft_matches(ref_logits, drafts):
    for logits, got in zip(ref_logits, drafts):
        want = int(logits.argmax())
        if got != want:
            top2 = logits.topk(2).values
            assert (top2[0] - top2[1]).item() < NEAR_TIE, f"draft {got}, reference {want}"


def assert_cache_matches(ref, proposer, seq):
    """The head's cache holds, for every committed position, the entry made from the
    target's hidden state and the true next token: nothing from its own drafts."""
    length = proposer.state.length
    assert length > 0
    _, keys = ref.rows(seq[1:length + 1], ref.hidden(seq[:length]))
    cached = proposer.state.kv.k[0, 0, :length].float()
    assert (cached - keys).abs().max().item() < 1e-4


@pytest.fixture(scope="module")
def mtp_checkpoint(checkpoints):
    return lambda kind="hybrid": checkpoints(kind, mtp=True, init=0.25)


@pytest.mark.parametrize("kind", ["hybrid", "hybrid_vl"])
def test_drafts_and_cache_equal_the_reference_head(mtp_checkpoint, make_engine, kind):
    path = mtp_checkpoint(kind)
    engine = make_engine(path, method="mtp", mtp_steps=4)
    ref = reference(path, kind)
    prompt = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    rec = Recording(engine.proposers["mtp"])
    out = generate(engine, prompt, GenerationSettings(20, ignore_eos=True), proposer=rec)
    plain = generate(engine, prompt, GenerationSettings(20, ignore_eos=True, method="none"))
    assert out.token_ids == plain.token_ids
    seq = prompt + out.token_ids
    assert len(rec.proposals) >= 3
    for start, drafts in rec.proposals[:3] + rec.proposals[-1:]:
        assert_draft_matches(ref.drafts(seq, start, drafts), drafts)
    assert_cache_matches(ref, engine.proposers["mtp"], seq)


@pytest.mark.parametrize("kv", ["fp32", "fp8"])
@pytest.mark.parametrize("steps", [1, 3, 6])
def test_mtp_and_switching_auto_are_lossless_under_every_commit_length(
        mtp_checkpoint, make_engine, tmp_path_factory, steps, kv):
    """A random head rarely guesses right, so an auto router alternating every cycle
    between the head and a replay of the true continuation (wrong at a random offset)
    commits runs of every length to the head; output and cache must stay exact."""
    path = mtp_checkpoint()
    engine = make_engine(path, method="mtp", mtp_steps=steps, kv_dtype=kv)
    prompt = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    ref = generate(engine, prompt, GenerationSettings(64, ignore_eos=True, method="none"))
    got = generate(engine, prompt, GenerationSettings(64, ignore_eos=True, method="mtp"))
    assert got.token_ids == ref.token_ids
    assert got.stats.method_cycles.get("mtp", 0) > 0
    replay = ReplayProposer(ref.token_ids, engine.model_config.vocab_size, block_size=8,
                            seed=steps)
    auto = AutoProposer({"replay": replay, "mtp": engine.proposers["mtp"]}, None,
                        probe_every=1)
    mixed = generate(engine, prompt, GenerationSettings(64, ignore_eos=True), proposer=auto)
    assert mixed.token_ids == ref.token_ids
    assert set(mixed.stats.method_cycles) >= {"replay", "mtp"}
    assert len([n for n in mixed.stats.accept_hist if n]) >= 3   # varied commit lengths
    if kv == "fp32":
        assert_cache_matches(reference(path), engine.proposers["mtp"],
                             prompt + ref.token_ids)


class VirtualClock:
    """Seconds that advance only by the costs the test sets: 1 ms per cycle (the router
    reads the clock twice a cycle) plus what a `Costed` candidate adds, so the router's
    choices do not depend on the load of the machine running the test."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        self.now += 0.0005
        return self.now


class Costed(Recording):
    """`inner`, whose every proposal advances the virtual clock by `ms`. Its catch-up is
    free on that clock: the inner proposer's catch-up time is real time, which on a loaded
    machine exceeded the virtual cycle and made the router's estimate of it infinite."""

    def __init__(self, inner, clock, ms):
        super().__init__(inner)
        self.clock, self.ms = clock, ms

    @property
    def catchup_ms(self):
        return 0.0

    def propose(self, anchor, start, num):
        self.clock.now += self.ms / 1000
        return super().propose(anchor, start, num)


def test_auto_routes_to_the_faster_candidate_and_probes_the_others(mtp_checkpoint,
                                                                    make_engine):
    path = mtp_checkpoint()
    engine = make_engine(path, method="mtp", mtp_steps=3)
    prompt = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    ref = generate(engine, prompt, GenerationSettings(400, ignore_eos=True, method="none"))
    # an exact replay publishes 8 tokens a cycle: far ahead of a random head and of plain
    # decoding (1 token a cycle), which are measured once and then only probed
    clock = VirtualClock()
    replay = ReplayProposer(ref.token_ids, engine.model_config.vocab_size, block_size=8,
                            error_at=99)
    auto = AutoProposer({"mtp": Costed(engine.proposers["mtp"], clock, 3.0),
                         "replay": Costed(replay, clock, 2.0)}, None, probe_every=4,
                        clock=clock)
    got = generate(engine, prompt, GenerationSettings(400, ignore_eos=True), proposer=auto)
    assert got.token_ids == ref.token_ids
    cycles = got.stats.method_cycles
    assert cycles["replay"] > 3 * (cycles["mtp"] + cycles["none"]), cycles
    assert cycles["mtp"] >= 2, cycles     # measured, then probed again (at 8 probe_every)
    rates = {name: auto.estimates["answer", name].rate for name in ("replay", "mtp")}
    assert rates["replay"] == max(rates.values())
    # the probe rule: a candidate at r = rate / best rate drafts after probe_every / r^2
    # cycles without it, at most 8 probe_every
    auto.probe_every = 12
    auto.estimates = {("answer", "replay"): Estimate(8.0, 1.0, 0),
                      ("answer", "mtp"): Estimate(6.0, 1.0, 0),     # r = 3/4: every 21.3
                      ("answer", "none"): Estimate(1.0, 1.0, 0)}    # r = 1/8: every 96
    for cycles, chosen in ((21, "replay"), (22, "mtp")):
        auto.cycles = cycles
        assert auto.choose("answer") == chosen
    auto.estimates["answer", "mtp"].last_cycle = 90
    for cycles, chosen in ((95, "replay"), (96, "none")):
        auto.cycles = cycles
        assert auto.choose("answer") == chosen


def test_one_stall_does_not_shut_a_candidate_out():
    auto = AutoProposer({"replay": ReplayProposer([], 8)}, None)
    auto._record("answer", "replay", 8, 500.0)     # a stall on the first measurement
    auto._record("answer", "replay", 8, 2.0)       # the next probe: taken at once
    assert auto.estimates["answer", "replay"].ms == 2.0
    auto._record("answer", "replay", 8, 400.0)     # a later stall counts as 3x at most
    assert auto.estimates["answer", "replay"].ms == pytest.approx(2.0 + 0.3 * 4.0)


def test_auto_falls_back_to_plain_decoding_when_drafts_are_rejected(mtp_checkpoint,
                                                                   make_engine):
    """A replay that is always wrong costs a 16-row verify and publishes one token a cycle,
    as plain decoding does with a one-row verify (cheaper): auto settles on plain."""
    engine = make_engine(mtp_checkpoint(), method="none")
    prompt = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    ref = generate(engine, prompt, GenerationSettings(120, ignore_eos=True))
    clock = VirtualClock()
    wrong = ReplayProposer(ref.token_ids, engine.model_config.vocab_size, block_size=16,
                           error_at=0)
    auto = AutoProposer({"replay": Costed(wrong, clock, 4.0)}, None, probe_every=4,
                        clock=clock)
    got = generate(engine, prompt, GenerationSettings(120, ignore_eos=True), proposer=auto)
    assert got.token_ids == ref.token_ids
    cycles = got.stats.method_cycles
    assert cycles["none"] > 3 * cycles["replay"], cycles


def test_auto_phase_follows_the_published_think_markers(mtp_checkpoint, make_engine):
    engine = make_engine(mtp_checkpoint(), method="none")
    vocab = engine.model_config.vocab_size
    auto = AutoProposer({"replay": ReplayProposer([], vocab)}, (7, 8))
    auto.begin([1, 2, 7], None)                # the prompt opens a thinking block
    assert auto._phase() == "think"
    auto.published([5, 8])                     # the next anchor closes it
    assert auto._phase() == "answer"


def test_the_demo_head_accepts_and_keeps_its_cache_exact_under_partial_accepts():
    """The shipped demo target's trained head: drafts are accepted in part, often."""
    engine = Engine.load(ModelPreset.load("demo").engine_config(device="cpu", dtype="fp32"))
    assert {"dflash", "mtp", "auto"} <= set(engine.proposers)
    catalog = SkillCatalog.from_yaml(default_skills_path())
    ref = reference(engine.checkpoint.path)
    k = engine.proposers["mtp"].block_size - 1
    hist = [0] * (k + 1)
    for ex in make_corpus(0, n_train=0, n_heldout=40)[1][:3]:
        prompt = encode_prompt(engine, build_messages(catalog, ex.task, ex.context),
                               ex.thinking is not None)
        plain = generate(engine, prompt, GenerationSettings(200, method="none"))
        auto = generate(engine, prompt, GenerationSettings(200, method="auto"))
        assert auto.token_ids == plain.token_ids
        mtp = generate(engine, prompt, GenerationSettings(200, method="mtp"))
        assert mtp.token_ids == plain.token_ids
        hist = [a + b for a, b in zip(hist, mtp.stats.accept_hist + [0] * (k + 1))]
        assert_cache_matches(ref, engine.proposers["mtp"], prompt + mtp.token_ids)
    # partial accepts (rollback of the head's chain) and whole chains accepted both occur
    assert sum(hist[1:k]) > 0 and hist[k] > 0, f"accepted-draft histogram {hist}"


def test_errors_name_what_is_missing(checkpoints, mtp_checkpoint, make_engine,
                                     tmp_path_factory):
    with pytest.raises(CheckpointError, match="dense Qwen3"):
        make_engine(checkpoints("dense"), method="mtp")
    with pytest.raises(CheckpointError, match=r"no mtp\.\* tensors"):
        make_engine(checkpoints("hybrid"), method="mtp")
    with pytest.raises(ConfigError, match="drafter"):
        make_engine(checkpoints("hybrid"), method="dflash")
    with pytest.raises(ConfigError, match="method must be one of"):
        make_engine(checkpoints("hybrid"), method="eagle")
    with pytest.raises(ConfigError, match="mtp_steps"):
        make_engine(mtp_checkpoint(), method="mtp", mtp_steps=16)
    drafter = write_tiny_drafter(tmp_path_factory.mktemp("drafter"), checkpoints("hybrid"))
    only_dflash = make_engine(checkpoints("hybrid"), drafter_path=str(drafter))
    assert set(only_dflash.proposers) == {"dflash", "auto"}
    with pytest.raises(ValueError, match=r"method 'mtp' is not loaded .*loaded: dflash, auto"):
        generate(only_dflash, [5, 6, 7], GenerationSettings(4, method="mtp"))
    fixed = make_engine(checkpoints("hybrid"), drafter_path=str(drafter), method="dflash")
    with pytest.raises(ValueError, match=r"method .auto. is not loaded .*loaded: dflash\)"):
        generate(fixed, [5, 6, 7], GenerationSettings(4, method="auto"))
    with pytest.raises(ValueError, match="method must be one of"):
        GenerationSettings(4, method="medusa")
    plain = make_engine(checkpoints("hybrid"))   # auto with nothing to route to: plain
    assert plain.proposers == {} and plain.proposer is None
    assert generate(plain, [5, 6, 7], GenerationSettings(4, method="auto")).stats.drafted == 0


def test_a_head_with_a_wrong_shape_is_refused_before_loading(mtp_checkpoint, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    src = mtp_checkpoint()
    dst = tmp_path / "bad"
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    tensors["mtp.fc.weight"] = tensors["mtp.fc.weight"][:, :-1].contiguous()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"mtp\.fc\.weight has shape"):
        Engine.load(EngineConfig(str(dst), device="cpu", dtype="fp32", method="mtp",
                                 max_context=128))
