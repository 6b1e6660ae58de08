"""In-flight batched decoding (engine/batch.py): every request's tokens equal the same
request decoded alone, whatever else runs beside it, joins or leaves.

Tiny random checkpoints written by transformers: hybrid (GDN + attention, with an MTP head
and a DFlash drafter), dense and MoE targets, fp32 and FP8 KV. A random drafter's drafts are
nearly always rejected, so requests also draft with replay proposers (the true continuation,
wrong at a random offset) to commit every accepted length while other rows are padded.
"""

from __future__ import annotations

import pytest
import torch
from poisoned_cache import poison

from flash_planner.engine.batch import Batch, BatchRequest
from flash_planner.engine.generate import CancelToken, GenerationSettings, generate
from flash_planner.engine.loop.proposer import ReplayProposer
from flash_planner.engine.loop.sampling import Sampling, SamplingParams
from flash_planner.train.tiny import write_tiny_drafter

PROMPTS = ["open the top drawer", "take the blue screwdriver from the shelf and",
           "go", "bring the red cup to the kitchen table, then wipe the",
           "pick up the sponge", "say hello to the operator and wait for",
           "turn left", "move the chair next to the window"]


@pytest.fixture(scope="module")
def engines(checkpoints, make_engine, tmp_path_factory):
    """(kind, kv) -> an engine with every proposer it can load (method auto)."""
    made = {}

    def get(kind: str, kv: str):
        if (kind, kv) not in made:
            mtp = kind.startswith("hybrid")
            target = checkpoints(kind, mtp=True, init=0.25) if mtp else checkpoints(kind)
            drafter = write_tiny_drafter(tmp_path_factory.mktemp("drafter"), target)
            made[kind, kv] = make_engine(target, drafter_path=str(drafter), kv_dtype=kv,
                                         method="auto", mtp_steps=3, prefill_chunk=16)
        return made[kind, kv]

    return get


def _ids(engine, text):
    return engine.tokenizer.encode(text, add_special_tokens=False)


def _requests(engine, methods, replay_from=None, new_tokens=(24, 9, 31, 16, 40, 12, 20, 28),
              replay_block=6):
    """One request per prompt, cycling through `methods` ("replay": the request's own
    replay proposer over `replay_from[i]`'s tokens, blocks of `replay_block`)."""
    out = []
    for i, text in enumerate(PROMPTS):
        method = methods[i % len(methods)]
        settings = GenerationSettings(new_tokens[i], ignore_eos=True,
                                      method=None if method == "replay" else method)
        proposer = None
        if method == "replay":
            proposer = ReplayProposer(replay_from[i], engine.model_config.vocab_size,
                                      block_size=replay_block, seed=i)
        out.append(BatchRequest(_ids(engine, text), settings, proposer=proposer))
    return out


def _join_midway(batch, requests, first: int, cycles: int):
    """The first `first` requests submitted, `cycles` cycles run, then the rest: their
    results once all have ended."""
    futures = [batch.submit(r) for r in requests[:first]]
    for _ in range(cycles):
        batch.step()
    futures += [batch.submit(r) for r in requests[first:]]
    while not all(f.done() for f in futures):
        batch.step()
    return [f.result() for f in futures]


def _alone(engine, requests):
    return [generate(engine, r.prompt, r.settings,
                     proposer=None if r.proposer is None else r.proposer.fork())
            for r in requests]


@pytest.mark.parametrize("kind,kv", [("hybrid", "fp32"), ("hybrid", "fp8"),
                                     ("dense", "fp32"), ("hybrid_moe", "fp8")])
