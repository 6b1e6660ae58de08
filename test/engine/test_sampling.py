"""Sampling (engine/loop/sampling.py): the processed distribution equals transformers', and the
speculative sampler is exact in distribution.

Exactness is shown two ways. Pathwise: with a seed, every method publishes the tokens plain
sampling publishes (the noise is fixed per position). Statistically: for a tiny model the
distribution of 3-token continuations under the processors is enumerated exactly (each
step's processed distribution from the engine's own logits, the grammar's masks applied
where there is one), then sampled N_SAMPLES times per method with seeds 0..N-1 (so CI is
deterministic) and compared with a chi-square goodness-of-fit test at a false-alarm rate of
ALPHA per comparison. The power of that test at its sample count is stated in
`test_the_test_detects_a_small_bias`; a sampler that keeps every draft fails it.
"""

from __future__ import annotations

import math

import pytest
import torch

from flash_planner.engine.generate import GenerationSettings, generate, prefill
from flash_planner.engine.loop.acceptance import ThinkTracker
from flash_planner.engine.loop.constraint import masked
from flash_planner.engine.loop.proposer import ReplayProposer
from flash_planner.engine.loop.sampling import (
    QWEN3_ANSWER,
    QWEN3_THINKING,
    SampledAcceptance,
    Sampling,
    SamplingParams,
    process,
)
from flash_planner.train.tiny import write_tiny_drafter

ALPHA = 1e-3
N_SAMPLES = 400
LENGTH = 3          # the first token comes from the prompt's prefill, the next two from a
                    # verify cycle with a draft, so the speculative path decides them
PROMPT = [3, 4, 5, 6, 7]
FLAT = SamplingParams(temperature=1.5, top_k=3)        # 3^3 = 27 outcomes, none rare


def chi2_sf(x: float, df: int) -> float:
    """P(X > x) for X ~ chi-square(df): the regularized upper incomplete gamma function."""
    a, z = df / 2.0, x / 2.0
    if z <= 0:
        return 1.0
    term = total = 1.0 / a
    for n in range(1, 1000):             # series of the lower function
        term *= z / (a + n)
        total += term
        if term < total * 1e-15:
            break
    lower = total * math.exp(-z + a * math.log(z) - math.lgamma(a))
    return max(0.0, 1.0 - lower)


def chi_square(counts: dict, probs: dict, n: int) -> tuple[float, int]:
    assert set(counts) <= set(probs), set(counts) - set(probs)   # nothing outside the support
    stat = sum((counts.get(k, 0) - n * p) ** 2 / (n * p) for k, p in probs.items())
    return stat, len(probs) - 1


# ---- the processors against transformers -------------------------------------------------

GRID = [
    SamplingParams(temperature=0.7, top_k=20, top_p=0.8),
    SamplingParams(temperature=0.6, top_k=20, top_p=0.95),
    SamplingParams(temperature=1.0, top_p=0.5),
    SamplingParams(temperature=1.3, top_k=7),
    SamplingParams(temperature=0.9, min_p=0.1),
    SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.3),
    SamplingParams(temperature=2.0, repetition_penalty=0.7),
]


@pytest.mark.parametrize("kind", ["hybrid", "dense"])
def test_the_processed_distribution_equals_transformers(checkpoints, make_engine, kind):
    from transformers import AutoModelForCausalLM

    path = checkpoints(kind, init=0.25)
    engine = make_engine(path)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    for i, params in enumerate(GRID):
        torch.manual_seed(i)
        out = model.generate(torch.tensor([PROMPT]), do_sample=True, max_new_tokens=4,
                             temperature=params.temperature, top_k=params.top_k,
                             top_p=params.top_p, min_p=params.min_p or None,
                             repetition_penalty=params.repetition_penalty,
                             output_scores=True, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
        for step, (scores, raw) in enumerate(zip(out.scores, out.logits)):
            ids = out.sequences[0, :len(PROMPT) + step].tolist()
            seen = torch.bincount(torch.tensor(ids), minlength=raw.shape[-1]).float()[None]
            theirs = scores.float().softmax(dim=-1)
            # our processors on transformers' own logits: the processing alone
            ours = process(raw, params, seen)
            torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
            # and on our engine's logits: the whole path
            engine.state.reset()
            logits, _ = prefill(engine, ids)
            engine.state.reset()
            torch.testing.assert_close(process(logits[None], params, seen), theirs,
                                       atol=1e-5, rtol=0)


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.zeros(1, 6)
    generated = torch.tensor([[0.0, 2.0, 1.0, 0.0, 0.0, 0.0]])
    params = SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.25)
    want = torch.tensor([[0.0, -1.0, -0.75, 0.0, 0.0, 0.0]]).softmax(dim=-1)
    torch.testing.assert_close(process(logits, params, None, generated), want)


