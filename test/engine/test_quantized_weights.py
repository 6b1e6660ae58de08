"""Quantized checkpoints load unmodified and decode exactly as their dequantized fp32 twins.

Every format (test/quantized_checkpoints.py) in a tiny hybrid Qwen3.5 and a tiny dense Qwen3:
the engine's greedy tokens equal transformers' on the same weights dequantized to fp32, and
the logits agree. Also: the ignore lists across the multimodal/text-only prefixes, the MTP
head and the DFlash drafter through the same path, quantize-at-load, and the clear errors.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from quantized_checkpoints import FORMATS, write_quantized
from transformers import AutoModelForCausalLM, Qwen3_5ForConditionalGeneration

from flash_planner.engine.checkpoint import CheckpointError, load_checkpoint
from flash_planner.engine.generate import GenerationSettings, generate
from flash_planner.engine.weights.linear import QuantLinear
from flash_planner.engine.weights.scheme import WeightFormatError, read_scheme

FAMILY = {"qwen-fp8": {"fp8"}, "ct-fp8-block": {"fp8"}, "ct-fp8-channel": {"fp8"},
          "ct-fp8-static": {"fp8"}, "modelopt-nvfp4": {"nvfp4"}, "ct-nvfp4": {"nvfp4"},
          "modelopt-mixed": {"fp8", "nvfp4"}, "modelopt-mixed-groups": {"fp8", "nvfp4"},
          "ct-mixed": {"fp8", "nvfp4"}, "ct-mixed-static": {"fp8", "nvfp4"},
          "ct-w4a16": {"int4"}, "ct-w4a16-asym": {"int4"}, "awq": {"int4"}, "gptq": {"int4"}}
# the mixed recipes: attention and the big GDN projections fp8, the MLP nvfp4
MIXED_GROUPS = ("modelopt-mixed-groups", "ct-mixed")
PROMPT = "pick up the red cup"


@pytest.fixture(scope="module")
def quantized(checkpoints, tmp_path_factory):
    """(fmt, kind, ignore_prefix, mtp) -> (quantized dir, reference dir), written once."""
    made: dict = {}

    def get(fmt: str, kind: str, ignore_prefix: str | None = None, mtp: bool = False):
        key = (fmt, kind, ignore_prefix, mtp)
        if key not in made:
            src = checkpoints(kind, mtp=True, init=0.25) if mtp else checkpoints(kind)
            made[key] = write_quantized(src, tmp_path_factory.mktemp(fmt), fmt, kind,
                                        ignore_prefix)
        return made[key]

    return get


def _families(model) -> set[str]:
    return {m.family for m in model.modules() if isinstance(m, QuantLinear)}


def _transformers(path, kind):
    cls = Qwen3_5ForConditionalGeneration if kind == "hybrid_vl" else AutoModelForCausalLM
    return cls.from_pretrained(str(path), dtype=torch.float32).eval()


def _assert_same_as_reference(engine, ref_dir, kind, new_tokens=24):
    prompt = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    result = generate(engine, prompt, GenerationSettings(max_new_tokens=new_tokens))
    hf = _transformers(ref_dir, kind)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                          pad_token_id=0)
        ref_logits = hf(input_ids=torch.tensor([prompt])).logits[0, -1]
    assert result.token_ids == ref[0, len(prompt):].tolist()
    from flash_planner.engine.state.cache import InferenceState

    ckpt = engine.checkpoint
    state = InferenceState(ckpt.config, 64, 1, torch.float32, torch.float32,
                           torch.device("cpu"))
    ours = ckpt.model(torch.tensor([prompt]), state).logits[0, -1]
    assert (ours - ref_logits).abs().max().item() <= 1e-3


# compressed-tensors quantizes nn.Linear modules; transformers holds experts fused as 3-D
# parameters, so compressed-tensors run on a transformers MoE leaves them unquantized: the MoE
# kind takes the formats written here from the format descriptions
MOE_FORMATS = ("qwen-fp8", "modelopt-nvfp4", "modelopt-mixed", "modelopt-mixed-groups", "awq",
               "gptq")
CASES = [(fmt, kind) for kind in ("hybrid", "dense") for fmt in FORMATS] + [
    (fmt, "hybrid_moe") for fmt in MOE_FORMATS]


@pytest.mark.parametrize("fmt,kind", CASES)
def test_format_decodes_like_its_dequantized_twin(quantized, make_engine, fmt, kind):
    quant_dir, ref_dir = quantized(fmt, kind)
    engine = make_engine(quant_dir, method="none")
    assert _families(engine.model) == FAMILY[fmt]
    assert engine.checkpoint.quantized, "nothing was loaded quantized"
    if kind == "hybrid_moe":   # the experts are quantized stacks; router and gate are not
        mlp = engine.model.layers[0].mlp
        assert isinstance(mlp.experts.down_proj, QuantLinear)
        assert mlp.experts.down_proj.expert_count == 8
        assert mlp.gate.weight.dtype == torch.float32
    _assert_same_as_reference(engine, ref_dir, kind)


def test_bf16_setting_dequantizes_a_quantized_checkpoint(quantized, make_engine):
    quant_dir, ref_dir = quantized("awq", "hybrid")
    engine = make_engine(quant_dir, method="none", weights="bf16")
    assert _families(engine.model) == set()
    _assert_same_as_reference(engine, ref_dir, "hybrid")


def test_multimodal_checkpoint_with_prefixed_ignore_list(quantized, make_engine):
    quant_dir, ref_dir = quantized("qwen-fp8", "hybrid_vl")
    cfg = json.loads((quant_dir / "config.json").read_text())["quantization_config"]
    assert all(m.startswith("model.language_model.") for m in
               cfg["modules_to_not_convert"] if m not in ("lm_head", "mtp.fc"))
    _assert_same_as_reference(make_engine(quant_dir, method="none"), ref_dir, "hybrid_vl")


def test_text_only_checkpoint_with_a_multimodal_ignore_list(quantized, make_engine):
    """transformers #48349: a list spelled `model.language_model.*` must still keep the
    text-only checkpoint's bf16 in_proj_a/b out of fp8."""
    quant_dir, ref_dir = quantized("qwen-fp8", "hybrid", "model.language_model.")
    engine = make_engine(quant_dir, method="none")
    gdn = engine.model.layers[0].linear_attn
    assert not isinstance(gdn.in_proj_a, QuantLinear)
    assert isinstance(gdn.in_proj_qkv, QuantLinear)
    _assert_same_as_reference(engine, ref_dir, "hybrid")