def test_batched_requests_equal_each_request_alone(engines, kind, kv):
    engine = engines(kind, kv)
    methods = ["none", "dflash", "auto"] + (["mtp"] if "mtp" in engine.proposers else [])
    plain = _alone(engine, _requests(engine, ["none"]))
    requests = _requests(engine, methods + ["replay"], [p.token_ids for p in plain])
    alone = _alone(engine, requests)
    assert [a.token_ids for a in alone] == [p.token_ids for p in plain]
    batch = Batch(engine, max_batch=4)
    # half arrive now, the rest while those decode: they wait for slots, join mid-decode
    got = _join_midway(batch, requests, 4, 3)
    for a, g, r in zip(alone, got, requests):
        assert g.token_ids == a.token_ids, (r.settings.method, r.proposer)
        assert g.finish_reason == a.finish_reason == "length"
        # each request waited on the verifies it took part in (not only the first row's)
        assert g.stats.phase_ms["verify"] > 0
        # MoE: the experts its own rows chose, per verify size, as alone (a batched GEMM
        # rounds otherwise, which may flip a router's near tie without changing a token;
        # `auto` drafts with the batch's common choice and a replay fork errs elsewhere, so
        # their block sizes are their own)
        got_experts, want = g.stats.experts_per_verify, a.stats.experts_per_verify
        if r.settings.method in ("none", "dflash", "mtp"):
            assert got_experts.keys() == want.keys()
            assert all(got_experts[k] == pytest.approx(want[k], rel=0.1) for k in want)
    assert batch.stats.cycles < sum(len(a.token_ids) for a in alone)  # rows were batched
    assert batch.running == 0 and batch.waiting == 0


def test_a_cancelled_and_a_failing_request_end_alone(engines):
    engine = engines("hybrid", "fp32")
    requests = _requests(engine, ["auto", "mtp", "none", "dflash"])[:6]
    alone = _alone(engine, requests)
    cancel = CancelToken()
    seen: list[int] = []

    def cancel_after_five(ids, _text):
        seen.extend(ids)
        if len(seen) >= 5:
            cancel.cancel()

    count = [0]

    def fail_after_seven(ids, _text):
        count[0] += len(ids)
        if count[0] >= 7:
            raise RuntimeError("the listener broke")

    requests[1].cancel, requests[1].on_token = cancel, cancel_after_five
    requests[2].on_token = fail_after_seven
    batch = Batch(engine, max_batch=4)
    futures = [batch.submit(r) for r in requests]
    while not all(f.done() for f in futures):
        batch.step()
    with pytest.raises(RuntimeError, match="the listener broke"):
        futures[2].result()
    stopped = futures[1].result()
    assert stopped.finish_reason == "cancelled"
    assert stopped.token_ids == alone[1].token_ids[:len(stopped.token_ids)]
    assert len(stopped.token_ids) < len(alone[1].token_ids)
    for i in (0, 3, 4, 5):
        assert futures[i].result().token_ids == alone[i].token_ids
    # nothing of the ended requests survives into the slots' next requests
    again = batch.run(_requests(engine, ["dflash", "auto", "mtp", "none"])[:5])
    expected = _alone(engine, _requests(engine, ["dflash", "auto", "mtp", "none"])[:5])
    assert [g.token_ids for g in again] == [e.token_ids for e in expected]


def test_a_refused_request_fails_alone(engines):
    engine = engines("dense", "fp32")
    good = _requests(engine, ["none"])[:2]
    too_long = BatchRequest([5] * 600, GenerationSettings(8))
    batch = Batch(engine, max_batch=2)
    futures = [batch.submit(r) for r in (good[0], too_long, good[1])]
    while not all(f.done() for f in futures):
        batch.step()
    with pytest.raises(ValueError, match="max_context"):
        futures[1].result()
    assert [futures[0].result().token_ids, futures[2].result().token_ids] == \
        [a.token_ids for a in _alone(engine, good)]


