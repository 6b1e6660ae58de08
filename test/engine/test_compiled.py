"""Compiled static-shape forwards (engine/models/graphs/compiled.py) against eager forwards.

The contract: the same tokens compiled and eager, for every method, KV dtype, the grammar,
prefix restore and cancel, on the hybrid, the dense and the MoE target. With bf16 compute
the two round differently (fused kernels keep float32 where eager rounds to bf16, sums run
in another order), so there a flip is tolerated only at a genuine tie: eager's top-2
logits at the first divergence within one bf16 step of each other. No graph break
(`fullgraph=True` raises on one) and no graph compiled or read after warm-up over varied
requests; a second engine reads every graph from the on-disk store and gives the same
tokens. Engines here hold blocks of up to 4 rows (buckets 1, 2, 4) and
targets of two layers, which keeps the compiling short; bench/overhead.py measures the
default buckets.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from poisoned_cache import poison
from torch._dynamo.utils import counters

from flash_planner.engine.batch import Batch, BatchRequest
from flash_planner.engine.config import ConfigError, EngineConfig, cache_home
from flash_planner.engine.engine import Engine
from flash_planner.engine.generate import CancelToken, GenerationSettings, generate
from flash_planner.engine.inputs.grammar import JsonGrammarCompiler
from flash_planner.engine.loop.proposer import ReplayProposer
from flash_planner.engine.loop.sampling import QWEN3_THINKING, Sampling
from flash_planner.engine.models.graphs import compiled as compiled_mod
from flash_planner.engine.models.graphs import direct as direct_mod
from flash_planner.engine.models.graphs.compiled import row_buckets, span_bounds
from flash_planner.engine.models.graphs.static_graphs import key_buckets
from flash_planner.train.tiny import write_tiny_drafter

PROMPT = "open the top drawer, take the blue screwdriver"
SCHEMA = {"type": "object", "required": ["steps"], "properties": {
    "steps": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "string", "enum": ["pick", "place", "open the drawer", "wait"]}}}}
BLOCK = 4
# Two layers, one GDN and one attention (the tiny default has two of each): the graphs hold
# every kind of layer and compile cold in less time (the hybrid's first engine, 7 graphs:
# 131 -> 112 s on one core). The spans test keeps four layers, in two spans.
LAYERS = 2


def test_buckets_cover_every_block_size():
    assert row_buckets(16) == (1, 2, 4, 8, 16)
    assert row_buckets(5) == (1, 2, 4, 5)
    assert row_buckets(1) == (1,)
    # CUDA graphs' key buckets (cache_attention reads as many rows as a graph was captured
    # with): every length up to the capacity has one, the capacity the last
    assert key_buckets(4096) == (256, 512, 1024, 2048, 4096)
    assert key_buckets(3000) == (256, 512, 1024, 2048, 3000)
    assert key_buckets(100) == (100,)


def test_spans_are_whole_periods_of_the_layer_kinds():
    g, a = ("gdn", "mlp"), ("attn", "mlp")
    qwen = [g, g, g, a] * 16                       # the 27B: 16 calls of one 4-layer graph
    assert span_bounds(qwen, 4) == [(i, i + 4) for i in range(0, 64, 4)]
    assert span_bounds(qwen, 8) == [(i, i + 8) for i in range(0, 64, 8)]
    assert span_bounds(qwen, 6) == [(i, i + 8) for i in range(0, 64, 8)]   # whole periods
    assert span_bounds([g, a] * 2, 4) == [(0, 4)]
    assert span_bounds([a] * 10, 4) == [(0, 4), (4, 8), (8, 10)]
    irregular = [a, g, g, a, g, a, a, g, g, g, a]  # no period up to 8: one layer per call
    assert span_bounds(irregular, 4) == [(i, i + 1) for i in range(11)]


@pytest.fixture(scope="module")
def compile_cache():
    """Kept across runs, as the engine's own cache is: a machine's first run compiles cold
    (about 10 of its minutes on 2 cores), later ones read the graphs (inductor keys each by
    its code, shapes and the torch version, so a changed graph compiles again)."""
    return str(cache_home() / "test_torch_compile")


@pytest.fixture(scope="module")
def pairs(checkpoints, make_engine, tmp_path_factory, compile_cache):
    """(kind, kv, dtype) -> (eager engine, compiled engine) with the MTP head where the kind
    has one, and a DFlash drafter where a case of CASES drafts with it (each drafter is a
    cold compile of its own)."""
    cache = {}

    def get(kind: str, kv: str = "fp32", dtype: str = "fp32"):
        if (kind, kv, dtype) not in cache:
            mtp = kind in ("hybrid", "hybrid_moe")
            path = checkpoints(kind, init=0.25, layers=LAYERS, **({"mtp": True} if mtp else {}))
            drafts = any(case[1] in ("dflash", "auto") for case in CASES
                         if (case[0], case[2], case[3]) == (kind, kv, dtype))
            drafter = write_tiny_drafter(tmp_path_factory.mktemp(f"drafter-{kind}"), path,
                                         num_layers=2, block_size=BLOCK) if drafts else None
            common = dict(max_batch=1, kv_dtype=kv, dtype=dtype,
                          drafter_path=str(drafter) if drafter else None,
                          max_block=BLOCK, mtp_steps=BLOCK - 1, compile_cache=compile_cache)
            cache[kind, kv, dtype] = (make_engine(path, compile="off", **common),
                                      make_engine(path, compile="on", **common))
        return cache[kind, kv, dtype]

    return get


def _generate(engine, method, n=40, sampling=None, **kwargs):
    prompt = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    settings = GenerationSettings(n, ignore_eos="constraint" not in kwargs, method=method,
                                  sampling=sampling)
    return generate(engine, prompt, settings, **kwargs)


CASES = [("hybrid", m, "fp32", "fp32") for m in ("none", "dflash", "mtp", "auto")] + [
    ("hybrid", "none", "fp8", "fp32"), ("hybrid", "dflash", "fp8", "fp32"),
    ("hybrid", "none", "bf16", "bf16"), ("hybrid", "mtp", "bf16", "bf16"),
    ("dense", "none", "fp8", "fp32"), ("dense", "dflash", "fp8", "fp32"),
    ("hybrid_moe", "none", "fp32", "fp32"), ("hybrid_moe", "mtp", "fp32", "fp32"),
]


def assert_equal_or_bf16_tie(eager, ref, got):
    if got == ref:
        return
    i = next(j for j, (a, b) in enumerate(zip(ref, got)) if a != b)
    prompt = eager.tokenizer.encode(PROMPT, add_special_tokens=False)
    eager.state.reset()
    logits = eager.model(torch.tensor([prompt + ref[:i]]), eager.state).logits[0, -1]
    eager.state.reset()
    top2 = logits.topk(2).values
    step = top2[0].abs().item() * 2.0 ** -7        # bf16 keeps 8 significant bits
    assert (top2[0] - top2[1]).item() <= step, (
        f"compiled tokens diverge at token {i} ({got[i]} vs {ref[i]}) without a tie: "
        f"top-2 logits {top2.tolist()}")


@pytest.mark.parametrize("kind,method,kv,dtype", CASES)
def test_compiled_tokens_equal_eager(pairs, kind, method, kv, dtype):
    eager, compiled = pairs(kind, kv, dtype)
    before = compiled.model.static.calls
    head = compiled.proposers["mtp"].head.static if "mtp" in compiled.proposers else None
    dflash = compiled.proposers.get("dflash")
    drafter = dflash.drafter.static if dflash is not None else None
    head_before = head.calls if head is not None else 0
    chain_before = head.chain_calls if head is not None else 0
    drafter_before = drafter.calls if drafter is not None else 0
    ref, got = _generate(eager, method), _generate(compiled, method)
    if dtype == "bf16":
        assert_equal_or_bf16_tie(eager, ref.token_ids, got.token_ids)
        return
    assert got.token_ids == ref.token_ids
    # every decode and verify forward ran compiled; the MoE routing record came through
    assert compiled.model.static.calls - before == got.stats.cycles
    assert got.stats.compiled and not ref.stats.compiled
    assert got.stats.experts_per_verify == ref.stats.experts_per_verify
    if method != "none":
        assert got.stats.drafted > 0
    if method == "mtp":   # the head's drafting steps ran compiled too, each chain in one
        assert head.calls - head_before >= got.stats.cycles     # graph with eager's drafts
        assert head.chain_calls > chain_before and got.stats.accepted == ref.stats.accepted
    if method == "dflash":  # and so did every DFlash proposal
        assert drafter.calls - drafter_before == got.stats.method_cycles["dflash"]


def test_a_batch_drafts_each_mtp_chain_in_one_graph(pairs):
    """A compiled batch's MTP forks draft every chain after its first draft in one graph
    call (`StaticHead.run_chain`): the tokens and the accepted drafts of the eager batch,
    whose head drafts step by step (blocks never cut: every row bucket costs the same).
    The head runs over the asking rows' batch bucket: the last request, left alone on row
    0, over that row only (a CPU's head costs every row it runs)."""
    eager, compiled = pairs("hybrid")
    tok = eager.tokenizer
    prompts = [tok.encode(text, add_special_tokens=False)
               for text in (PROMPT, "pick the red cup", PROMPT + " and wait")]

    def requests():
        return [BatchRequest(p, GenerationSettings(24 + 4 * i, ignore_eos=True, method="mtp"))
                for i, p in enumerate(prompts)]

    ref = Batch(eager, max_batch=2).run(requests())
    batch = Batch(compiled, max_batch=2)
    head, static = batch.slots.heads.static, batch.slots.static
    assert head.chain == BLOCK - 1
    assert head.batches == (1, 2)
    before, measured = head.chain_calls, dict(static.seconds)
    static.seconds.update({key: 1.0 for key in measured})
    rows, run_chain = [], head.run_chain

    def recording(now, state):
        rows.append(now.shape[0])
        return run_chain(now, state)

    head.run_chain = recording
    try:
        got = batch.run(requests())
    finally:
        static.seconds.update(measured)
        del head.run_chain
    assert [g.token_ids for g in got] == [r.token_ids for r in ref]
    assert [g.stats.accepted for g in got] == [r.stats.accepted for r in ref]
    assert head.chain_calls - before == len(rows) >= batch.stats.cycles // 2 > 0
    assert 1 in rows and set(rows) <= {1, 2}


@pytest.mark.parametrize("method", ["dflash", "mtp"])
def test_a_sampled_request_gives_the_eager_tokens_compiled(pairs, method):
    """Sampling draws from the same noise, and the compiled drafter hands its logits to the
    sampled pick: the same tokens, and the DFlash proposals still ran compiled."""
    eager, compiled = pairs("hybrid")
    drafter = compiled.proposers["dflash"].drafter.static
    before = drafter.calls
    sampling = Sampling(QWEN3_THINKING, QWEN3_THINKING, seed=4)
    ref, got = (_generate(e, method, sampling=sampling) for e in (eager, compiled))
    assert got.token_ids == ref.token_ids and got.stats.seed == 4
    if method == "dflash":
        assert drafter.calls - before == got.stats.method_cycles["dflash"] > 0


@pytest.mark.parametrize("sampled", [False, True])
def test_a_dflash2_drafter_runs_compiled_with_the_eager_tokens(
        checkpoints, make_engine, tmp_path_factory, compile_cache, sampled):
    """The DFlash2 block (convs, two-sided window) and its selector's pair scores as one
    compiled graph; the walk after it draws greedy or sampled drafts as eager does."""
    path = checkpoints("hybrid", init=0.25, layers=LAYERS, mtp=True)
    drafter = write_tiny_drafter(tmp_path_factory.mktemp("dflash2"), path, num_layers=2,
                                 block_size=BLOCK, sliding_window=3,
                                 layer_types=["sliding_attention"] * 2, dflash2={})
    common = dict(max_batch=1, drafter_path=str(drafter), method="dflash", max_block=BLOCK,
                  compile_cache=compile_cache)
    eager, compiled = (make_engine(path, compile=c, **common) for c in ("off", "on"))
    sampling = Sampling(QWEN3_THINKING, QWEN3_THINKING, seed=4) if sampled else None
    ref, got = (_generate(e, "dflash", sampling=sampling) for e in (eager, compiled))
    static = compiled.proposers["dflash"].drafter.static
    assert static.calls == got.stats.method_cycles["dflash"] > 0
    assert got.token_ids == ref.token_ids and got.stats.accepted == ref.stats.accepted


@pytest.mark.parametrize("method", ["none", "dflash", "mtp"])
def test_compiled_tokens_equal_eager_under_the_grammar(pairs, method):
    eager, compiled = pairs("hybrid")
    grammar = JsonGrammarCompiler.for_engine(eager).compile(SCHEMA)
    # room for the thought this random model writes before its JSON (about 80 tokens)
    ref = _generate(eager, method, 128, constraint=grammar.constraint())
    got = _generate(compiled, method, 128, constraint=grammar.constraint())
    assert got.token_ids == ref.token_ids and got.finish_reason == ref.finish_reason == "eos"


def test_compiled_forwards_read_only_the_rows_in_use(pairs):
    """A static forward's attention reads the cache up to its block's last position
    (`cache_attention`), not to its capacity: with every row NaN before the request (FP8: its
    NaN code), the target's and the MTP head's compiled forwards give eager's tokens. Reading
    the capacity under a mask, as the graphs once did, gives NaN (a weight of 0 times NaN)."""
    eager, compiled = pairs("hybrid", "fp8")
    ref = _generate(eager, "mtp")
    head = compiled.proposers["mtp"].head.static
    states = (compiled.model.static.state, head.state)
    calls, head_calls = compiled.model.static.calls, head.calls
    for state in states:
        poison(state.kv)
    try:
        got = _generate(compiled, "mtp")
    finally:
        for state in states:
            state.kv.clear()
    assert got.token_ids == ref.token_ids
    assert compiled.model.static.calls - calls == got.stats.cycles
    assert head.calls > head_calls


def test_varied_requests_never_recompile_nor_break_the_graph(pairs, graphs_obtained):
    eager, compiled = pairs("hybrid")
    vocab = compiled.model_config.vocab_size
    _generate(compiled, "none", 4)
    obtained = graphs_obtained()
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    grammar = JsonGrammarCompiler.for_engine(compiled).compile(SCHEMA)
    tok = compiled.tokenizer
    for i, text in enumerate(["pick", PROMPT, PROMPT + " and wait " * 8]):
        prompt = tok.encode(text, add_special_tokens=False)
        for method in ("none", "dflash", "mtp", "auto"):
            generate(compiled, prompt, GenerationSettings(9 + 7 * i, ignore_eos=True,
                                                          method=method))
        for block in (2, 3, 4):            # every verify size: 2, 3 and 4 rows
            ref = generate(eager, prompt, GenerationSettings(30, ignore_eos=True,
                                                             speculative=False)).token_ids
            replay = ReplayProposer(ref, vocab, block_size=block, seed=block + i)
            got = generate(compiled, prompt, GenerationSettings(30, ignore_eos=True),
                           proposer=replay)
            assert got.token_ids == ref
        generate(compiled, prompt, GenerationSettings(64, method="dflash"),
                 constraint=grammar.constraint())
    assert obtained == []
    assert counters["stats"]["unique_graphs"] == graphs
    assert sum(counters["graph_break"].values()) == breaks


def test_prefix_restore_and_cancel_work_compiled(pairs):
    eager, compiled = pairs("hybrid", "fp8")
    tok = compiled.tokenizer
    prefix = tok.encode("plan with these skills: pick, place, open, close, wait",
                        add_special_tokens=False)
    settings = GenerationSettings(24, ignore_eos=True, method="mtp")
    for task in (" task one", " task two"):
        prompt = prefix + tok.encode(task, add_special_tokens=False)
        ref = generate(eager, prompt, settings, prefix=prefix)
        got = generate(compiled, prompt, settings, prefix=prefix)
        assert got.token_ids == ref.token_ids
    assert got.stats.prefix_hit
    cancel = CancelToken()
    cycles = []

    def on_token(ids, _delta):
        cycles.append(len(ids))
        cancel.cancel()

    out = generate(compiled, prompt, GenerationSettings(64, ignore_eos=True, method="mtp"),
                   on_token=on_token, cancel=cancel)
    assert out.finish_reason == "cancelled" and len(cycles) == 1


def test_spans_share_one_graph_and_read_packed_tensors(checkpoints, make_engine,
                                                       compile_cache, monkeypatch):
    """Two spans of [GDN, attention] (the CPU's 8-layer spans lowered to 2 for a small
    model): one graph per bucket serves both, each span's tensors packed, aligned views."""
    monkeypatch.setitem(compiled_mod.SPAN_LAYERS, "cpu", 2)
    path = checkpoints("hybrid", init=0.25, layers=4)
    common = dict(max_batch=1, max_block=2, mtp_steps=1, compile_cache=compile_cache)
    eager, compiled = (make_engine(path, compile=c, **common) for c in ("off", "on"))
    static = compiled.model.static
    report = compiled.compile_report
    assert report.spans == 2 and len({id(s.steps) for s in static.spans_of}) == 1
    assert report.graphs == 3 * len(report.buckets)   # entry, one span graph, head
    owners = [{f.untyped_storage().data_ptr() for f in span.flats} for span in static.spans_of]
    for i, layer in enumerate(compiled.model.layers):
        tensors = list(layer.parameters()) + list(layer.buffers())
        assert tensors
        for t in tensors:
            assert t.untyped_storage().data_ptr() in owners[i // 2]
            assert t.data_ptr() % compiled_mod.ALIGN_BYTES == 0
    _plain_and_verified_as_eager(eager, compiled, seed=1)


def test_decode_and_verify_call_the_compiled_code_without_dynamo(pairs, monkeypatch):
    """After warm-up every decode and verify forward of the target calls its compiled code
    by site (direct.py): with dynamo's path made to fail, the tokens are still eager's."""
    eager, compiled = pairs("hybrid")
    assert compiled.model.static.direct
    prompt = eager.tokenizer.encode(PROMPT, add_special_tokens=False)
    ref = generate(eager, prompt, GenerationSettings(30, ignore_eos=True,
                                                     speculative=False)).token_ids

    def no_dynamo(self, *args):
        raise AssertionError("a compiled graph was called through dynamo")

    monkeypatch.setattr(direct_mod.DirectGraph, "__call__", no_dynamo)
    plain = generate(compiled, prompt, GenerationSettings(30, ignore_eos=True,
                                                          speculative=False))
    replay = ReplayProposer(ref, compiled.model_config.vocab_size, block_size=BLOCK, seed=3)
    verified = generate(compiled, prompt, GenerationSettings(30, ignore_eos=True),
                        proposer=replay)
    assert plain.token_ids == verified.token_ids == ref and verified.stats.accepted > 0


def test_direct_calls_that_disagree_with_dynamo_are_not_used(checkpoints, make_engine,
                                                            compile_cache, monkeypatch,
                                                            caplog):
    """Warm-up runs each bucket twice, through dynamo then by site; a site whose result
    differs (here: logits off by 1e-3) turns direct calls off, and dynamo serves."""
    learn = direct_mod.DirectGraph._site

    def off_by_a_little(*args):
        site = learn(*args)
        fn = site.fn

        def wrong(inputs):
            out = list(fn(inputs))
            out[0] = out[0] + 1e-3
            return out

        site.fn = wrong
        return site

    monkeypatch.setattr(direct_mod.DirectGraph, "_site", staticmethod(off_by_a_little))
    path = checkpoints("hybrid", init=0.25, layers=LAYERS)
    common = dict(max_batch=1, max_block=2, mtp_steps=1, compile_cache=compile_cache)
    eager = make_engine(path, compile="off", **common)
    with caplog.at_level("WARNING"):
        compiled = make_engine(path, compile="on", **common)
    assert not compiled.model.static.direct
    assert "direct calls failed their check" in caplog.text
    prompt = eager.tokenizer.encode(PROMPT, add_special_tokens=False)
    settings = GenerationSettings(24, ignore_eos=True, speculative=False)
    got = generate(compiled, prompt, settings)
    assert got.token_ids == generate(eager, prompt, settings).token_ids and got.stats.compiled


def test_a_second_engine_reads_every_graph_from_the_store(checkpoints, make_engine,
                                                          compile_cache, graphs_obtained):
    """A start with the graphs on disk compiles none (torch.compile is never called): each
    is read back, called directly after its check, and the tokens are eager's."""
    path = checkpoints("hybrid", init=0.25, layers=LAYERS)
    common = dict(max_batch=1, max_block=2, mtp_steps=1, compile_cache=compile_cache)
    eager = make_engine(path, compile="off", **common)
    make_engine(path, compile="on", **common)          # compiles, or reads an earlier run's
    obtained = graphs_obtained()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "compile", _no_compile)
        again = make_engine(path, compile="on", **common)
    report = again.compile_report
    assert report.read == report.graphs == len(obtained) > 0
    assert "target" in report.parts and again.model.static.direct
    assert _plain_and_verified_as_eager(eager, again, seed=2).stats.accepted > 0


def test_rarer_buckets_compile_in_the_background_then_serve(checkpoints, make_engine,
                                                            compile_cache, graphs_obtained):
    """compile_lazy: the warm-up compiles the target's and the MTP head's buckets of plain
    decoding and of the head's block (1 and 2 rows), their 4-row buckets in the background
    without running them; once ready, verifies run their graphs (none compiled then) with
    eager's tokens, and their cost is measured on their first calls."""
    path = checkpoints("hybrid", init=0.25, layers=LAYERS, mtp=True)
    common = dict(max_batch=1, max_block=BLOCK, mtp_steps=1, compile_cache=compile_cache)
    eager = make_engine(path, compile="off", **common)
    compiled = make_engine(path, compile="on", compile_lazy=True, **common)
    static, head = compiled.model.static, compiled.proposers["mtp"].head.static
    assert compiled.compile_report.deferred == 2          # the target's and the head's
    assert compiled.wait_compiled(timeout=600)
    assert static.compiled_all() and head.compiled_all()
    obtained = graphs_obtained()
    prompt = eager.tokenizer.encode(PROMPT, add_special_tokens=False)
    ref = generate(eager, prompt, GenerationSettings(30, ignore_eos=True,
                                                     speculative=False)).token_ids
    calls = static.calls
    replay = ReplayProposer(ref, compiled.model_config.vocab_size, block_size=BLOCK, seed=5)
    got = generate(compiled, prompt, GenerationSettings(30, ignore_eos=True),
                   proposer=replay)
    assert got.token_ids == ref and static.calls - calls == got.stats.cycles
    assert (1, BLOCK) in static.seconds
    mtp = GenerationSettings(30, ignore_eos=True, method="mtp")
    assert (generate(compiled, prompt, mtp).token_ids
            == generate(eager, prompt, mtp).token_ids)
    assert obtained == []


def test_a_batch_of_several_compiles_in_the_background_and_runs_eager_until_then(
        pairs, graphs_obtained):
    """compile_lazy: a batch's graphs for one request (target, MTP head and its chain)
    compile when the batch's slots are made; those for 2 requests (the forwards, the
    chain, the DFlash drafter's group) are left to the background. Until they are
    ready (held back here: `hold_background`) a batch of two runs them eager; then every
    cycle runs compiled, nothing compiled then; the tokens are the eager batch's both
    times."""
    eager, compiled = pairs("hybrid")
    tok = eager.tokenizer
    prompts = [tok.encode(text, add_special_tokens=False)
               for text in (PROMPT, "pick the red cup", PROMPT + " and wait", "wait")]

    def requests():   # two drafting with DFlash together, then two with MTP
        return [BatchRequest(p, GenerationSettings(24 + 4 * i, ignore_eos=True, method=m))
                for i, (p, m) in enumerate(zip(prompts, ("dflash", "dflash", "mtp", "mtp")))]

    ref = [r.token_ids for r in Batch(eager, max_batch=2).run(requests())]
    lazy = Engine.load(replace(compiled.config, compile_lazy=True), hold_background=True)
    batch = Batch(lazy, max_batch=2)
    assert lazy._later is None                     # held: no thread started
    static, head, drafts = batch.slots.static, batch.slots.heads.static, batch.slots.drafts
    assert static.ready == {(1, 1), (1, BLOCK)}
    assert set(static.later) == set(static.keys) - static.ready
    assert ("chain", 1) in head.ready and ("chain", 2) in head.later
    assert drafts.ready == set() and drafts.later == (2,) and not drafts.compiled_all()
    assert [g.token_ids for g in batch.run(requests())] == ref
    assert drafts.calls == 0 and batch.stats.cycles > static.calls
    lazy.compile_in_background(release=True)
    assert lazy.wait_compiled(timeout=600)
    assert static.compiled_all() and head.compiled_all() and drafts.compiled_all()
    obtained = graphs_obtained()
    calls, chains = static.calls, head.chain_calls
    batch = Batch(lazy, max_batch=2)
    assert [g.token_ids for g in batch.run(requests())] == ref
    assert static.calls - calls == batch.stats.cycles and obtained == []
    assert drafts.calls > 0 and head.chain_calls > chains


def _plain_and_verified_as_eager(eager, compiled, seed: int):
    """Plain decoding and 2-row verifies of eager's tokens on `compiled` give eager's tokens,
    compiled -> the verified run."""
    prompt = eager.tokenizer.encode(PROMPT, add_special_tokens=False)
    settings = GenerationSettings(24, ignore_eos=True, speculative=False)
    ref = generate(eager, prompt, settings).token_ids
    assert generate(compiled, prompt, settings).token_ids == ref
    replay = ReplayProposer(ref, compiled.model_config.vocab_size, block_size=2, seed=seed)
    got = generate(compiled, prompt, GenerationSettings(24, ignore_eos=True), proposer=replay)
    assert got.token_ids == ref and got.stats.compiled
    return got


def _no_compile(*args, **kwargs):
    raise AssertionError("a graph stored on disk was compiled again")


def test_weights_quantized_at_load_run_compiled(checkpoints, make_engine, compile_cache):
    """NVFP4 weights (packed bytes, FP8 block scales, float global scales: three dtypes
    beside the float ones) go through the span packing and the graph as through eager."""
    path = checkpoints("hybrid", init=0.25, layers=LAYERS)
    common = dict(max_batch=1, max_block=2, mtp_steps=1, compile_cache=compile_cache,
                  weights="nvfp4")
    eager, compiled = (make_engine(path, compile=c, **common) for c in ("off", "on"))
    prompt = eager.tokenizer.encode(PROMPT, add_special_tokens=False)
    settings = GenerationSettings(24, ignore_eos=True, speculative=False)
    ref = generate(eager, prompt, settings).token_ids
    got = generate(compiled, prompt, settings)
    assert got.token_ids == ref and got.stats.compiled


def test_compile_settings_are_checked():
    with pytest.raises(ConfigError, match="compile must be one of"):
        EngineConfig(model_path="x", compile="yes")
    with pytest.raises(ConfigError, match="dense_backend 'onnxruntime'"):
        EngineConfig(model_path="x", compile="on", dense_backend="onnxruntime")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not EngineConfig(model_path="x").resolve_compile(cpu)
    assert EngineConfig(model_path="x").resolve_compile(cuda)
    assert not EngineConfig(model_path="x", compile="off").resolve_compile(cuda)
    assert EngineConfig(model_path="x", compile="on").resolve_compile(cpu)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("method", ["none", "dflash", "mtp"])
def test_cuda_graphs_give_the_eager_tokens(checkpoints, make_engine, tmp_path, method, dtype):
    """fp32: the same tokens; bf16: the same, or a first difference at a bf16 tie of the
    eager logits (fused kernels round differently)."""
    path = checkpoints("hybrid", init=0.25, mtp=True)
    drafter = write_tiny_drafter(tmp_path / "drafter", path, num_layers=2, block_size=BLOCK)
    common = dict(max_batch=1, device="cuda", dtype=dtype, drafter_path=str(drafter),
                  max_block=BLOCK, mtp_steps=BLOCK - 1, compile_cache=str(tmp_path / "cache"))
    eager = make_engine(path, compile="off", **common)
    graphs = make_engine(path, compile="on", **common)
    assert graphs.compile_report.backend == "inductor + CUDA graphs"
    ref, got = _generate(eager, method).token_ids, _generate(graphs, method).token_ids
    if dtype == "bf16":
        assert_equal_or_bf16_tie(eager, ref, got)
    else:
        assert got == ref