def test_an_ignore_list_that_misses_a_full_precision_module_is_a_clear_error(
        quantized, tmp_path):
    import shutil

    quant_dir, _ = quantized("qwen-fp8", "hybrid")
    broken = tmp_path / "broken"
    shutil.copytree(quant_dir, broken)
    cfg = json.loads((broken / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"] = ["lm_head"]
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) model\.(language_model\.)?"
                       r"layers.0.linear_attn.in_proj_a.weight_scale_inv.*fp8 block 32x32 "
                       r"\(Qwen\)"):
        load_checkpoint(broken)


@pytest.mark.parametrize("kind", ["hybrid", "hybrid_moe"])
@pytest.mark.parametrize("fmt", ["qwen-fp8", "modelopt-nvfp4"])
def test_mtp_head_loads_quantized_and_stays_lossless(quantized, make_engine, fmt, kind):
    quant_dir, _ = quantized(fmt, kind, mtp=True)
    engine = make_engine(quant_dir, method="mtp", mtp_steps=3)
    head = engine.proposers["mtp"].head
    assert _families(head) == FAMILY[fmt]
    assert not isinstance(head.fc, QuantLinear)
    prompt = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    plain = generate(make_engine(quant_dir, method="none"), prompt,
                     GenerationSettings(max_new_tokens=40))
    spec = generate(engine, prompt, GenerationSettings(max_new_tokens=40))
    assert spec.stats.cycles < len(spec.token_ids), "MTP accepted nothing: a weak test"
    assert spec.token_ids == plain.token_ids


def _recipe_families(model) -> dict[str, set[str]]:
    """projection -> the families its modules loaded in (e.g. q_proj -> {"fp8"})."""
    found: dict[str, set[str]] = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            found.setdefault(name.rsplit(".", 1)[-1], set()).add(module.family)
    return found


RECIPE = {**dict.fromkeys(("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z",
                           "out_proj"), {"fp8"}),
          **dict.fromkeys(("gate_up", "down_proj"), {"nvfp4"})}  # gate and up fused


def _copy(quant_dir, tmp_path):
    import shutil

    return shutil.copytree(quant_dir, tmp_path / "copy")


