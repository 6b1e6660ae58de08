"""Qwen3.8-Flash-Next (`qwen4_exp`) as a target, against transformers' own model on tiny
random checkpoints written by its `save_pretrained`: hyper-connections, PLE on one layer with
small prime tables, an indexer whose budget the prompts exceed (sparse selection), MoE, both
output-gate activations; speculative decoding rolled back across the PLE conv window and
indexer blocks; the n-gram table read row by row, never loaded."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from packaging.version import Version

from flash_planner.engine.config import ConfigError, ModelConfig, cache_home
from flash_planner.engine.generate import GenerationSettings, generate
from flash_planner.engine.loop.proposer import ReplayProposer
from flash_planner.engine.state.cache import InferenceState
from flash_planner.train.tiny import write_tiny_checkpoint

pytestmark = pytest.mark.skipif(
    Version(transformers.__version__) < Version("5.24"),
    reason=f"qwen4_exp needs transformers 5.24 (installed: {transformers.__version__})")

NEW = 16
LENGTHS = (3, 5, 9, 10, 12, 13, 17, 22, 29, 33, 38, 47)    # across 4-key blocks, 9-row windows


def _transformers(path):
    return transformers.Qwen4ExpForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def flash_dirs(tmp_path_factory):
    """output gate activation -> (checkpoint, transformers' model of it)."""
    made = {}
    for gate in ("sigmoid", "silu"):
        path = write_tiny_checkpoint(tmp_path_factory.mktemp(f"flash_{gate}"), kind="flash_next",
                                     init=0.25, flash={"output_gate_type": gate})
        made[gate] = path, _transformers(path)
    return made


@pytest.fixture(scope="module")
def flash_mtp_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("flash_mtp"), kind="flash_next",
                                 init=0.25, mtp=True)


