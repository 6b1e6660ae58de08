"""Quantized copies of a tiny fp32 checkpoint, each with its dequantized fp32 twin.

`write_quantized(src, dst, fmt)` writes `dst/quantized` (the format exactly as its upstream
tool lays it out) and `dst/reference` (the same model with every quantized Linear replaced by
its dequantized fp32 weight, no quantization_config: what transformers runs as the
reference). compressed-tensors checkpoints are made by compressed-tensors itself (its
compressors pack, its `fake_quantize` dequantizes); Qwen FP8, ModelOpt NVFP4/FP8, AutoAWQ and
GPTQ are written here from the format descriptions (FACTS.md section 11), by code that shares
nothing with the engine's loaders.

Mixed precision, NVIDIA's Qwen3.6 recipe (attention and the big GDN projections FP8, the MLP
NVFP4): `modelopt-mixed` as older ModelOpt exports wrote it (hf_quant_config.json's
`quantized_layers` only), `modelopt-mixed-groups` as newer ones do (also config.json's
`quantization_config` with one config group per format, targets the module names; nvidia-
modelopt is not installed here, so that config is written from the format description),
`ct-mixed` as compressed-tensors writes two groups in different formats (top-level `format`
mixed-precision, each group its own: FP8 per channel and NVFP4).

Static per-tensor FP8 activations (llm-compressor's W8A8-FP8 `FP8` preset): `ct-fp8-static`
on every Linear, and `ct-mixed-static`, the mixed recipe with that FP8 group, its scales
registered as compressed-tensors registers them for a bf16 model (bf16, shape [1]). Both
carry a [1] `input_scale` per Linear. No calibration runs here, so the input scale holds the
library's qparams for an assumed activation range (`_static_input_scale`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
AWQ_POSITION = [0, 4, 1, 5, 2, 6, 3, 7]
# the unquantized projections of the published recipes (and transformers' lm_head rule)
KEEP = ("in_proj_a", "in_proj_b", "lm_head", "mtp.fc")
FORMATS = ("qwen-fp8", "modelopt-nvfp4", "modelopt-mixed", "modelopt-mixed-groups",
           "ct-fp8-block", "ct-fp8-channel", "ct-fp8-static", "ct-nvfp4", "ct-mixed",
           "ct-mixed-static", "ct-w4a16", "ct-w4a16-asym", "awq", "gptq")
MIXED = ("modelopt-mixed", "modelopt-mixed-groups")
# ct-mixed: NVIDIA's Qwen3.6 recipe spelled as compressed-tensors targets: attention and the
# big GDN projections FP8 per channel, the MLP NVFP4
CT_MIXED_FP8 = [r"re:.*self_attn\.[qkvo]_proj$",
                r"re:.*linear_attn\.(in_proj_qkv|in_proj_z|out_proj)$"]
CT_MIXED_NVFP4 = [r"re:.*mlp.*proj$"]
# written as from a bf16 model: every scale compressed-tensors registers is bf16
BF16_SCALES = ("ct-mixed-static",)


def _projections(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Module names of every text Linear but the output head (all are named *proj*)."""
    return [n.removesuffix(".weight") for n, t in tensors.items() if n.endswith(".weight")
            and t.dim() == 2 and "proj" in n.rsplit(".", 2)[-2] and "visual" not in n]