def _edit_quant_config(path, edit) -> None:
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg["quantization_config"])
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("fmt", MIXED_GROUPS)
def test_mixed_groups_load_each_linear_in_its_groups_format(quantized, fmt):
    """Attention q/k/v/o and GDN in_proj_qkv/in_proj_z/out_proj as fp8 modules, the MLP as
    nvfp4 ones, in_proj_a/b and the head in full precision."""
    quant_dir, _ = quantized(fmt, "hybrid")
    ckpt = load_checkpoint(quant_dir)
    assert _recipe_families(ckpt.model) == RECIPE
    gdn = ckpt.model.layers[0].linear_attn
    assert not isinstance(gdn.in_proj_a, QuantLinear)
    assert not isinstance(gdn.in_proj_b, QuantLinear)
    fp8_label = "fp8 per-tensor (ModelOpt)" if fmt.startswith("modelopt") else (
        "fp8 per-channel (compressed-tensors)")
    assert ckpt.quantized[fp8_label] == 14          # 2 layers x 4 attention, 2 x 3 GDN


@pytest.mark.parametrize("variant", ["groups-only", "layers-in-hf-file-only"])
def test_modelopt_mixed_reads_groups_or_the_per_layer_map(quantized, tmp_path, variant):
    """config_groups alone suffice (no quantized_layers anywhere); an older export whose
    config.json names MIXED_PRECISION without any per-layer detail takes hf_quant_config's."""
    quant_dir, _ = quantized("modelopt-mixed-groups", "hybrid")
    path = _copy(quant_dir, tmp_path)
    if variant == "groups-only":
        _edit_quant_config(path, lambda qc: qc.pop("quantized_layers"))
        (path / "hf_quant_config.json").unlink()
    else:
        _edit_quant_config(path, lambda qc: [qc.pop(k) for k in ("quantized_layers",
                                                                   "config_groups")])
    assert _recipe_families(load_checkpoint(path).model) == RECIPE


def _unsupported_group(qc) -> str:
    """Turn the NVFP4 group into one the engine does not load: ModelOpt's W4A16_AWQ (int4,
    group 128), compressed-tensors' W8A8 int8 (int-quantized, per channel). Its name."""
    key = next(k for k, g in qc["config_groups"].items() if g["weights"]["num_bits"] == 4)
    group = qc["config_groups"][key]
    if qc["quant_method"] == "modelopt":
        group["weights"] = {"dynamic": False, "num_bits": 4, "type": "int", "group_size": 128}
    else:
        group["format"] = "int-quantized"
        group["weights"].update(num_bits=8, type="int", strategy="channel", group_size=None)
    return key


@pytest.mark.parametrize("fmt", MIXED_GROUPS)
def test_an_unsupported_group_format_names_the_group(quantized, tmp_path, fmt):
    quant_dir, _ = quantized(fmt, "hybrid")
    path = _copy(quant_dir, tmp_path)
    keys = []
    _edit_quant_config(path, lambda qc: keys.append(_unsupported_group(qc)))
    raw = json.loads((path / "config.json").read_text())
    with pytest.raises(WeightFormatError, match=rf"config_groups\.{keys[0]}: .*not supported "
                       r"\(supported.*(NVFP4|nvfp4)"):
        read_scheme(path, raw)
    with pytest.raises(CheckpointError, match=rf"config_groups\.{keys[0]}"):
        load_checkpoint(path)


def test_a_mixed_precision_group_without_its_format_is_an_error(quantized, tmp_path):
    quant_dir, _ = quantized("ct-mixed", "hybrid")
    path = _copy(quant_dir, tmp_path)
    _edit_quant_config(path, lambda qc: qc["config_groups"]["group_1"].pop("format"))
    with pytest.raises(WeightFormatError, match=r"config_groups\.group_1: the top-level format "
                       "is mixed-precision"):
        read_scheme(path, json.loads((path / "config.json").read_text()))


# ---- one-value scales: 0-dim or [1], in any float dtype (issue 63) ----------------------

def _header(path, name) -> tuple[list[int], str]:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        sl = f.get_slice(name)
        return sl.get_shape(), sl.get_dtype()


@pytest.mark.parametrize("fmt,dtype", [("ct-fp8-static", "F32"), ("ct-mixed-static", "BF16")])
def test_static_formats_carry_the_scales_compressed_tensors_writes(quantized, fmt, dtype):
    """What the refused checkpoint of issue 63 carried, so the decode tests above cover it:
    static per-tensor input scales [1] in the model's dtype beside a [1] weight scale."""
    quant_dir, _ = quantized(fmt, "dense")
    for suffix in ("input_scale", "weight_scale"):
        assert _header(quant_dir, f"model.layers.0.self_attn.q_proj.{suffix}") == ([1], dtype)


