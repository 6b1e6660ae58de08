"""Bad model directories fail with one clear error naming what is wrong, before any load."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from checkpoint_names import WRAPPED
from safetensors.torch import load_file, save_file

from flash_planner.engine.checkpoint import CheckpointError, load_checkpoint
from flash_planner.engine.engine import EngineConfig
from flash_planner.engine.generate import GenerationSettings, generate
from flash_planner.engine.state.cache import ContextOverflowError


@pytest.fixture
def broken(tmp_path, hybrid_dir):
    """A fresh copy of the tiny hybrid checkpoint to damage."""
    dst = tmp_path / "model"
    shutil.copytree(hybrid_dir, dst)
    return dst


def _edit_weights(path, edit):
    """`edit` the checkpoint's tensors by their `model.` names, whichever prefix the file
    uses (transformers 5.2 saves the tiny text model under model.language_model.)."""
    tensors = load_file(str(path / "model.safetensors"))
    wrapped = any(n.startswith(WRAPPED) for n in tensors)
    named = {("model." + n.removeprefix(WRAPPED)) if n.startswith(WRAPPED) else n: t
             for n, t in tensors.items()}
    edit(named)
    if wrapped:
        named = {(WRAPPED + n.removeprefix("model.")) if n.startswith("model.") else n: t
                 for n, t in named.items()}
    save_file(named, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")


def test_missing_config(broken):
    (broken / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_checkpoint(broken)


def test_config_not_json(broken):
    (broken / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not readable JSON"):
        load_checkpoint(broken)


def test_unsupported_model_type(broken):
    cfg = json.loads((broken / "config.json").read_text())
    cfg["model_type"] = "llama"
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="model_type 'llama' is not supported"):
        load_checkpoint(broken)


def test_missing_required_field(broken):
    cfg = json.loads((broken / "config.json").read_text())
    del cfg["hidden_size"]
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="'hidden_size' is missing"):
        load_checkpoint(broken)


def test_no_weights(broken):
    (broken / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no weights"):
        load_checkpoint(broken)


def test_missing_tensor(broken):
    _edit_weights(broken, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError, match="missing tensor.*layers.1.self_attn.k_proj"):
        load_checkpoint(broken)


def test_a_text_model_stored_under_the_wrappers_prefix_loads(broken, hybrid_dir, make_engine):
    """transformers 5.2's save_pretrained writes a text-only Qwen3_5ForCausalLM under
    `model.language_model.` (5.24 under `model.`): the same weights decode the same tokens
    either way; with the embeddings under neither, the error names the tensors the config
    implies."""
    file = broken / "model.safetensors"
    tensors = load_file(str(file))
    save_file({(WRAPPED + n.removeprefix("model.")) if not n.startswith(("lm_head.", WRAPPED))
               else n: t for n, t in tensors.items()}, str(file), metadata={"format": "pt"})
    assert json.loads((broken / "config.json").read_text())["architectures"] == [
        "Qwen3_5ForCausalLM"]
    settings = GenerationSettings(12, ignore_eos=True)
    ids = list(range(5, 30))
    assert generate(make_engine(broken), ids, settings).token_ids == \
        generate(make_engine(hybrid_dir), ids, settings).token_ids
    _edit_weights(broken, lambda t: t.pop("model.embed_tokens.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) model.embed_tokens.weight"):
        load_checkpoint(broken)


def test_misshaped_tensor(broken):
    def edit(t):
        t["model.norm.weight"] = torch.zeros(7)
    _edit_weights(broken, edit)
    with pytest.raises(CheckpointError, match=r"model.norm.weight has shape \[7\], expected"):
        load_checkpoint(broken)


def test_unloadable_dtype(broken):
    def edit(t):
        t["model.embed_tokens.weight"] = t["model.embed_tokens.weight"].to(torch.int8)
    _edit_weights(broken, edit)
    with pytest.raises(CheckpointError, match="embed_tokens.weight has dtype I8"):
        load_checkpoint(broken)


def test_corrupt_safetensors(broken):
    (broken / "model.safetensors").write_bytes(b"\x00" * 64)   # a header of 0 bytes
    with pytest.raises(CheckpointError, match="model.safetensors: corrupt header: not valid "
                       "JSON"):
        load_checkpoint(broken)


def test_truncated_safetensors_and_corrupt_header(broken):
    """Said in plain words from the header (test_load_failures.py has every case)."""
    path = broken / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-1000])
    with pytest.raises(CheckpointError, match=r"model.safetensors: truncated: the header says "
                       r"(\d+) bytes of tensor data, the file has \d+ \(from tensor "):
        load_checkpoint(broken)
    header = data.index(b'"dtype"')
    path.write_bytes(data[:header] + b'"dtypo"' + data[header + 7:])
    with pytest.raises(CheckpointError, match="model.safetensors: corrupt header: tensor .* has "
                       "no valid dtype, shape and data_offsets"):
        load_checkpoint(broken)


def test_missing_tokenizer_is_refused_by_the_planner(broken):
    from flash_planner.planning.service import PlannerService

    for path in broken.glob("tokenizer*"):
        path.unlink()
    with pytest.raises(ValueError, match="has no tokenizer .*the planner needs one"):
        PlannerService.load(EngineConfig(str(broken), device="cpu"), None, None)


def test_sharded_checkpoint_loads_and_missing_shard_is_named(checkpoints, tmp_path):
    sharded = checkpoints("hybrid", max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    single = load_checkpoint(checkpoints("hybrid"), with_tokenizer=False)
    loaded = load_checkpoint(sharded, with_tokenizer=False)
    for (name, a), (_, b) in zip(single.model.state_dict().items(),
                                 loaded.model.state_dict().items()):
        assert torch.equal(a, b), name
    dst = tmp_path / "sharded"
    shutil.copytree(sharded, dst)
    shard = sorted(dst.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"lists shard {shard.name}, which is missing"):
        load_checkpoint(dst)


def test_request_over_max_context_is_rejected_before_prefill(hybrid_dir, make_engine):
    engine = make_engine(hybrid_dir, max_context=40)
    with pytest.raises(ContextOverflowError, match="exceeds max_context 40"):
        generate(engine, list(range(3, 33)), GenerationSettings(max_new_tokens=11))
    assert engine.state.length == 0  # nothing ran
    ok = generate(engine, list(range(3, 33)), GenerationSettings(max_new_tokens=10,
                                                                 ignore_eos=True))
    assert len(ok.token_ids) == 10


def test_memory_report_counts_what_is_preallocated(hybrid_dir, make_engine):
    small = make_engine(hybrid_dir, max_context=128).memory
    large = make_engine(hybrid_dir, max_context=1024).memory
    assert small.weights == large.weights > 0
    assert large.kv_cache > small.kv_cache > 0
    assert small.gdn_state > 0 and small.checkpoints > 0
    assert small.total == small.weights + small.kv_cache + small.gdn_state + small.checkpoints
