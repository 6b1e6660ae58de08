"""Quantize-at-load, the weight-format errors, the ONNX refusal and the bytes per forward."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from checkpoint_names import stored_name
from quantized_checkpoints import write_quantized
from safetensors.torch import load_file, save_file
from weight_bytes import FORMATS, MODELS, analytic_bytes, forward_bytes, meta_model

from flash_planner.engine.checkpoint import CheckpointError, load_checkpoint
from flash_planner.engine.engine import Engine
from flash_planner.engine.generate import GenerationSettings, generate
from flash_planner.engine.inputs.chat import encode_chat
from flash_planner.engine.weights.bytes import bytes_per_forward
from flash_planner.engine.weights.linear import QuantLinear
from flash_planner.engine.weights.scheme import matches
from flash_planner.planning.presets import ModelPreset

# the largest |W - dequantized W| each data-free recipe may leave, relative to the group's
# (fp8: block's) absolute maximum: half an e4m3 step at the top of the range (2^-4); int4:
# half a step of 15 over the group's range, i.e. (max - min) / 30 <= amax / 15; nvfp4: the
# E2M1 grid near 6 is 2 apart (1 / 6) plus the e4m3 rounding of the group scale (2^-4)
BOUND = {"fp8": 2 ** -4, "int4": 1 / 15, "nvfp4": 1 / 6 + 2 ** -4}
GROUP = {"fp8": (128, 128), "int4": (1, 128), "nvfp4": (1, 16)}


def _group_amax(w: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    n, k = w.shape
    pad = torch.zeros(-(-n // rows) * rows, -(-k // cols) * cols)
    pad[:n, :k] = w.abs()
    amax = pad.view(pad.shape[0] // rows, rows, pad.shape[1] // cols, cols).amax((1, 3))
    return amax.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[:n, :k]


@pytest.mark.parametrize("kind", ["hybrid", "hybrid_moe"])
@pytest.mark.parametrize("weights", ["fp8", "nvfp4", "int4"])
def test_quantize_at_load_error_is_within_the_format_step(checkpoints, weights, kind):
    path = checkpoints(kind)
    plain = load_checkpoint(path, with_tokenizer=False)
    quant = load_checkpoint(path, with_tokenizer=False, weights=weights)
    swapped = {n: m for n, m in quant.model.named_modules() if isinstance(m, QuantLinear)}
    assert swapped and {m.family for m in swapped.values()} == {weights}
    assert not any(n.endswith(("in_proj_a", "in_proj_b", "lm_head")) for n in swapped)
    for name, module in swapped.items():      # MLP gate and up fused at load where they stack
        if name.endswith(".gate_proj"):       # (FP8: the tiny MoE's shared expert has I < 128)
            assert not module.stacks_with(swapped[name.removesuffix("gate_proj") + "up_proj"])
    assert any(m.gated for m in swapped.values()) or (weights, kind) == ("fp8", "hybrid_moe")
    for name, module in swapped.items():
        w = plain_weight(plain.model, name, module)
        stacked = [(w[e], _expert(module, e)) for e in range(module.expert_count)] if (
            module.expert_count) else [(w, module)]
        for w, one in stacked:
            err = (one.dequantized() - w).abs()
            assert (err <= BOUND[weights] * _group_amax(w, *GROUP[weights]) + 1e-7).all(), name
    if kind == "hybrid_moe":    # experts quantized; the router and shared gate are not
        assert any(m.expert_count for m in swapped.values())
        assert not any(n.endswith(("mlp.gate", "shared_expert_gate")) for n in swapped)
    assert quant.bytes_per_forward < plain.bytes_per_forward


def plain_weight(model, name: str, module: QuantLinear) -> torch.Tensor:
    """The full-precision weight the quantized module `name` holds. Expert stacks fuse gate
    and up in full precision too, dense MLPs only when quantized, and FP8 ones only where
    no scale block straddles the seam: either side may hold them apart."""
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    twin = getattr(parent, leaf, None)
    if twin is not None:
        return twin.weight.detach()
    if leaf in ("gate_proj", "up_proj"):                   # stacked in the plain model only
        w = parent.gate_up.weight.detach()
        half = w.shape[-2] // 2
        return w[..., :half, :] if leaf == "gate_proj" else w[..., half:, :]
    return torch.cat([model.get_submodule(theirs).weight.detach()
                      for theirs, _ in unfused(name, module)])


def unfused(name: str, module: QuantLinear) -> list[tuple[str, slice]]:
    """The checkpoint's Linears a loaded module holds, with their rows: a fused MLP input
    projection (`mlp.gate_up`) holds gate_proj's rows, then up_proj's."""
    if not module.gated:
        return [(name, slice(None))]
    half, mlp = module.out_features // 2, name.removesuffix(".gate_up")
    return [(f"{mlp}.gate_proj", slice(0, half)), (f"{mlp}.up_proj", slice(half, None))]


def _expert(stack: QuantLinear, e: int) -> QuantLinear:
    """Expert e of a stack as a 2-D QuantLinear (its buffers are views of the stack's)."""
    one = copy.copy(stack)
    one._buffers = {name: buf[e] for name, buf in stack._buffers.items()}
    one.expert_count = 0
    return one


@pytest.mark.parametrize("weights", ["fp8", "nvfp4", "int4"])
def test_quantized_at_load_decodes_like_its_dequantized_weights(checkpoints, make_engine,
                                                                tmp_path, weights):
    """The GEMM path (packed weights) equals a float model holding the dequantized weights:
    the reference is this engine's own weights written back as fp32 and run in bf16 mode."""
    path = checkpoints("dense")
    engine = make_engine(path, method="none", weights=weights)
    twin = tmp_path / "twin"
    shutil.copytree(path, twin)
    tensors = load_file(str(twin / "model.safetensors"))
    for name, module in engine.model.named_modules():
        if isinstance(module, QuantLinear):
            for theirs, rows in unfused(name, module):
                tensors[f"model.{theirs}.weight"] = module.dequantized()[rows].contiguous()
    save_file(tensors, str(twin / "model.safetensors"))
    prompt = engine.tokenizer.encode("pick up the red cup", add_special_tokens=False)
    settings = GenerationSettings(max_new_tokens=24)
    ours = generate(engine, prompt, settings)
    ref = generate(make_engine(twin, method="none"), prompt, settings)
    assert ours.token_ids == ref.token_ids


def test_demo_drafter_quantized_at_load_is_lossless():
    preset = ModelPreset.load("demo")
    engine = Engine.load(preset.engine_config(device="cpu", dtype="fp32", method="dflash",
                                              weights="int4"))
    drafter = engine.proposers["dflash"].drafter
    assert {m.family for m in drafter.modules() if isinstance(m, QuantLinear)} == {"int4"}
    # the planner's chat prompt, which the drafter learned (on raw text the retrained demo
    # repeats "table" and drafts nothing that lands)
    task = "pick up the red cup and put it on the table"
    prompt = encode_chat(engine.tokenizer, [{"role": "user", "content": task}])
    settings = GenerationSettings(max_new_tokens=48)
    spec = generate(engine, prompt, settings)
    plain = generate(Engine.load(preset.engine_config(device="cpu", dtype="fp32",
                                                      method="none", weights="int4")),
                     prompt, settings)
    assert spec.token_ids == plain.token_ids
    assert spec.stats.accepted > 0


def test_tuning_covers_the_target_and_its_proposers_quantized_linears():
    """What FLASH_PLANNER_TUNE_GEMMS measures at load (on CUDA): every distinct quantized
    shape of the target and of the drafter and MTP head, fused gate/up ones by their output."""
    from flash_planner.engine.weights.tuning import distinct_linears

    engine = Engine.load(ModelPreset.load("demo").engine_config(
        device="cpu", dtype="fp32", method="auto", weights="int4"))
    target = distinct_linears([engine.model])
    every = distinct_linears([engine.model, *engine.proposers.values()])
    drafter = distinct_linears([engine.proposers["dflash"].drafter])
    assert target and drafter and set(every) == set(target) | set(drafter) | set(
        distinct_linears([engine.proposers["mtp"].head]))
    assert any(gated for _, _, _, gated, _ in every)
    for (family, n, k, gated, params), linear in every.items():
        assert family == "int4" and params == (linear.group,)
        assert (n * (2 if gated else 1), k) == (linear.out_features, linear.in_features)


# ---- errors -----------------------------------------------------------------------------

def _with_config(src, dst, edit):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def fp8_dir(checkpoints, tmp_path_factory):
    return write_quantized(checkpoints("hybrid"), tmp_path_factory.mktemp("fp8"), "qwen-fp8")[0]


@pytest.fixture(scope="module")
def awq_dir(checkpoints, tmp_path_factory):
    return write_quantized(checkpoints("dense"), tmp_path_factory.mktemp("awq"), "awq")[0]


def test_unknown_quant_method(fp8_dir, tmp_path):
    def edit(cfg):
        cfg["quantization_config"]["quant_method"] = "bitsandbytes"
    with pytest.raises(CheckpointError, match="quant_method 'bitsandbytes' is not supported"):
        load_checkpoint(_with_config(fp8_dir, tmp_path / "x", edit))


def test_unknown_compressed_tensors_format(fp8_dir, tmp_path):
    def edit(cfg):
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {
                "group_0": {"targets": ["Linear"], "weights": {
                    "num_bits": 8, "type": "int", "strategy": "channel"}}}}
    with pytest.raises(CheckpointError, match="format 'int-quantized' with 8-bit int"):
        load_checkpoint(_with_config(fp8_dir, tmp_path / "x", edit))