def _rewrite(path, edit) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def _one_value_scales(tensors) -> list[str]:
    return [n for n, t in tensors.items() if t.numel() == 1 and t.is_floating_point()
            and n.endswith(("scale", "scale_2"))]


def _flip_scales(tensors) -> None:
    """0-dim <-> [1] for every one-value scale; activation scales (read, unused) to fp16."""
    for name in _one_value_scales(tensors):
        t = tensors[name]
        t = t.reshape(1) if t.dim() == 0 else t.reshape(())
        tensors[name] = t.half() if name.endswith(("input_scale", "input_global_scale")) else t


def _decode(engine, new_tokens=16):
    prompt = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    tokens = generate(engine, prompt, GenerationSettings(max_new_tokens=new_tokens)).token_ids
    from flash_planner.engine.state.cache import InferenceState

    ckpt = engine.checkpoint
    state = InferenceState(ckpt.config, 64, 1, torch.float32, torch.float32,
                           torch.device("cpu"))
    with torch.no_grad():
        return tokens, ckpt.model(torch.tensor([prompt]), state).logits[0, -1]


@pytest.mark.parametrize("fmt", ["modelopt-mixed", "ct-mixed-static", "ct-nvfp4"])
def test_one_value_scales_load_in_either_shape(quantized, make_engine, tmp_path, fmt):
    """ModelOpt writes one-value scales 0-dim, compressed-tensors [1]: each loads the other
    way round too, the used ones (fp8 per-tensor weight_scale, nvfp4 weight_scale_2 /
    weight_global_scale) to the same values, so the decode is unchanged."""
    quant_dir, _ = quantized(fmt, "hybrid")
    path = _copy(quant_dir, tmp_path)
    flipped = []
    _rewrite(path, lambda tensors: (flipped.extend(_one_value_scales(tensors)),
                                    _flip_scales(tensors)))
    assert any(n.endswith(("weight_scale", "weight_scale_2", "weight_global_scale"))
               for n in flipped), "no used one-value scale was rewritten: a weak test"
    tokens, logits = _decode(make_engine(path, method="none"))
    ref_tokens, ref_logits = _decode(make_engine(quant_dir, method="none"))
    assert tokens == ref_tokens
    assert torch.equal(logits, ref_logits)


@pytest.mark.parametrize("fmt,suffix,value,error", [
    pytest.param("ct-fp8-static", "input_scale", torch.ones(2),
                 r"input_scale has shape \[2\], expected \[\] or \[1\] \(fp8 per-tensor "
                 r"\(compressed-tensors\)\)", id="ct-input_scale-[2]"),
    pytest.param("ct-fp8-static", "weight_scale", torch.ones(1, 1),
                 r"weight_scale has shape \[1, 1\], expected \[\] or \[1\] \(fp8 per-tensor",
                 id="ct-weight_scale-[1,1]"),
    pytest.param("ct-fp8-static", "input_scale", torch.ones(1, dtype=torch.int32),
                 r"input_scale has dtype I32, expected F32/BF16/F16/F64 \(fp8 per-tensor",
                 id="ct-input_scale-int32"),
    pytest.param("modelopt-nvfp4", "weight_scale_2", torch.ones(2),
                 r"weight_scale_2 has shape \[2\], expected \[\] or \[1\] \(nvfp4 "
                 r"\(ModelOpt\)\)", id="modelopt-weight_scale_2-[2]"),
    pytest.param("ct-mixed-static", "weight_scale", torch.ones(3, 1),
                 r"weight_scale has shape \[3, 1\], expected \[\] or \[1\]",
                 id="ct-mixed-weight_scale-[3,1]"),
])
def test_a_scale_that_is_not_one_value_is_a_clear_error(quantized, tmp_path, fmt, suffix,
                                                         value, error):
    quant_dir, _ = quantized(fmt, "dense")
    path = _copy(quant_dir, tmp_path)
    proj = "mlp.down_proj" if fmt == "modelopt-nvfp4" else "self_attn.q_proj"
    name = f"model.layers.1.{proj}.{suffix}"

    def edit(tensors):
        assert name in tensors, name
        tensors[name] = value
    _rewrite(path, edit)
    with pytest.raises(CheckpointError, match=re.escape(name.removesuffix(suffix)) + error):
        load_checkpoint(path)