def test_seeded_sampled_requests_batched_equal_alone(engines):
    """Sampling noise is keyed by (seed, position): a seeded request samples the very
    tokens in a batch that it samples alone, whichever method drafts."""
    engine = engines("hybrid", "fp32")
    sampling = Sampling(SamplingParams(temperature=1.2, top_k=5),
                        SamplingParams(temperature=1.2, top_k=5), seed=0)
    requests = []
    for i, r in enumerate(_requests(engine, ["none", "mtp", "dflash", "auto"])[:6]):
        settings = GenerationSettings(20, ignore_eos=True, method=r.settings.method,
                                      sampling=sampling.with_seed(100 + i))
        requests.append(BatchRequest(r.prompt, settings))
    alone = _alone(engine, requests)
    got = Batch(engine, max_batch=3).run(requests)
    assert [g.token_ids for g in got] == [a.token_ids for a in alone]
    assert len({tuple(a.token_ids) for a in alone}) > 1


def test_a_long_prompt_prefills_between_the_running_requests_cycles(engines):
    engine = engines("hybrid", "fp32")          # prefill_chunk 16: the budget per cycle
    events: list[str] = []
    short = BatchRequest(_ids(engine, PROMPTS[0]), GenerationSettings(40, ignore_eos=True,
                                                                      method="none"),
                         on_token=lambda ids, _t: events.append("short"))
    long_prompt = _ids(engine, " ".join(PROMPTS * 3))
    assert len(long_prompt) > 5 * engine.config.prefill_chunk
    late = BatchRequest(long_prompt, GenerationSettings(4, ignore_eos=True, method="none"),
                        on_token=lambda ids, _t: events.append("long"))
    batch = Batch(engine, max_batch=2)
    first = batch.submit(short)
    batch.step()
    batch.step()
    events.append("submitted")
    second = batch.submit(late)
    while not (first.done() and second.done()):
        batch.step()
    between = events[events.index("submitted"):events.index("long")]
    chunks = -(-len(long_prompt) // engine.config.prefill_chunk)
    assert between.count("short") >= chunks - 1
    assert second.result().token_ids == generate(engine, long_prompt, late.settings).token_ids
    assert first.result().token_ids == generate(engine, short.prompt, short.settings).token_ids


def test_a_batch_of_one_decodes_on_the_engines_own_state(engines):
    """max_batch 1 keeps the engine's state and proposers (and so its compiled forwards):
    requests queue and run one after another, as `generate` runs them."""
    engine = engines("hybrid", "fp8")
    requests = _requests(engine, ["auto", "mtp", "dflash", "none"])[:4]
    alone = _alone(engine, requests)
    batch = Batch(engine, max_batch=1)
    assert batch.slots.view(0) is engine.state
    got = batch.run(requests)
    assert [g.token_ids for g in got] == [a.token_ids for a in alone]
    assert batch.stats.cycles == sum(g.stats.cycles for g in got)


def test_requests_take_the_lowest_free_mtp_head_rows(engines, monkeypatch):
    """The MTP head drafts a batch's forks over rows 0.. up to the highest asking one, so
    a request takes the lowest free head row: the first ones, and every later one,
    requests having ended and given theirs back (a lone request on row 2 of 3 and
    another's on row 0 would pay for all 3)."""
    from flash_planner.engine.loop.mtp_proposer import MTPProposer

    engine = engines("hybrid", "fp32")
    requests = _requests(engine, ["mtp"])[:4]
    batch = Batch(engine, max_batch=3)
    asking: list[int] = []
    ask = MTPProposer.ask

    def recording(self, anchor, start, num):
        asking.append(self.row)
        return ask(self, anchor, start, num)

    monkeypatch.setattr(MTPProposer, "ask", recording)
    batch.run(requests[:3])
    assert set(asking) == {0, 1, 2}
    for lone in requests[3:]:
        asking.clear()
        batch.run([lone])
        assert asking and set(asking) == {0}
    assert [p["mtp"].row for p in batch._pool] == [2, 1, 0]


@pytest.mark.parametrize("dflash2", [False, True])
def test_drafts_made_together_equal_each_request_alone(checkpoints, make_engine,
                                                       tmp_path_factory, dflash2):
    """One drafter forward for several requests (windows of different lengths padded,
    each block at its own start) drafts what each request drafts alone."""
    from flash_planner.engine.generate import prefill
    from flash_planner.engine.loop.proposer import DraftAsk, draft_together

    target = checkpoints("hybrid")
    drafter = write_tiny_drafter(tmp_path_factory.mktemp("together"), target,
                                 dflash2={} if dflash2 else None)
    engine = make_engine(target, drafter_path=str(drafter), method="dflash", window=12)
    asks = []
    for i, text in enumerate(PROMPTS[:4]):
        proposer = engine.proposers["dflash"].fork()
        ids = _ids(engine, text)
        _, taps = prefill(engine, ids, proposer.tap_ids, proposer.seed_rows)
        proposer.begin(ids, taps)
        anchor = torch.tensor([ids[i % len(ids)]])
        asks.append(proposer.ask(anchor, len(ids), (7, 3, 5, 7)[i]))
    assert all(isinstance(a, DraftAsk) for a in asks)
    assert len({len(a.proposer.window) for a in asks}) > 1        # windows of other lengths
    together = draft_together(asks)
    alone = [a.proposer.propose(a.anchor, a.start, a.num) for a in asks]
    assert [t.tolist() for t in together] == [a.tolist() for a in alone]
    assert [len(t) for t in together] == [7, 3, 5, 7]


@pytest.mark.parametrize("kv", ["fp32", "fp8"])
def test_mtp_drafts_made_together_equal_each_request_alone(checkpoints, make_engine, kv):
    """Forks whose MTP caches are rows of one state draft through the head together (the
    last commit's rows padded to the longest, then each chain step, a row each; a row that
    does not ask only pads): the drafts and the caches they leave are each request's alone,
    over three cycles with different commits. Catch-ups (the prompt's rows; rows of a cycle
    another proposer drafted) go through the head together once a cache is calibrated."""
    from flash_planner.engine.generate import prefill
    from flash_planner.engine.loop.proposer import DraftAsk, draft_together

    engine = make_engine(checkpoints("hybrid", mtp=True, init=0.25), method="mtp",
                         mtp_steps=5, kv_dtype=kv)
    mtp = engine.proposers["mtp"]
    slots = mtp.head_slots(4)
    together = [mtp.fork(slots, i) for i in range(4)]
    alone = [mtp.fork() for _ in range(4)]
    starts = {}
    for i in (0, 2, 3):                      # row 1 idle: it pads
        ids = _ids(engine, PROMPTS[i])
        _, taps = prefill(engine, ids, mtp.tap_ids, len(ids))
        for p in (together[i], alone[i]):
            p.begin(ids, taps)
        starts[i] = len(ids)
    for cycle, nums in enumerate(((5, 0, 2, 4), (3, 0, 5, 1), (2, 0, 4, 3))):
        asks = [together[i].ask(torch.tensor([7 + i + cycle]), starts[i], nums[i])
                for i in (0, 2, 3)]
        assert all(isinstance(a, DraftAsk) for a in asks)
        got = draft_together(asks)
        want = [alone[i].propose(a.anchor, a.start, a.num) for i, a in zip((0, 2, 3), asks)]
        assert [g.tolist() for g in got] == [w.tolist() for w in want]
        for i, a, g in zip((0, 2, 3), asks, got):
            assert together[i].state.length == alone[i].state.length == a.start
            n = 1 + i % 3                      # commit the anchor and some drafts
            rows = [int(a.anchor)] + g.tolist()[:n - 1]
            taps = torch.randn(1, n, engine.model_config.hidden_size,
                               generator=torch.Generator().manual_seed(i + cycle))
            for p in (together[i], alone[i]):
                p.commit(rows, taps, a.start)
            starts[i] = a.start + n
        for i, extra in ((0, 3), (3, 2)) if cycle == 1 else ():
            # a cycle another proposer drafted: rows 0 and 3 catch up together next
            taps = torch.randn(1, extra, engine.model_config.hidden_size,
                               generator=torch.Generator().manual_seed(10 + i))
            for p in (together[i], alone[i]):
                p.commit([5 + j for j in range(extra)], taps, starts[i])
            starts[i] += extra
    for i in (0, 2, 3):              # the same entries, to the rounding of a batched GEMM
        length = together[i].state.length
        a, b = (p.state.kv.k[:, :, :length] for p in (together[i], alone[i]))
        if kv == "fp8":                  # e4m3 bit patterns: at most one step apart
            assert (a.int() - b.int()).abs().max() <= 1
        else:
            assert torch.allclose(a, b, atol=1e-5)


def test_auto_requests_in_a_batch_draft_with_their_common_choice(engines, monkeypatch):
    """Each cycle every auto request drafts with the candidate most of them prefer (one
    drafter forward for all), and their tokens stay their own alone. Three routers are
    made to prefer the DFlash drafter and two the MTP head: the first cycle drafts with the
    drafter; each cycle drafts with one candidate."""
    from flash_planner.engine.loop.auto_proposer import AutoProposer, Estimate

    engine = engines("hybrid", "fp32")
    requests = _requests(engine, ["auto"])[:5]
    alone = _alone(engine, requests)
    batch = Batch(engine, max_batch=5)
    for i, proposers in enumerate(batch._pool):
        router = proposers["auto"]
        liked = "mtp" if i < 2 else "dflash"
        for phase in ("think", "answer"):
            for cand in router.candidates:       # settled, never stale, `liked` fastest
                rate = 9.0 if cand == liked else 1.0
                router.estimates[phase, cand] = Estimate(rate, 1.0, 10**9, 99)
    chosen: dict[int, set[str]] = {}
    ask = AutoProposer.ask

    def recording(self, anchor, start, num):
        out = ask(self, anchor, start, num)
        chosen.setdefault(batch.stats.cycles, set()).add(self._method)
        return out

    monkeypatch.setattr(AutoProposer, "ask", recording)
    got = batch.run(requests)
    assert [g.token_ids for g in got] == [a.token_ids for a in alone]
    assert chosen[0] == {"dflash"}
    assert len(chosen) > 3 and all(len(methods) == 1 for methods in chosen.values())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA GPU"))])
def test_compiled_batches_equal_each_request_alone(checkpoints, make_engine, tmp_path_factory,
                                                   device, graphs_obtained):
    """With compiled forwards (CUDA graphs on a GPU), the batch's verifies run through
    graphs compiled at load per
    (batch bucket, row bucket) on its slots: every cycle compiled, including the padded
    batch rows of 3 requests in bucket 4 and a lone request, the MTP head's and the DFlash
    drafter's batched drafts too, nothing compiled after load, and each request's tokens
    those it decodes alone on an eager engine (FP8 KV: each slot calibrated on its own
    prompt)."""
    from torch._dynamo.utils import counters

    from flash_planner.engine.config import cache_home

    # one GDN and one attention layer: every kind of layer, in smaller graphs to compile
    target = checkpoints("hybrid", mtp=True, init=0.25, layers=2)
    drafter = write_tiny_drafter(tmp_path_factory.mktemp("compiled"), target, block_size=2)
    common = dict(drafter_path=str(drafter), kv_dtype="fp8", method="auto", max_block=2,
                  mtp_steps=1, prefill_chunk=16, max_batch=4, device=device,
                  compile_cache=str(cache_home() / "test_torch_compile"))
    eager = make_engine(target, compile="off", **common)
    compiled = make_engine(target, compile="on", **common)
    static = compiled.model.batch_static
    assert static is not None and static.batches == (1, 2, 4) and static.buckets == (1, 2)
    assert "batches [1, 2, 4]" in str(compiled.compile_report)
    plain = _alone(eager, _requests(eager, ["none"])[:6])
    methods = ["none", "dflash", "mtp", "auto", "replay"]

    def requests():
        return _requests(eager, methods, [p.token_ids for p in plain], replay_block=2)[:6]

    alone = _alone(eager, requests())
    head = compiled.proposers["mtp"].head.batch_static
    drafts = compiled.proposers["dflash"].drafter.batch_static
    assert head.batches == (1, 2, 4) and drafts.keys == (2, 4)
    obtained = graphs_obtained()
    graphs, calls = counters["stats"]["unique_graphs"], static.calls
    head_calls, draft_calls = head.calls, drafts.calls
    batch = Batch(compiled)
    assert batch.slots is compiled.batch_slots(4) and batch.slots.static is static
    # the attention of a batch's graphs reads the rows up to its longest block, not the
    # capacity: rows past what any of these requests reaches are NaN and never read
    reach = max(len(r.prompt) + r.settings.max_new_tokens for r in requests()) + 2
    assert reach < static.state.capacity // 2
    for state in (static.state, head.state):
        poison(state.kv, static.state.capacity // 2)
    got = _join_midway(batch, requests(), 3, 2)
    assert [g.token_ids for g in got] == [a.token_ids for a in alone]
    assert static.calls - calls == batch.stats.cycles > 0
    # the MTP forks' drafts and the DFlash groups' ran compiled too
    assert head.calls > head_calls and drafts.calls > draft_calls
    # forwards costing their rows: a cycle beside a 1-row block verifies 1 row a request,
    # the longer blocks cut (StaticGraphs.best_rows), and the tokens stay the same
    measured = dict(static.seconds)
    static.seconds.update({key: float(key[0] * key[1]) for key in measured})
    try:
        batch = Batch(compiled)
        got = batch.run(requests())
    finally:
        static.seconds.update(measured)
    assert [g.token_ids for g in got] == [a.token_ids for a in alone]
    assert batch.stats.shortened > 0 and batch.stats.verify_rows == batch.stats.block_rows
    assert counters["stats"]["unique_graphs"] == graphs and obtained == []


def test_a_batch_on_onnxruntime_segments_equals_each_request_alone(engines, tmp_path):
    """A dense backend exported for one sequence (a batch of 1, dynamic tokens) runs a
    batch's verify: the real rows of every request packed as one sequence."""
    from flash_planner.engine.models.qwen.target import TorchDense
    from flash_planner.engine.trt.backends import make_dense

    engine = engines("hybrid", "fp32")
    plain = _alone(engine, _requests(engine, ["none"]))
    requests = _requests(engine, ["none", "replay"], [p.token_ids for p in plain])[:4]
    engine.model.set_dense(make_dense(engine.model, "onnxruntime", tmp_path, max_tokens=64))
    assert engine.model.dense.name == "onnxruntime"
    try:
        alone = _alone(engine, requests)
        batch = Batch(engine, max_batch=4)
        got = batch.run(requests)
    finally:
        engine.model.set_dense(TorchDense(engine.model.segments))
    assert [g.token_ids for g in got] == [a.token_ids for a in alone]
    assert [a.token_ids for a in alone] == [p.token_ids for p in plain[:4]]
    # the replay requests' blocks were padded beside the plain ones' single rows
    assert batch.stats.verify_rows > batch.stats.block_rows


def test_requests_failing_in_the_same_cycle_end_alone(engines):
    """Two requests whose verify gives non-finite logits in one cycle (their slots' GDN
    state corrupted mid-decode): each ends with that error and the others decode on; the
    failed slots hold uncommitted rows, emptied before any slot moves."""
    from flash_planner.engine.loop.speculative import NonFiniteLogits

    engine = engines("hybrid", "fp32")
    requests = _requests(engine, ["none", "none", "none", "none"])[:4]
    alone = _alone(engine, requests)
    batch = Batch(engine, max_batch=4)
    futures = [batch.submit(r) for r in requests]
    while len(batch._active) < 4:
        batch.step()
    for r in batch._active:
        if r.request is requests[1] or r.request is requests[3]:
            r.decoding.state.gdn.state.fill_(float("nan"))
    while not all(f.done() for f in futures):
        batch.step()
    for i in (1, 3):
        with pytest.raises(NonFiniteLogits):
            futures[i].result()
    for i in (0, 2):
        assert futures[i].result().token_ids == alone[i].token_ids
    assert batch.running == 0 and batch.waiting == 0