@pytest.mark.parametrize("values,match", [
    ({"temperature": -0.1}, "temperature must be a number in"),
    ({"temperature": float("nan")}, "temperature must be a number in"),
    ({"top_p": 0.0}, r"top_p must be a number in \(0.0, 1.0\]"),
    ({"top_k": -1}, "top_k must be an integer >= 0"),
    ({"min_p": 1.5}, "min_p must be a number in"),
    ({"repetition_penalty": 0}, "repetition_penalty must be a number in"),
    ({"presence_penalty": 3}, "presence_penalty must be a number in"),
    ({"temprature": 0.5}, r"unknown setting\(s\) \['temprature'\]"),
])
def test_bad_settings_are_refused_naming_the_setting(values, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams.from_dict(values, "sampling.thinking")


def test_relaxed_thinking_with_sampling_is_refused():
    with pytest.raises(ValueError, match="relaxed thinking acceptance is defined for greedy"):
        GenerationSettings(relaxed_thinking=True, sampling=Sampling(QWEN3_THINKING))
    GenerationSettings(relaxed_thinking=True, sampling=Sampling())   # temperature 0: greedy


def test_generation_config_defaults_and_the_card_presets():
    assert SamplingParams.from_generation_config({"do_sample": False}).greedy
    got = SamplingParams.from_generation_config(
        {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95})
    assert got == QWEN3_THINKING
    assert (QWEN3_ANSWER.temperature, QWEN3_ANSWER.top_p) == (0.7, 0.8)


# ---- exactness of the speculative sampler -------------------------------------------------

@pytest.fixture(scope="module")
def spec_engine(checkpoints, tmp_path_factory, make_engine):
    path = checkpoints("hybrid", mtp=True, init=0.25)
    drafter = write_tiny_drafter(tmp_path_factory.mktemp("sdrafter"), path, num_layers=2,
                                 block_size=4)
    return make_engine(path, drafter_path=str(drafter), method="auto")


@pytest.fixture(scope="module")
def dflash2_engine(checkpoints, tmp_path_factory, make_engine):
    """The same target with a DFlash2 drafter: the selector's walk draws the drafts."""
    path = checkpoints("hybrid", mtp=True, init=0.25)
    drafter = write_tiny_drafter(tmp_path_factory.mktemp("sdrafter2"), path, num_layers=2,
                                 block_size=4, layer_types=["sliding_attention"] * 2,
                                 dflash2={"selector_top_k": 8})
    return make_engine(path, drafter_path=str(drafter), method="dflash")


def exact_continuations(engine, params: SamplingParams, grammar=None) -> dict:
    """P(t1, .., tL) for L = LENGTH, enumerated from the engine's processed distributions
    (the grammar's masks applied as it would apply them after each prefix)."""
    vocab = engine.model_config.vocab_size

    def dist(prefix: list[int]) -> torch.Tensor:
        ids = PROMPT + prefix
        engine.state.reset()
        logits, _ = prefill(engine, ids)
        engine.state.reset()
        bitmask = None
        if grammar is not None:
            constraint = grammar.constraint()
            constraint.reset(PROMPT)
            if prefix:
                constraint.commit(prefix)
            bitmask = constraint.masks([])
        seen = torch.bincount(torch.tensor(ids), minlength=vocab).float()[None]
        return process(masked(logits[None], bitmask), params, seen)[0]

    out = {(): 1.0}
    for _ in range(LENGTH):
        grown = {}
        for prefix, prob in out.items():
            p = dist(list(prefix))
            for t in torch.nonzero(p).flatten().tolist():
                grown[prefix + (t,)] = prob * float(p[t])
        out = grown
    return out


def sample_continuations(engine, params, method, n, grammar=None, proposer=None,
                         policy_cls=SampledAcceptance) -> dict:
    counts: dict = {}
    for seed in range(n):
        settings = GenerationSettings(max_new_tokens=LENGTH, ignore_eos=grammar is None,
                                      method=method, sampling=Sampling(params, params, seed))
        policy = policy_cls(settings.sampling, engine.model_config.vocab_size, engine.device)
        result = generate(engine, PROMPT, settings, proposer=proposer, policy=policy,
                          constraint=grammar.constraint() if grammar else None)
        key = tuple(result.token_ids)
        counts[key] = counts.get(key, 0) + 1
    return counts


def greedy_replay(engine, block: int) -> ReplayProposer:
    ref = generate(engine, PROMPT, GenerationSettings(max_new_tokens=4, ignore_eos=True,
                                                      method="none")).token_ids
    # drafts of the greedy path: accepted with p(draft), rejected otherwise
    return ReplayProposer(ref, engine.model_config.vocab_size, block_size=block,
                          error_at=block)


@pytest.mark.parametrize("method", ["none", "dflash", "mtp", "auto", "replay"])
def test_speculative_sampling_gives_plain_samplings_distribution(spec_engine, method):
    exact = exact_continuations(spec_engine, FLAT)
    proposer = greedy_replay(spec_engine, 4) if method == "replay" else None
    counts = sample_continuations(spec_engine, FLAT, "none" if method == "replay" else method,
                               N_SAMPLES, proposer=proposer)
    stat, df = chi_square(counts, exact, N_SAMPLES)
    assert chi2_sf(stat, df) > ALPHA, (method, stat, counts, exact)


def test_a_pick_among_candidates_is_the_pick_over_the_vocabulary_without_the_rest():
    """DFlash2's walk draws over its candidates only (`among`): the same token as the draw
    over the whole vocabulary with every other logit at -inf, for the same noise."""
    params = SamplingParams(temperature=0.8, top_k=5, top_p=0.9)
    vocab = 64
    gen = torch.Generator().manual_seed(3)
    for seed in range(20):
        policy = SampledAcceptance(Sampling(params, params, seed), vocab, torch.device("cpu"))
        among = torch.randperm(vocab, generator=gen)[:8][None]
        scores = torch.randn(1, 8, generator=gen) * 2
        full = torch.full((1, vocab), -math.inf).scatter(1, among, scores)
        assert policy.pick(scores, 7 + seed, among=among).item() == \
            policy.pick(full, 7 + seed).item()


def test_dflash2_sampling_gives_plain_samplings_distribution(spec_engine, dflash2_engine):
    exact = exact_continuations(spec_engine, FLAT)
    counts = sample_continuations(dflash2_engine, FLAT, "dflash", N_SAMPLES)
    stat, df = chi_square(counts, exact, N_SAMPLES)
    assert chi2_sf(stat, df) > ALPHA, (stat, counts, exact)


@pytest.mark.parametrize("method", ["none", "auto", "replay"])
def test_speculative_sampling_under_a_grammar_gives_the_masked_distribution(
        spec_engine, method):
    from test_constraint import _grammar

    grammar = _grammar(spec_engine)
    exact = exact_continuations(spec_engine, FLAT, grammar)
    proposer = greedy_replay(spec_engine, 4) if method == "replay" else None
    counts = sample_continuations(spec_engine, FLAT, "none" if method == "replay" else method,
                               N_SAMPLES, grammar=grammar, proposer=proposer)
    stat, df = chi_square(counts, exact, N_SAMPLES)
    assert chi2_sf(stat, df) > ALPHA, (method, stat, counts, exact)


class KeepsEveryDraft(SampledAcceptance):
    """A wrong rule: every draft accepted, the bonus sampled."""

    def decide(self, drafts, logits, position):
        _, picks = super().decide(drafts, logits, position)
        return torch.tensor(drafts.shape[0]), picks


def test_a_sampler_that_keeps_every_draft_fails_the_same_test(spec_engine):
    exact = exact_continuations(spec_engine, FLAT)
    counts = sample_continuations(spec_engine, FLAT, "none", N_SAMPLES,
                               proposer=greedy_replay(spec_engine, 4),
                               policy_cls=KeepsEveryDraft)
    stat, df = chi_square({k: v for k, v in counts.items() if k in exact}, exact, N_SAMPLES)
    assert chi2_sf(stat, df) < 1e-12


def test_the_test_detects_a_small_bias(spec_engine):
    """The power of the comparison above, at its N and ALPHA: moving 0.04 of probability
    (a total-variation distance of 0.04) from the likeliest of the 27 outcomes to the least
    likely one is caught with probability > 0.9 (0.94 in 200 seeded simulated runs of
    N_SAMPLES draws; a 0.03 shift is caught 0.72 of the time, 0.05 always)."""
    exact = exact_continuations(spec_engine, FLAT)
    keys = sorted(exact, key=exact.get)
    biased = dict(exact)
    shift = 0.04
    biased[keys[-1]] -= shift
    biased[keys[0]] += shift
    gen = torch.Generator().manual_seed(0)
    probs = torch.tensor([biased[k] for k in keys])
    caught = 0
    for _ in range(200):
        draws = torch.multinomial(probs, N_SAMPLES, replacement=True, generator=gen)
        counts = dict(zip(keys, torch.bincount(draws, minlength=len(keys)).tolist()))
        stat, df = chi_square(counts, exact, N_SAMPLES)
        caught += chi2_sf(stat, df) <= ALPHA
    assert caught / 200 > 0.9, caught


def test_a_seed_gives_the_same_tokens_with_every_method_and_greedy_is_unchanged(
        spec_engine):
    """The noise is fixed per position, so drafts change the speed, never the tokens."""
    sampling = Sampling(QWEN3_THINKING, QWEN3_ANSWER, seed=7)
    runs = {m: generate(spec_engine, PROMPT, GenerationSettings(
        max_new_tokens=24, ignore_eos=True, sampling=sampling, method=m))
        for m in ("none", "dflash", "mtp", "auto")}
    runs["replay"] = generate(spec_engine, PROMPT, GenerationSettings(
        max_new_tokens=24, ignore_eos=True, sampling=sampling, method="none"),
        proposer=ReplayProposer(runs["none"].token_ids, spec_engine.model_config.vocab_size,
                                block_size=4))
    assert all(r.token_ids == runs["none"].token_ids for r in runs.values()), \
        {m: r.token_ids for m, r in runs.items()}
    assert runs["replay"].stats.accepted > 0          # the replayed drafts were kept
    other = generate(spec_engine, PROMPT, GenerationSettings(
        max_new_tokens=24, ignore_eos=True, sampling=Sampling(QWEN3_THINKING, QWEN3_ANSWER, 8)))
    assert other.token_ids != runs["none"].token_ids
    assert runs["auto"].stats.as_dict()["seed"] == 7 and runs["auto"].stats.as_dict()["sampled"]
    greedy = GenerationSettings(max_new_tokens=16, ignore_eos=True, method="none")
    zero = GenerationSettings(max_new_tokens=16, ignore_eos=True,
                              sampling=Sampling(seed=5))          # temperature 0 = greedy
    assert generate(spec_engine, PROMPT, zero).token_ids == \
        generate(spec_engine, PROMPT, greedy).token_ids


def test_each_phase_samples_with_its_own_settings():
    tracker = SampledAcceptance(Sampling(QWEN3_THINKING, SamplingParams()), 10,
                                torch.device("cpu"), think_ids=(8, 9))
    tracker.reset([1, 8, 2])                      # inside thinking after the prompt
    assert isinstance(tracker, ThinkTracker) and tracker.thinking
    rows = tracker._phase_rows(torch.tensor([3, 9, 4, 8]))
    assert rows.tolist() == [True, True, False, False, True]
    logits = torch.randn(5, 10)
    p = tracker.distribution(torch.tensor([3, 9, 4, 8]), logits)
    assert torch.equal(p[2], torch.nn.functional.one_hot(logits[2].argmax(), 10).float())
    assert (p[0] > 0).sum() > 1 and (p[4] > 0).sum() > 1           # sampled rows


def test_penalties_count_the_prompt_once_and_outputs_in_both_counts(spec_engine):
    """Repetition penalty reads prompt + output, presence/frequency the output only; a
    penalised request runs with every method and a seed fixes its tokens."""
    params = SamplingParams(temperature=0.8, presence_penalty=1.0, frequency_penalty=0.5,
                            repetition_penalty=1.2)
    tracker = SampledAcceptance(Sampling(params, params), 10, torch.device("cpu"))
    tracker.reset([1, 1, 2])
    assert tracker.seen.tolist() == [0, 2, 1] + [0] * 7 and not tracker.generated.any()
    tracker.observe([2, 3])
    assert tracker.seen[:4].tolist() == [0, 2, 2, 1]
    assert tracker.generated[:4].tolist() == [0, 0, 1, 1]
    runs = {m: generate(spec_engine, PROMPT, GenerationSettings(
        max_new_tokens=16, ignore_eos=True, sampling=Sampling(params, params, seed=3),
        method=m)).token_ids for m in ("none", "dflash")}
    assert runs["none"] == runs["dflash"] and len(runs["none"]) == 16