def test_scale_of_the_wrong_shape(fp8_dir, tmp_path):
    broken = _with_config(fp8_dir, tmp_path / "x", lambda cfg: None)
    tensors = load_file(str(broken / "model.safetensors"))
    name = stored_name(tensors, "model.layers.1.mlp.down_proj.weight_scale_inv")
    tensors[name] = torch.ones(3, 3, dtype=torch.bfloat16)
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"{name} has shape \[3, 3\], expected \[2, 4\] "
                       r"\(fp8 block 32x32 \(Qwen\)\)"):
        load_checkpoint(broken)


def test_missing_scale(fp8_dir, tmp_path):
    broken = _with_config(fp8_dir, tmp_path / "x", lambda cfg: None)
    tensors = load_file(str(broken / "model.safetensors"))
    tensors.pop(stored_name(tensors, "model.layers.2.self_attn.q_proj.weight_scale_inv"), None)
    tensors.pop(stored_name(tensors, "model.layers.3.self_attn.q_proj.weight_scale_inv"))
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing tensor.*q_proj.weight_scale_inv"):
        load_checkpoint(broken)


def test_quantized_tensors_without_a_quantization_config(fp8_dir, tmp_path):
    broken = _with_config(fp8_dir, tmp_path / "x", lambda cfg: cfg.pop("quantization_config"))
    with pytest.raises(CheckpointError, match="is stored quantized .*weight_scale_inv"):
        load_checkpoint(broken)