def _prompts(vocab: int, eos: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    prompts = []
    for i, n in enumerate(LENGTHS):
        ids = torch.randint(4, vocab, (n,), generator=gen).tolist()
        if i % 3 == 1:                    # an EOS inside: the n-gram history restarts there
            ids[n // 2] = eos
        prompts.append(ids)
    return prompts


def _commits_of(state, monkeypatch) -> list[tuple[int, int, int]]:
    """Each commit on `state` from now on: (length before, rows kept, rows run)."""
    commits: list[tuple[int, int, int]] = []
    commit = InferenceState.commit

    def spy(self, n):
        if self is state:
            commits.append((self.length, n, self.pending))
        return commit(self, n)

    monkeypatch.setattr(InferenceState, "commit", spy)
    return commits


def _eos(path) -> int:
    raw = json.loads((path / "config.json").read_text())
    eos = raw.get("eos_token_id") or raw["text_config"]["eos_token_id"]
    return eos[0] if isinstance(eos, list) else eos


@pytest.mark.parametrize("gate", ["sigmoid", "silu"])
def test_greedy_tokens_and_logits_equal_transformers(flash_dirs, make_engine, gate):
    path, theirs = flash_dirs[gate]
    engine = make_engine(path)
    chunked = make_engine(path, prefill_chunk=5)
    assert type(engine.model).__name__ == "FlashNextModel"
    for ids in _prompts(engine.model_config.vocab_size, _eos(path)):
        with torch.no_grad():
            # both stop at an EOS (transformers' min_new_tokens would mask it instead)
            want = theirs.generate(torch.tensor([ids]), max_new_tokens=NEW,
                                   do_sample=False)[0, len(ids):].tolist()
            their_logits = theirs(torch.tensor([ids])).logits[0].float()
        state = InferenceState(engine.model_config, 64, 16, torch.float32, torch.float32,
                               torch.device("cpu"))
        ours = engine.model(torch.tensor([ids]), state, all_logits=True).logits[0]
        torch.testing.assert_close(ours, their_logits, rtol=1e-4, atol=1e-4)
        settings = GenerationSettings(NEW, speculative=False)
        assert generate(engine, ids, settings).token_ids == want, len(ids)
        assert generate(chunked, ids, settings).token_ids == want, len(ids)


def test_the_indexer_selects_sparsely_once_the_budget_is_exceeded(flash_dirs, make_engine,
                                                                  tmp_path):
    """The same weights with a budget no prompt exceeds give other logits on a long prompt
    (the selection matters) and the same ones on a short prompt (dense is exact); transformers
    agrees with both."""
    path, _ = flash_dirs["sigmoid"]
    dense = tmp_path / "dense"
    dense.mkdir()
    for item in path.iterdir():
        (dense / item.name).write_bytes(item.read_bytes())
    config = json.loads((dense / "config.json").read_text())
    config["indexer_budget"] = 400
    (dense / "config.json").write_text(json.dumps(config))
    sparse_engine, dense_engine = make_engine(path), make_engine(dense)
    theirs = _transformers(dense)
    ids = _prompts(sparse_engine.model_config.vocab_size, _eos(path))[-1]
    short = ids[:7]

    def logits(engine, prompt):
        state = InferenceState(engine.model_config, 64, 16, torch.float32, torch.float32,
                               torch.device("cpu"))
        return engine.model(torch.tensor([prompt]), state, all_logits=True).logits[0]

    assert not torch.allclose(logits(sparse_engine, ids), logits(dense_engine, ids), atol=1e-3)
    torch.testing.assert_close(logits(sparse_engine, short), logits(dense_engine, short))
    with torch.no_grad():
        torch.testing.assert_close(logits(dense_engine, ids),
                                   theirs(torch.tensor([ids])).logits[0].float(),
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block", [4, 8])
def test_speculative_decoding_is_lossless_across_ple_windows_and_indexer_blocks(
        flash_dirs, make_engine, monkeypatch, block):
    """A replay proposer with one wrong draft per cycle at every offset in turn: every
    rollback restores the PLE conv window and n-gram history, and rows of the indexer's
    blocks are dropped and written again; the tokens equal plain greedy decoding."""
    path, _ = flash_dirs["sigmoid"]
    engine = make_engine(path)
    commits = _commits_of(engine.state, monkeypatch)
    n_new = 40
    for ids in _prompts(engine.model_config.vocab_size, _eos(path))[::3]:
        plain = generate(engine, ids, GenerationSettings(n_new, ignore_eos=True,
                                                         speculative=False)).token_ids
        replay = ReplayProposer(plain, engine.model_config.vocab_size, block_size=block,
                                error_at=range(block), seed=block)
        got = generate(engine, ids, GenerationSettings(n_new, ignore_eos=True),
                       proposer=replay).token_ids
        assert got == plain
    rolled = [(at, n, rows) for at, n, rows in commits if n < rows]
    assert rolled, "no rollback happened"
    # the dropped rows [at + n, at + rows) held a block boundary of the indexer (4 keys)
    assert any((at + rows - 1) // 4 > (at + n - 1) // 4 for at, n, rows in rolled)


def test_the_ngram_table_is_read_by_rows_not_loaded(tmp_path, make_engine):
    """A table of 64 MB beside 2 MB of other weights: loading the engine and decoding raise
    the resident memory by less than a tenth of the table."""
    import gc

    def rss() -> int:
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    big = write_tiny_checkpoint(tmp_path / "big", kind="flash_next",
                                flash={"ngram_vocab_size_base": 1_000_000})
    table = sum(t.numel() * t.element_size() for t in _ngram_tensors(big))
    assert table > 50 << 20
    gc.collect()
    before = rss()
    engine = make_engine(big)
    generate(engine, list(range(5, 40)), GenerationSettings(8, ignore_eos=True))
    gc.collect()
    grown = rss() - before
    assert grown < table // 10, (grown, table)
    assert engine.model.ple_layers[0].table.nbytes == table


def _tensor_names(path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return list(f.keys())


def _ngram_tensors(path):
    from safetensors.torch import load_file

    return [t for name, t in load_file(path / "model.safetensors").items()
            if "ngram_embedding.shard_" in name]


def _fp8_table(src, dst, kind: str) -> None:
    """A copy of checkpoint `src` in `dst` whose n-gram shards are e4m3 with a scale beside
    them (kind: `tensor`, `row` or `block`), or, for kind `twin-<kind>`, in fp32 holding
    exactly what those e4m3 values times their scales are."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    twin = kind.startswith("twin-")
    kind = kind.removeprefix("twin-")
    for name, w in list(tensors.items()):
        if ".ngram_embedding.shard_" not in name or not name.endswith(".weight"):
            continue
        rows, dim = w.shape
        if kind == "tensor":        # compressed-tensors' layout: [1] in the model's dtype
            scale = (w.abs().max() / 448).reshape(1).to(torch.bfloat16)
            full = scale.float().expand(rows, dim)
        elif kind == "row":
            scale = (w.abs().amax(1, keepdim=True) / 448).to(torch.bfloat16)
            full = scale.float().expand(rows, dim)
        else:                       # Qwen's FP8: a multiplier per 128 x 128 block
            pad = torch.zeros(-(-rows // 128) * 128, -(-dim // 128) * 128)
            pad[:rows, :dim] = w.abs()
            scale = pad.unflatten(0, (-1, 128)).unflatten(-1, (-1, 128)).amax((1, 3)) / 448
            full = scale.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :dim]
        q = (w.float() / full).to(torch.float8_e4m3fn)
        if twin:
            tensors[name] = q.float() * full
        else:
            tensors[name] = q
            suffix = "weight_scale_inv" if kind == "block" else "weight_scale"
            tensors[name.removesuffix("weight") + suffix] = scale.contiguous()
    save_file(tensors, str(dst / "model.safetensors"))


@pytest.mark.parametrize("kind", ["tensor", "row", "block"])
def test_an_fp8_ngram_table_reads_its_scales(flash_dirs, make_engine, tmp_path, kind):
    """An e4m3 table with a per-tensor, per-row or per-block scale beside each shard: the
    rows it gathers are exactly its fp32 twin's, and so are greedy tokens; without the
    scales the rows differ. The block case's shards span several 128-row blocks."""
    path, _ = flash_dirs["sigmoid"]
    if kind == "block":
        path = write_tiny_checkpoint(tmp_path / "src", kind="flash_next", init=0.25,
                                     flash={"ngram_vocab_size_base": 400})
    _fp8_table(path, tmp_path / "fp8", kind)
    _fp8_table(path, tmp_path / "twin", f"twin-{kind}")
    fp8, twin = make_engine(tmp_path / "fp8"), make_engine(tmp_path / "twin")
    table, twin_table = fp8.model.ple_layers[0].table, twin.model.ple_layers[0].table
    assert kind != "block" or table.per_shard > 3 * 128
    assert table.dtype == torch.float8_e4m3fn and table.nbytes * 4 == twin_table.nbytes
    rows = torch.arange(0, table.rows, table.rows // 60)[:60].reshape(-1, 2)
    assert torch.equal(table.gather(rows), twin_table.gather(rows))
    table.scales = [None] * len(table.scales)
    assert not torch.equal(table.gather(rows).float(), twin_table.gather(rows))
    fp8 = make_engine(tmp_path / "fp8")
    for ids in _prompts(fp8.model_config.vocab_size, _eos(path))[::3]:
        settings = GenerationSettings(12, ignore_eos=True)
        assert generate(fp8, ids, settings).token_ids == generate(twin, ids, settings).token_ids


def test_an_ngram_scale_of_another_shape_is_refused_naming_it(flash_dirs, make_engine,
                                                              tmp_path):
    from safetensors.torch import load_file, save_file

    from flash_planner.engine.checkpoint import CheckpointError

    path, _ = flash_dirs["sigmoid"]
    _fp8_table(path, tmp_path / "fp8", "row")
    file = tmp_path / "fp8" / "model.safetensors"
    tensors = load_file(file)
    name = next(n for n in tensors if n.endswith("shard_0.weight_scale"))
    tensors[name] = torch.ones(3, 2)
    save_file(tensors, str(file))
    with pytest.raises(CheckpointError, match=rf"{name} has shape \[3, 2\]"):
        make_engine(tmp_path / "fp8")


def test_plan_runs_a_tiny_flash_next_under_the_grammar(flash_dirs, capsys):
    from flash_planner.cli import main

    path, _ = flash_dirs["sigmoid"]
    main(["plan", "go to the kitchen", "--model", str(path), "--device", "cpu", "--dtype",
          "fp32", "--max-new-tokens", "24", "--no-thinking", "--json"])
    result = json.loads(capsys.readouterr().out)
    telemetry = result["telemetry"]
    assert telemetry["new_tokens"] > 0 and telemetry["constrained"] is True, result
    assert "internal error" not in result.get("error", "")


@pytest.mark.parametrize("edit, match", [
    ({"ple_layer_ids": [2]}, "ple_layer_ids \\[2\\] are not linear-attention layers"),
    ({"indexer_budget": None}, "the QSA indexer needs \\['indexer_budget'\\] too"),
    ({"indexer_budget": 6}, "indexer_budget 6 is not a multiple of indexer_compress_ratio 4"),
    ({"output_gate_type": "tanh"}, "output_gate_type 'tanh' is not one of"),
    ({"hc_count": 1}, "field 'hc_count' must be an integer >= 2"),
])
def test_a_config_it_cannot_run_names_the_field(flash_dirs, edit, match):
    path, _ = flash_dirs["sigmoid"]
    raw = json.loads((path / "config.json").read_text())
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf_dict({**raw, **edit})


def test_settings_a_flash_next_target_cannot_run_are_refused(flash_dirs, make_engine):
    path, _ = flash_dirs["sigmoid"]
    with pytest.raises(ValueError, match="Flash-Next .* dense_backend cannot be set"):
        make_engine(path, dense_backend="onnxruntime")
    engine = make_engine(path, compile="auto")
    assert engine.config.dense_backend == "torch" and engine.compile_report is None   # a CPU


def test_compiled_forwards_equal_eager(flash_mtp_dir, make_engine, monkeypatch):
    """`compile on`: decode and verify blocks run through the compiled graph (PLE rows read
    before it, the indexer's choice inside it, the PLE window and n-gram history rolled back
    after it), and greedy tokens equal the eager engine's: plain, with a replay proposer
    wrong once a cycle at every offset, and with the MTP module (eager) drafting."""
    path = flash_mtp_dir
    common = dict(max_block=4, mtp_steps=3, compile_cache=str(cache_home() / "test_torch_compile"))
    eager, compiled = (make_engine(path, compile=c, **common) for c in ("off", "on"))
    static = compiled.model.static
    assert type(static).__name__ == "StaticFlashNext"
    assert compiled.compile_report.parts == ("target",)      # the MTP module runs eager
    commits = _commits_of(compiled.state, monkeypatch)
    vocab, n_new = eager.model_config.vocab_size, 30
    for ids in _prompts(vocab, _eos(path))[::4]:
        plain = generate(eager, ids, GenerationSettings(n_new, ignore_eos=True,
                                                        speculative=False)).token_ids
        calls = static.calls
        assert generate(compiled, ids, GenerationSettings(
            n_new, ignore_eos=True, speculative=False)).token_ids == plain
        assert static.calls - calls == n_new - 1          # every decode step compiled
        replay = ReplayProposer(plain, vocab, block_size=4, error_at=range(4), seed=4)
        assert generate(compiled, ids, GenerationSettings(n_new, ignore_eos=True),
                        proposer=replay).token_ids == plain
        out = generate(compiled, ids, GenerationSettings(n_new, ignore_eos=True, method="mtp"))
        assert out.token_ids == plain and out.stats.method_cycles.get("mtp", 0) > 0
    rolled = [(at, n, rows) for at, n, rows in commits if n < rows]
    assert any((at + rows - 1) // 4 > (at + n - 1) // 4 for at, n, rows in rolled)
    # compiled steps ran past the indexer's budget (2 blocks of 4): its choice was sparse
    assert max(at + rows for at, _, rows in commits) > 3 * 4


@pytest.mark.parametrize("kv", ["fp32", "fp8"])
def test_batched_requests_equal_each_request_alone(flash_mtp_dir, make_engine, tmp_path, kv):
    """Requests decoding together (one verify per cycle for all, padded to the longest
    block; joining midway, leaving when done) give each request's tokens alone: each slot's
    PLE window, n-gram history and indexer keys are its own and roll back to its own count
    (plain, DFlash, MTP, auto and replay proposers side by side)."""
    from flash_planner.engine.batch import Batch, BatchRequest
    from flash_planner.train.tiny import write_tiny_drafter

    drafter = write_tiny_drafter(tmp_path / "drafter", flash_mtp_dir, block_size=6)
    engine = make_engine(flash_mtp_dir, drafter_path=str(drafter), kv_dtype=kv,
                         method="auto", prefill_chunk=16)
    prompts = _prompts(engine.model_config.vocab_size, _eos(flash_mtp_dir))[4:]
    new = (24, 9, 31, 16, 40, 12, 20, 28)
    plain = [generate(engine, ids, GenerationSettings(n, ignore_eos=True, speculative=False))
             .token_ids for ids, n in zip(prompts, new)]
    methods = ["none", "dflash", "mtp", "auto", "replay"]
    requests = []
    for i, (ids, n) in enumerate(zip(prompts, new)):
        method = methods[i % len(methods)]
        replay = (ReplayProposer(plain[i], engine.model_config.vocab_size, block_size=5,
                                 seed=i) if method == "replay" else None)
        requests.append(BatchRequest(ids, GenerationSettings(
            n, ignore_eos=True, method=None if method == "replay" else method),
            proposer=replay))
    batch = Batch(engine, max_batch=4)
    futures = [batch.submit(r) for r in requests[:4]]
    for _ in range(3):
        batch.step()
    futures += [batch.submit(r) for r in requests[4:]]
    while not all(f.done() for f in futures):
        batch.step()
    got = [f.result().token_ids for f in futures]
    assert got == plain
    assert batch.stats.cycles < sum(len(p) for p in plain)        # rows were batched


@pytest.mark.parametrize("settings", [
    dict(method="dflash"), dict(method="auto"), dict(method="dflash", kv_dtype="fp8"),
    dict(method="dflash", weights="fp8"), dict(method="dflash", weights="nvfp4")])
def test_a_dflash_drafter_on_the_streams_is_lossless(flash_dirs, make_engine, tmp_path,
                                                     settings):
    """A DFlash drafter taps the mean of a layer's streams (the last layer: the mix lm_head
    reads); whatever it drafts, the tokens equal plain greedy decoding of the same engine (FP8
    KV, and FP8 or NVFP4 weights quantized at load, experts included)."""
    from flash_planner.train.tiny import write_tiny_drafter

    path, _ = flash_dirs["sigmoid"]
    drafter = write_tiny_drafter(tmp_path / "drafter", path, block_size=8)
    engine = make_engine(path, drafter_path=str(drafter), **settings)
    assert set(engine.proposers) >= {"dflash"}
    formats = [f for f in ("fp8", "nvfp4") if f in engine.weights_label]
    assert formats == [settings[k] for k in ("weights",) if k in settings]
    for ids in _prompts(engine.model_config.vocab_size, _eos(path))[1::4]:
        plain = generate(engine, ids, GenerationSettings(24, ignore_eos=True,
                                                         speculative=False)).token_ids
        out = generate(engine, ids, GenerationSettings(24, ignore_eos=True))
        assert out.token_ids == plain
        # auto may route a random drafter's cycles to plain decoding
        assert out.stats.cycles > 0 and (out.stats.drafted > 0 or settings["method"] == "auto")


def test_the_published_layout_with_its_vision_tower_decodes_the_text_as_transformers(
        tmp_path, make_engine):
    """Qwen4ExpForConditionalGeneration, as Qwen publishes the model: the language model under
    model.language_model., the tower's weights skipped; an image is refused naming why."""
    path = write_tiny_checkpoint(tmp_path / "vl", kind="flash_next_vl", init=0.25)
    theirs = transformers.Qwen4ExpForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32).eval()
    engine = make_engine(path)
    assert engine.model_config.weight_prefix == "model.language_model."
    for ids in _prompts(engine.model_config.vocab_size, _eos(path))[::4]:
        with torch.no_grad():
            want = theirs.generate(torch.tensor([ids]), max_new_tokens=NEW,
                                   do_sample=False)[0, len(ids):].tolist()
        assert generate(engine, ids, GenerationSettings(NEW)).token_ids == want
    with pytest.raises(ValueError, match="Flash-Next target, whose images"):
        engine.require_vision()


def test_bytes_per_token_of_each_build(monkeypatch):
    """bench/weight_bytes.py's Flash-Next table: the model on the meta device at the published
    shapes (125.7B parameters besides the n-gram table); quantizing reads fewer bytes."""
    from weight_bytes import flash_next_rows

    rows = {r["build"]: r for r in flash_next_rows(1.0)}
    gb = {build: r["gb"] for build, r in rows.items()}
    assert gb["nvfp4"] < gb["fp8"] < gb["nvfp4 experts, bf16 else"] < gb["bf16"]
    assert rows["bf16"]["table_gb"] == 2 * rows["fp8"]["table_gb"]
    assert abs(rows["bf16"]["params_b"] - 125.7) < 0.1


def test_bf16_differs_from_transformers_only_after_a_routing_tie(flash_dirs):
    """In bf16 the two implementations round differently; the check (as the MoE parity test
    makes it) is that, per prompt, every router sees what transformers' sees to bf16 noise
    until the first layer where a row takes other experts, and that row shows a near-tie of
    its k-th and (k+1)-th router logits; a prompt with no such flip has logits within
    bf16 tolerance."""
    import torch.nn.functional as F

    from flash_planner.engine.checkpoint import load_checkpoint

    path, _ = flash_dirs["sigmoid"]
    ckpt = load_checkpoint(path, dtype=torch.bfloat16)
    ref = transformers.Qwen4ExpForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ours, theirs = {}, {}
    for i, (mine, their) in enumerate(zip(ckpt.model.layers, ref.model.layers)):
        mine.mlp.gate.register_forward_hook(
            lambda m, a, o, i=i: ours.__setitem__(i, F.linear(a[0], m.weight).float()))
        their.mlp.gate.register_forward_hook(
            lambda m, a, o, i=i: theirs.__setitem__(i, o[0].float()))
    # bf16 tolerance: the plain hybrid's 0.15 plus the rounding of the 4-stream residual's mixes
    k, tol, flipped = ckpt.config.moe.top_k, 0.25, 0
    for ids in _prompts(ckpt.config.vocab_size, _eos(path)):
        state = InferenceState(ckpt.config, 64, 16, torch.bfloat16, torch.bfloat16,
                               torch.device("cpu"))
        logits = ckpt.model(torch.tensor([ids]), state, all_logits=True).logits[0]
        with torch.no_grad():
            want = ref(torch.tensor([ids])).logits[0].float()
        for i in sorted(ours):
            mine, theirs_i = ours[i].reshape(theirs[i].shape), theirs[i]
            moved = (mine - theirs_i).abs().amax(-1)
            assert moved.max().item() <= tol, (len(ids), i, moved.max().item())
            rows = (mine.topk(k).indices.sort().values
                    != theirs_i.topk(k).indices.sort().values).any(-1).nonzero().flatten()
            for row in rows.tolist():
                ranked = theirs_i[row].sort(descending=True).values
                assert (ranked[k - 1] - ranked[k]).item() <= 2 * moved[row].item()
            if len(rows):
                flipped += 1
                break
        else:
            assert (logits - want).abs().max().item() <= tol, len(ids)
    assert flipped < len(LENGTHS)          # most prompts agree outright


@pytest.mark.parametrize("settings", [dict(method="mtp"), dict(method="mtp", kv_dtype="fp8",
                                                                 mtp_steps=5),
                                      dict(method="auto", prefill_chunk=7)])
def test_its_mtp_module_drafts_losslessly(flash_mtp_dir, make_engine, monkeypatch, settings):
    """The MTP module (a random one in the layout flash_next_mtp.py reads) continues the
    target's 4-stream state; its drafts are rolled back across the target's and its own
    indexer blocks, and the tokens equal plain greedy decoding."""
    path = flash_mtp_dir
    engine = make_engine(path, **settings)
    assert type(engine.proposers["mtp"].head).__name__ == "FlashNextHead"
    commits = _commits_of(engine.state, monkeypatch)
    for ids in _prompts(engine.model_config.vocab_size, _eos(path))[::3]:
        plain = generate(engine, ids, GenerationSettings(30, ignore_eos=True,
                                                         speculative=False)).token_ids
        out = generate(engine, ids, GenerationSettings(30, ignore_eos=True))
        assert out.token_ids == plain
        assert out.stats.method_cycles.get("mtp", 0) > 0 or settings["method"] == "auto"
    assert any((at + rows - 1) // 4 > (at + n - 1) // 4 for at, n, rows in commits if n < rows)


def test_a_prefix_snapshot_serves_its_mtp_module_too(flash_mtp_dir, make_engine):
    """The planner's system prompt kept as a prefix snapshot: the MTP module's own cache of
    it is kept from the target's streams, and a request on the snapshot decodes the same
    tokens as one prefilled whole."""
    engine = make_engine(flash_mtp_dir, method="mtp")
    prompts = _prompts(engine.model_config.vocab_size, _eos(flash_mtp_dir))
    prefix = prompts[-1][:30]
    settings = GenerationSettings(20, ignore_eos=True)
    for tail in (prompts[2], prompts[5]):
        ids = prefix + tail
        whole = generate(engine, ids, settings)
        first = generate(engine, ids, settings, prefix=prefix)
        again = generate(engine, ids, settings, prefix=prefix)
        assert again.stats.prefix_hit is True
        assert whole.token_ids == first.token_ids == again.token_ids
        assert again.stats.method_cycles.get("mtp", 0) > 0


def test_a_snapshot_counts_its_flash_state(flash_mtp_dir, make_engine):
    """A prefix snapshot's bytes (the prefix cache's budget) include the PLE windows, the
    n-gram history and the indexer keys it keeps."""
    engine = make_engine(flash_mtp_dir)
    prompt = _prompts(engine.model_config.vocab_size, _eos(flash_mtp_dir))[-1]
    engine.state.reset()
    engine.model(torch.tensor([prompt]), engine.state)
    engine.state.commit(len(prompt))
    copy = engine.state.save()
    windows, history, keys = copy.flash
    flash = (sum(w.nbytes for w in windows.values()) + history.nbytes
             + sum(k.nbytes for k in keys.values()))
    assert flash > 0 and all(k.shape[1] == len(prompt) for k in keys.values())
    plain = sum(t.nbytes for t in (copy.k, copy.v, copy.k_scale, copy.v_scale,
                                   copy.gdn_state, copy.gdn_conv))
    assert copy.nbytes == plain + flash


@pytest.mark.parametrize("fmt", ["ct-mixed", "modelopt-nvfp4", "ct-nvfp4"])
def test_a_quantized_checkpoint_decodes_as_its_dequantized_twin(tmp_path, make_engine, fmt):
    """Checkpoints written in the published recipes' layouts (compressed-tensors' mixed
    precision by its own compressor: FP8 attention, NVFP4 MLP; ModelOpt NVFP4; every Linear
    in NVFP4 by compressed-tensors, the shared expert's [1, H] gate included): what a
    recipe leaves plain without naming it (the hyper-connection mixers; the fused experts
    compressed-tensors does not see as Linears) loads plain, a gate the engine keeps plain
    but the recipe quantized is dequantized at load, the rest loads in its format; greedy
    tokens equal the dequantized twin's."""
    from quantized_checkpoints import write_quantized

    source = write_tiny_checkpoint(tmp_path / "src", kind="flash_next", init=0.25)
    quant, ref = write_quantized(source, tmp_path / fmt, fmt, kind="flash_next")
    quantized, twin = make_engine(quant), make_engine(ref)
    assert "nvfp4" in quantized.weights_label
    gates = [n for n in _tensor_names(quant) if ".shared_expert_gate." in n]
    assert any(n.endswith(".weight_packed") for n in gates) == (fmt == "ct-nvfp4")
    for ids in _prompts(quantized.model_config.vocab_size, _eos(source))[::4]:
        settings = GenerationSettings(16, ignore_eos=True)
        assert generate(quantized, ids, settings).token_ids == \
            generate(twin, ids, settings).token_ids
