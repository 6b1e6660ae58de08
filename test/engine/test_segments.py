"""Dense segments: the eager plan, their ONNX export run by onnxruntime, and the fallbacks."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from flash_planner.cli import main
from flash_planner.engine.checkpoint import load_checkpoint
from flash_planner.engine.generate import GenerationSettings, generate
from flash_planner.engine.loop.proposer import ReplayProposer
from flash_planner.engine.models.qwen.target import TorchDense
from flash_planner.engine.trt.backends import make_dense
from flash_planner.engine.trt.export import export_all, segment_digest, segment_specs

# Two layers (the hybrid's: one GDN, one attention) where every segment is exported and run:
# each segment an ONNX export of its own, three instead of five
LAYERS = 2


@pytest.fixture(scope="module")
def segment_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("segments")


@pytest.mark.parametrize("kind", ["hybrid", "dense"])
def test_every_exported_segment_matches_torch_in_onnxruntime(checkpoints, segment_cache,
                                                             kind):
    import onnx
    import onnxruntime as ort

    model = load_checkpoint(checkpoints(kind, layers=LAYERS), with_tokenizer=False).model
    exported = export_all(model, segment_cache / kind, max_tokens=64)
    assert len(exported) == model.cfg.num_layers + 1
    gen = torch.Generator().manual_seed(0)
    for spec, path in exported:
        onnx.checker.check_model(str(path))
        assert (path.parent / "segment.onnx.data").is_file()   # weights as external data
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        for rows in (1, 16, 37):  # the token dimension is dynamic
            args = [torch.randint(0, model.cfg.vocab_size, (1, rows), generator=gen)
                    if t.dtype == torch.long else
                    torch.randn(1, rows, *t.shape[2:], generator=gen).to(t.dtype)
                    for t in spec.example]
            with torch.no_grad():
                ref = model.segments[spec.index](*args)
            outs = session.run(list(spec.outputs),
                               {n: a.numpy() for n, a in zip(spec.inputs, args)})
            for name, got, want in zip(spec.outputs, outs, ref):
                diff = (torch.from_numpy(got) - want).abs().max().item()
                assert diff <= 1e-4, f"segment {spec.index} {name} rows {rows}: {diff}"


@pytest.mark.parametrize("kind", ["hybrid", "dense"])
def test_generation_on_onnxruntime_equals_torch(checkpoints, make_engine, segment_cache, kind):
    engine = make_engine(checkpoints(kind, layers=LAYERS), prefill_chunk=8)
    prompt = engine.tokenizer.encode("open the top drawer, take the blue screwdriver",
                                     add_special_tokens=False)
    settings = GenerationSettings(24, ignore_eos=True, speculative=False)
    ref = generate(engine, prompt, settings).token_ids
    engine.model.set_dense(make_dense(engine.model, "onnxruntime", segment_cache / kind,
                                      max_tokens=16))
    assert engine.model.dense.name == "onnxruntime"
    try:
        assert generate(engine, prompt, settings).token_ids == ref
        replay = ReplayProposer(ref, engine.model_config.vocab_size, block_size=8, seed=1)
        spec = generate(engine, prompt, GenerationSettings(24, ignore_eos=True),
                        proposer=replay)
        assert spec.token_ids == ref and spec.stats.accepted > 0   # lossless on onnxruntime
    finally:
        engine.model.set_dense(TorchDense(engine.model.segments))


def test_cache_hits_and_digest_follows_the_weights(checkpoints, segment_cache):
    model = load_checkpoint(checkpoints("hybrid"), with_tokenizer=False).model
    lines = []
    export_all(model, segment_cache / "hybrid-cache", max_tokens=16)
    export_all(model, segment_cache / "hybrid-cache", max_tokens=16, progress=lines.append)
    assert all(line.endswith("cached") for line in lines) and len(lines) == 5
    spec = segment_specs(model)[2]
    before = segment_digest(model, spec, 16)
    assert segment_digest(model, spec, 32) != before          # other shape range
    with torch.no_grad():
        model.layers[1].mlp.up_proj.weight[0, 0] += 1.0       # a weight of segment 2
    assert segment_digest(model, spec, 16) != before
    assert segment_digest(model, segment_specs(model)[0], 16) == segment_digest(
        load_checkpoint(checkpoints("hybrid"), with_tokenizer=False).model,
        segment_specs(model)[0], 16)                           # untouched segment: same


def test_unavailable_backends_fall_back_to_torch_with_a_reason(checkpoints, caplog):
    model = load_checkpoint(checkpoints("hybrid"), with_tokenizer=False).model
    with caplog.at_level("WARNING"):
        runner = make_dense(model, "tensorrt")
    assert runner.name == "torch"
    assert "dense backend tensorrt unavailable" in caplog.text
    assert make_dense(model, "auto").name == "torch"          # CPU: auto means torch
    with pytest.raises(ValueError, match="dense_backend must be one of"):
        make_dense(model, "tvm")


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is None or
                    not torch.cuda.is_available(),
                    reason="TensorRT and a CUDA GPU are not available")
def test_tensorrt_segments_match_torch(checkpoints, make_engine, tmp_path):
    engine = make_engine(checkpoints("hybrid"), device="cuda", dtype="fp32")
    prompt = list(range(5, 30))
    settings = GenerationSettings(16, ignore_eos=True, speculative=False)
    ref = generate(engine, prompt, settings).token_ids
    engine.model.set_dense(make_dense(engine.model, "tensorrt", tmp_path, max_tokens=256))
    assert engine.model.dense.name == "tensorrt"
    assert generate(engine, prompt, settings).token_ids == ref


def test_cli_build_engines_and_dense_backend_flag(hybrid_dir, tmp_path, capsys):
    assert main(["build-engines", "--model", str(hybrid_dir), "--backend", "onnxruntime",
                 "--segment-cache", str(tmp_path)]) == 0
    assert "5 segments ready for onnxruntime" in capsys.readouterr().out
    assert main(["build-engines", "--model", str(hybrid_dir), "--backend", "onnxruntime",
                 "--segment-cache", str(tmp_path)]) == 0
    assert capsys.readouterr().out.count("cached") == 5
    if importlib.util.find_spec("tensorrt") is None:
        assert main(["build-engines", "--model", str(hybrid_dir), "--device", "cpu",
                     "--segment-cache", str(tmp_path)]) == 1
        assert "tensorrt could not serve" in capsys.readouterr().err
    assert main(["generate", "--model", str(hybrid_dir), "--prompt", "open it",
                 "--max-new-tokens", "5", "--ignore-eos", "--dense-backend", "onnxruntime",
                 "--segment-cache", str(tmp_path), "--json"]) == 0