def _linears(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Module names of the Linears a recipe quantizes."""
    return [n for n in _projections(tensors) if not any(k in n for k in KEEP)]


def _copy_dir(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != (
                "model.safetensors.index.json"):
            shutil.copy(f, dst / f.name)


def _load_all(src: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    return tensors


def _edit_config(path: Path, **updates) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(updates)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))


# ---- formats written here --------------------------------------------------------------

def _fp8_blocks(w: torch.Tensor, bn: int, bk: int):
    n, k = w.shape
    scale = torch.zeros(-(-n // bn), -(-k // bk))
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            scale[i, j] = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].abs().max() / 448
    scale = scale.to(torch.bfloat16)                      # Qwen ships bf16 scales
    full = scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    q = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, scale, q.float() * full


def _nvfp4(w: torch.Tensor):
    n, k = w.shape
    table = torch.tensor(E2M1)
    scale_2 = w.abs().max() / (6 * 448)
    groups = w.reshape(n, k // 16, 16)
    scale = (groups.abs().amax(-1) / 6 / scale_2).to(torch.float8_e4m3fn)
    step = (scale.float() * scale_2)[..., None]
    codes = (groups[..., None] / step[..., None] - table).abs().argmin(-1)  # [n, k/16, 16]
    codes = codes.reshape(n, k).to(torch.uint8)
    packed = torch.zeros(n, k // 2, dtype=torch.uint8)
    for j in range(k // 2):
        packed[:, j] = codes[:, 2 * j] + 16 * codes[:, 2 * j + 1]
    deq = table[codes.long()].reshape(n, k // 16, 16) * step
    return packed, scale, scale_2.reshape(()), deq.reshape(n, k)


def _int4_groups(w: torch.Tensor, group: int):
    """Asymmetric min/max per group along K: q, zero [N, K / G], fp16 scale [N, K / G]."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=1e-8).to(torch.float16)
    zero = torch.round(-lo / scale.float()).clamp(0, 15)
    q = torch.round(g / scale.float()[..., None] + zero[..., None]).clamp(0, 15)
    deq = ((q - zero[..., None]) * scale.float()[..., None]).reshape(n, k)
    return q.reshape(n, k).int(), zero.int(), scale, deq


def _pack_words(values: torch.Tensor, positions=range(8)) -> torch.Tensor:
    """int [R, 8 W] -> int32 [R, W]: element e of each 8 at nibble positions[e]."""
    r, c = values.shape
    words = torch.zeros(r, c // 8, dtype=torch.int64)
    for e, pos in enumerate(positions):
        words |= values[:, e::8].long() << (4 * pos)
    return (words - ((words >> 31) << 32)).to(torch.int32)   # two's complement int32


def _write_here(fmt: str, tensors: dict, linears: list[str], own_prefix: str,
                ignore_prefix: str):
    out, deq = dict(tensors), dict(tensors)
    layers: dict[str, dict] = {}
    for name in linears:
        w = tensors[f"{name}.weight"].float()
        del out[f"{name}.weight"]
        mixed_fp8 = fmt in MIXED and ".mlp." not in name
        if fmt == "qwen-fp8":
            q, s, d = _fp8_blocks(w, 32, 32)
            out[f"{name}.weight"], out[f"{name}.weight_scale_inv"] = q, s
        elif mixed_fp8:
            s = w.abs().max() / 448
            q = (w / s).to(torch.float8_e4m3fn)
            d = q.float() * s
            out[f"{name}.weight"], out[f"{name}.weight_scale"] = q, s.reshape(())
            out[f"{name}.input_scale"] = torch.tensor(1.0)
            layers[name] = {"quant_algo": "FP8"}
        elif fmt == "modelopt-nvfp4" or fmt in MIXED:
            packed, s, s2, d = _nvfp4(w)
            out[f"{name}.weight"], out[f"{name}.weight_scale"] = packed, s
            out[f"{name}.weight_scale_2"], out[f"{name}.input_scale"] = s2, torch.tensor(1.0)
            layers[name] = {"quant_algo": "NVFP4", "group_size": 16}
        elif fmt == "awq":
            q, z, s, d = _int4_groups(w, 32)
            out[f"{name}.qweight"] = _pack_words(q.T.contiguous(), AWQ_POSITION)
            out[f"{name}.qzeros"] = _pack_words(z.T.contiguous(), AWQ_POSITION)
            out[f"{name}.scales"] = s.T.contiguous()
        elif fmt == "gptq":
            q, z, s, d = _int4_groups(w, 32)
            out[f"{name}.qweight"] = _gptq_qweight(q)
            out[f"{name}.qzeros"] = _pack_words(((z - 1) & 15).T.contiguous())
            out[f"{name}.scales"] = s.T.contiguous()
            out[f"{name}.g_idx"] = (torch.arange(w.shape[1]) // 32).int()
        deq[f"{name}.weight"] = d
    kept = sorted(n.removeprefix(own_prefix) for n in _projections(tensors)
                  if n not in linears and not n.startswith("mtp."))
    not_converted = [ignore_prefix + n for n in kept] + ["lm_head", "mtp.fc"]
    ignore = ["*in_proj_a*", "*in_proj_b*", "lm_head", "mtp.fc"]
    config = {
        "qwen-fp8": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                     "weight_block_size": [32, 32],
                     "modules_to_not_convert": not_converted},
        "awq": {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": not_converted},
        # GPTQModel names the modules it skipped with negative `dynamic` rules
        "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False,
                 "sym": False, "checkpoint_format": "gptq",
                 "dynamic": {"-:.*in_proj_[ab]$": {}}},
    }.get(fmt)
    hf_quant = None
    if fmt == "modelopt-nvfp4":
        hf_quant = {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ignore,
                    "kv_cache_quant_algo": None}
    elif fmt in MIXED:
        hf_quant = {"quant_algo": "MIXED_PRECISION", "quantized_layers": layers,
                    "exclude_modules": ignore, "kv_cache_quant_algo": None}
    if fmt == "modelopt-mixed-groups":   # newer exports: config.json has it too, as groups
        config = _modelopt_groups(hf_quant)
    return out, deq, config, hf_quant


def _modelopt_groups(hf_quant: dict) -> dict:
    """config.json's `quantization_config` of a ModelOpt MIXED_PRECISION export (what its
    export's converter derives from hf_quant_config.json, written from the format
    description): one config group per distinct per-layer config, numbered in order of
    first appearance, targets the sorted module names; the per-layer map kept beside."""
    weights = {"FP8": {"dynamic": False, "num_bits": 8, "type": "float"},
               "NVFP4": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}}
    inputs = {"FP8": weights["FP8"], "NVFP4": weights["NVFP4"]}
    by_config: dict[str, list[str]] = {}
    for name, layer in hf_quant["quantized_layers"].items():
        by_config.setdefault(json.dumps(layer, sort_keys=True), []).append(name)
    groups = {}
    for i, (key, names) in enumerate(by_config.items()):
        algo = json.loads(key)["quant_algo"]
        groups[f"group_{i}"] = {"input_activations": dict(inputs[algo]),
                                "weights": dict(weights[algo]), "targets": sorted(names)}
    return {"config_groups": groups, "quantized_layers": hf_quant["quantized_layers"],
            "ignore": hf_quant["exclude_modules"], "quant_algo": "MIXED_PRECISION",
            "producer": {"name": "modelopt", "version": "0.47.0"}, "quant_method": "modelopt"}


def _gptq_qweight(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] -> GPTQ qweight int32 [K / 8, N]: element 8i + j of column n in nibble j."""
    return _pack_words(q.contiguous()).T.contiguous()


# ---- compressed-tensors, made by compressed-tensors --------------------------------------

def _ct_groups(fmt: str) -> dict:
    """The config groups of the format: llm-compressor's preset schemes."""
    if fmt in ("ct-mixed", "ct-mixed-static"):
        fp8 = "ct-fp8-static" if fmt == "ct-mixed-static" else "ct-fp8-channel"
        return {"group_0": _ct_scheme(fp8, CT_MIXED_FP8),
                "group_1": _ct_scheme("ct-nvfp4", CT_MIXED_NVFP4)}
    return {"group_0": _ct_scheme(fmt)}


def _ct_scheme(fmt: str, targets: list[str] | None = None):
    """llm-compressor's preset scheme for the format, with groups/blocks small enough for the
    tiny models (the presets' 128 does not divide their 64-wide layers)."""
    from compressed_tensors.quantization import preset_name_to_scheme

    preset, override = {
        "ct-fp8-block": ("FP8_BLOCK", {"block_structure": [32, 32]}),
        "ct-fp8-channel": ("FP8_DYNAMIC", {}),
        "ct-fp8-static": ("FP8", {}),
        "ct-nvfp4": ("NVFP4A16", {}),
        "ct-w4a16": ("W4A16", {"group_size": 32}),
        "ct-w4a16-asym": ("W4A16_ASYM", {"group_size": 32}),
    }[fmt]
    scheme = preset_name_to_scheme(preset, targets or ["Linear"])
    scheme.weights = scheme.weights.model_copy(update=override)
    return scheme


def _observe(w: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """min/max over each scale's elements (what llm-compressor's min-max observer does)."""
    n, k = w.shape
    strategy = str(getattr(args.strategy, "value", args.strategy))
    if strategy == "tensor":
        return w.amin().reshape(1), w.amax().reshape(1)
    if strategy == "channel":
        return w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    if strategy in ("group", "tensor_group"):
        g = w.reshape(n, k // args.group_size, args.group_size)
        return g.amin(-1), g.amax(-1)
    bn, bk = args.block_structure
    b = w.reshape(n // bn, bn, k // bk, bk)
    return b.amin((1, 3)), b.amax((1, 3))


def _rescale_dtype(module, scheme, dtype: torch.dtype) -> None:
    """Register the module's qparams as compressed-tensors does for a model in `dtype` (its
    scales take the weight's dtype: a bf16 model's are bf16)."""
    from compressed_tensors.quantization.lifecycle.initialize import initialize_qparams

    shape = module.weight.shape
    for base, args, observed in (("input", scheme.input_activations, shape[-1:]),
                                 ("weight", scheme.weights, shape)):
        if args is not None:
            initialize_qparams(module, base, args, observed_shape=observed,
                               observed_dtype=dtype)


def _static_input_scale(module, args) -> None:
    """A static per-tensor activation scale as llm-compressor's calibration leaves it: no
    calibration runs here, so the scale is the library's own qparams for an assumed
    activation range of +-4 (the engine reads and does not use it)."""
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    lo, hi = torch.full((1,), -4.0), torch.full((1,), 4.0)
    scale, zp = calculate_qparams(lo, hi, args)
    module.input_scale.copy_(scale.reshape(module.input_scale.shape))
    if hasattr(module, "input_zero_point"):
        module.input_zero_point.copy_(zp.reshape(module.input_zero_point.shape))


def _write_ct(fmt: str, src: Path, dst: Path, ignore: list[str], kind: str) -> None:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam
    from transformers import AutoModelForCausalLM, Qwen3_5ForConditionalGeneration

    cls = Qwen3_5ForConditionalGeneration if kind == "hybrid_vl" else AutoModelForCausalLM
    model = cls.from_pretrained(str(src), dtype=torch.float32).eval()
    config = QuantizationConfig(config_groups=_ct_groups(fmt), ignore=ignore)
    apply_quantization_config(model, config)
    reference: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            scheme = getattr(module, "quantization_scheme", None)
            if scheme is None or scheme.weights is None:
                continue
            args, w = scheme.weights, module.weight
            if fmt in BF16_SCALES:
                _rescale_dtype(module, scheme, torch.bfloat16)
            if hasattr(module, "input_scale"):
                _static_input_scale(module, scheme.input_activations)
            gs = None
            if hasattr(module, "weight_global_scale"):
                gs = generate_gparam(w.amin().reshape(1), w.amax().reshape(1))
                module.weight_global_scale.copy_(gs)
            scale, zp = calculate_qparams(*_observe(w, args), args, global_scale=gs)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zp.reshape(module.weight_zero_point.shape))
            # fake_quantize returns the scale's dtype: a bf16 scale would round the fp32
            # twin to bf16, while e4m3 values times that scale are exact in fp32
            reference[f"{name}.weight"] = fake_quantize(
                w, module.weight_scale.float(), getattr(module, "weight_zero_point", None),
                args, global_scale=gs).float()
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(str(dst / "quantized"))
    compressor.update_config(str(dst / "quantized"))
    ref_tensors = _load_all(src)
    for name, w in reference.items():
        # transformers 5.2 saves a text-only model's modules under model.language_model.
        stored = name if name in ref_tensors else (
            "model.language_model." + name.removeprefix("model."))
        assert stored in ref_tensors, name
        ref_tensors[stored] = w
    save_file(ref_tensors, str(dst / "reference" / "model.safetensors"))


def write_quantized(src: Path, dst: Path, fmt: str, kind: str = "hybrid",
                    ignore_prefix: str | None = None) -> tuple[Path, Path]:
    """(quantized dir, dequantized fp32 reference dir) of the fp32 checkpoint `src`.
    ignore_prefix: how Qwen FP8's modules_to_not_convert spells module names (default: as
    the checkpoint does)."""
    quant, ref = dst / "quantized", dst / "reference"
    _copy_dir(src, quant)
    _copy_dir(src, ref)
    tensors = _load_all(src)
    # as the checkpoint spells its text modules (transformers 5.2 writes a text-only model's
    # under model.language_model. too)
    prefix = ("model.language_model." if any(n.startswith("model.language_model.")
                                             for n in tensors) else "model.")
    ignore_prefix = prefix if ignore_prefix is None else ignore_prefix
    if fmt.startswith("ct-"):
        ignore = ["lm_head", "re:.*in_proj_a$", "re:.*in_proj_b$"]
        _write_ct(fmt, src, dst, ignore, kind)
        return quant, ref
    out, deq, config, hf_quant = _write_here(fmt, tensors, _linears(tensors), prefix,
                                             ignore_prefix)
    save_file(out, str(quant / "model.safetensors"))
    save_file(deq, str(ref / "model.safetensors"))
    if config is not None:
        _edit_config(quant, quantization_config=config)
    if hf_quant is not None:
        (quant / "hf_quant_config.json").write_text(json.dumps(
            {"producer": {"name": "modelopt", "version": "0.47.0"}, "quantization": hf_quant}))
    return quant, ref