def test_requantizing_a_quantized_checkpoint_is_refused(fp8_dir):
    with pytest.raises(CheckpointError, match="already quantized .*quantize it twice"):
        load_checkpoint(fp8_dir, weights="int4")


def test_act_order_gptq_is_refused(checkpoints, tmp_path):
    quant, _ = write_quantized(checkpoints("dense"), tmp_path / "g", "gptq")
    tensors = load_file(str(quant / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, str(quant / "model.safetensors"))
    with pytest.raises(CheckpointError, match="up_proj .*g_idx is not the identity order"):
        load_checkpoint(quant)


def test_group_the_kernels_cannot_tile_is_refused_at_load(awq_dir, tmp_path):
    def edit(cfg):
        cfg["quantization_config"]["group_size"] = 16
    with pytest.raises(CheckpointError, match="group_size 16 along K is not supported"):
        load_checkpoint(_with_config(awq_dir, tmp_path / "x", edit))


def test_modelopt_config_in_config_json(checkpoints, make_engine, tmp_path):
    """Newer ModelOpt exports put the same config in config.json (quant_method modelopt)."""
    quant, _ = write_quantized(checkpoints("dense"), tmp_path / "m", "modelopt-nvfp4")
    hf = json.loads((quant / "hf_quant_config.json").read_text())["quantization"]

    def edit(cfg):
        cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4",
                                      "ignore": hf["exclude_modules"], "group_size": 16}
    moved = _with_config(quant, tmp_path / "c", edit)
    (moved / "hf_quant_config.json").unlink()
    prompt = [5, 6, 7, 8]
    settings = GenerationSettings(max_new_tokens=16)
    engine = make_engine(moved, method="none")
    assert {m.family for m in engine.model.modules() if isinstance(m, QuantLinear)} == {"nvfp4"}
    assert (generate(engine, prompt, settings).token_ids
            == generate(make_engine(quant, method="none"), prompt, settings).token_ids)


def test_awq_gemv_is_refused(awq_dir, tmp_path):
    def edit(cfg):
        cfg["quantization_config"]["version"] = "gemv"
    with pytest.raises(CheckpointError, match="AutoAWQ version 'gemv' is not supported"):
        load_checkpoint(_with_config(awq_dir, tmp_path / "x", edit))


def test_onnx_segments_refuse_quantized_weights(awq_dir, make_engine):
    with pytest.raises(ValueError, match="dense_backend 'onnxruntime' cannot run quantized "
                       "weights \\(int4\\)"):
        make_engine(awq_dir, dense_backend="onnxruntime")


def test_ignore_entries_match_across_prefixes():
    name = "model.layers.3.linear_attn.in_proj_a"
    assert matches("model.language_model.layers.3.linear_attn.in_proj_a", name)
    assert matches("model.language_model.layers.3", name)
    assert not matches("model.language_model.layers.30", name)
    assert matches("in_proj_a", name)
    assert matches("re:.*in_proj_a$", name)
    assert matches("*.linear_attn.in_proj_*", name)
    assert not matches("in_proj", name)
    assert matches("model.layers.3.linear_attn", "model.language_model.layers.3.linear_attn.x")


# ---- bytes per forward -----------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("model", sorted(MODELS))
def test_meta_bytes_per_forward_match_the_analytic_count(model, fmt):
    raw = MODELS[model]
    counted = forward_bytes(raw, fmt)
    assert abs(counted / analytic_bytes(raw, fmt) - 1) <= 0.01


def test_27b_bytes_are_what_thor_users_expect():
    gb = {fmt: bytes_per_forward(meta_model(MODELS["Qwen3.6-27B"], fmt)) / 1e9
          for fmt in FORMATS}
    assert 50 < gb["bf16"] < 56 and 26 < gb["fp8"] < 30 and 13 < gb["nvfp4"] < 18
    assert gb["int4"] < gb["fp8"]
