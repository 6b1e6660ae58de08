"""Which Linear of a checkpoint is stored how: the `quantization_config` of config.json (or
ModelOpt's hf_quant_config.json) read into one rule, name -> `Layout` (None: full precision),
and the `weights` setting (auto | bf16 | fp8 | nvfp4 | int4) applied on top of it.

Names are the checkpoint's own module names (`model.language_model.layers.3.mlp.up_proj`,
`mtp.layers.0...`). Ignore lists are matched with and without the multimodal
`model.language_model.` / text-only `model.` prefixes, so a list written for one layout still
applies when the other loads (transformers #48349 silently read bf16 tensors as fp8 there).
"""

from __future__ import annotations

import fnmatch
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import fp8, int4, nvfp4
from .layout import Dequantize, Layout

WEIGHTS = ("auto", "bf16", "fp8", "nvfp4", "int4")
QUANTIZE_AT_LOAD = {"fp8": fp8.quantize_at_load, "nvfp4": nvfp4.quantize_at_load,
                    "int4": int4.quantize_at_load}
# Kept in full precision when quantizing at load, as the published recipes do: the output
# head, the GDN's tiny per-head gates, the MTP/drafter input projections (fc) and DFlash2's
# small conv-kernel and selector projections.
KEEP_FULL = ("lm_head", "in_proj_a", "in_proj_b", "fc", "kernel_projection",
             "hidden_projection")
HF_QUANT_CONFIG = "hf_quant_config.json"
_PREFIXES = ("model.language_model.", "language_model.", "model.")
SUPPORTED = "fp8 (Qwen), compressed-tensors, modelopt (NVFP4/FP8/MIXED_PRECISION), awq, gptq"
# The GEMM kernels step through K in tiles of 32: fp8 blocks and int4 groups along K must be
# whole tiles (every published checkpoint uses 32, 64 or 128)
K_TILE = 32


class WeightFormatError(ValueError):
    """A quantization config the engine cannot load; the message names what and where."""


def _strip(name: str) -> str:
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def matches(entry: str, name: str) -> bool:
    """Whether an ignore/target entry names module `name`: `re:` regex, glob, the module
    or a parent of it (prefix-insensitive), or a suffix of whole name components."""
    if entry.startswith("re:"):
        pattern = re.compile(entry[3:])
        return any(pattern.match(n) for n in (name, _strip(name)))
    if any(c in entry for c in "*?["):
        return any(fnmatch.fnmatchcase(n, entry) for n in (name, _strip(name)))
    short, whole = _strip(entry), _strip(name)
    return (whole == short or whole.startswith(short + ".") or name.endswith("." + entry)
            or name == entry)


@dataclass(frozen=True)
class Scheme:
    """A checkpoint's storage rule: module name -> Layout, or None for full precision."""

    label: str                                    # e.g. "fp8 (Qwen)"; "none" if unquantized
    rule: Callable[[str], Layout | None]

    @property
    def quantized(self) -> bool:
        return self.label != "none"

    def layout_for(self, name: str, n: int, k: int, weights: str) -> Layout | None:
        """How module `name` [n, k] loads under the `weights` setting."""
        stored = self.rule(name)
        if weights == "auto":
            return stored
        if self.quantized:
            if weights == "bf16":
                return Dequantize(stored) if stored is not None else None
            if stored is not None and stored.family != weights:
                raise WeightFormatError(
                    f"the checkpoint is already quantized ({self.label}; {name} is "
                    f"{stored.label}): weights {weights!r} would quantize it twice; use "
                    "auto (as stored) or bf16 (dequantized at load)")
            return stored
        if weights == "bf16" or name.rsplit(".", 1)[-1] in KEEP_FULL:
            return None
        if weights == "nvfp4" and not nvfp4.fits(k):
            return None
        return QUANTIZE_AT_LOAD[weights]()


UNQUANTIZED = Scheme("none", lambda name: None)


def _hf_quant_config(hf_file: Path) -> dict:
    try:
        return {"quant_method": "modelopt", **json.loads(hf_file.read_text())["quantization"]}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise WeightFormatError(f"{hf_file}: no readable 'quantization' ({exc})") from exc


def read_scheme(path: Path, raw: dict[str, Any]) -> Scheme:
    """The scheme of the model directory `path` whose config.json is `raw`.

    When config.json has a `quantization_config` and ModelOpt's hf_quant_config.json is there
    too, config.json wins: ModelOpt derives it from hf_quant_config.json at the same export
    (they agree by construction), it is the file every other loader reads first, and a
    user's edit (an ignore entry, say) lands there. hf_quant_config.json only fills in what
    an older export left out of config.json: the per-layer map of MIXED_PRECISION, which
    exports before the converter knew MIXED_PRECISION wrote only to hf_quant_config.json.
    """
    qc = raw.get("quantization_config")
    where = f"{path / 'config.json'}: quantization_config"
    hf_file = path / HF_QUANT_CONFIG
    if qc is None and hf_file.is_file():
        qc, where = _hf_quant_config(hf_file), str(hf_file)
    if qc is None:
        return UNQUANTIZED
    if not isinstance(qc, dict):
        raise WeightFormatError(f"{where} must be an object")
    # the oldest ModelOpt converter named itself with `quant_library` instead
    method = str(qc.get("quant_method") or qc.get("quant_library") or "").lower()
    if (method == "modelopt" and qc.get("quant_algo") == "MIXED_PRECISION"
            and not qc.get("config_groups") and not qc.get("quantized_layers")
            and where != str(hf_file) and hf_file.is_file()):
        layers = _hf_quant_config(hf_file).get("quantized_layers")
        if layers:
            qc = {**qc, "quantized_layers": layers}
            where = f"{where} (quantized_layers from {hf_file})"
    readers = {"fp8": _qwen_fp8, "compressed-tensors": _compressed_tensors,
               "modelopt": _modelopt, "awq": _awq, "gptq": _gptq}
    if method not in readers:
        raise WeightFormatError(f"{where}: quant_method {method or None!r} is not supported "
                                f"(supported: {SUPPORTED})")
    return readers[method](qc, where)


def _check_k(size: int, what: str, where: str) -> int:
    if not isinstance(size, int) or size <= 0 or size % K_TILE:
        raise WeightFormatError(f"{where}: {what} {size!r} along K is not supported (a "
                                f"positive multiple of {K_TILE} is)")
    return size


def _need(qc: dict, key: str, want, where: str):
    value = qc.get(key)
    if value not in want:
        raise WeightFormatError(f"{where}: {key} {value!r} is not supported (supported: "
                                f"{', '.join(map(repr, want))})")
    return value


def _ignored(entries) -> Callable[[str], bool]:
    entries = list(entries or [])
    return lambda name: any(matches(e, name) for e in entries)


def _qwen_fp8(qc: dict, where: str) -> Scheme:
    if qc.get("fmt", "e4m3") != "e4m3":
        raise WeightFormatError(f"{where}: fmt {qc.get('fmt')!r} is not supported (e4m3 only)")
    block = qc.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and b > 0 for b in block)):
        raise WeightFormatError(f"{where}: weight_block_size {block!r}: expected two positive "
                                "integers such as [128, 128] (per-tensor fp8 is not supported)")
    _check_k(block[1], "weight_block_size", where)
    skip = _ignored(list(qc.get("modules_to_not_convert") or []) + ["lm_head"])
    only = qc.get("modules_to_convert")
    convert = _ignored(only) if only else (lambda name: True)
    layout = fp8.qwen_fp8(tuple(block))
    return Scheme(f"fp8 block {block[0]}x{block[1]} (Qwen)",
                  lambda name: layout if convert(name) and not skip(name) else None)


def _ct_layout(group: dict, fmt: str | None, where: str) -> Layout | None:
    w = group.get("weights")
    fmt = group.get("format") or fmt
    if not w:
        return None
    bits, kind = w.get("num_bits"), w.get("type")
    strategy = str(w.get("strategy"))
    if fmt == "float-quantized" and (bits, kind) == (8, "float"):
        if strategy == "block":
            block = w.get("block_structure")
            if not (isinstance(block, list) and len(block) == 2):
                raise WeightFormatError(f"{where}: block strategy without block_structure")
            _check_k(block[1], "block_structure", where)
            return fp8.ct_fp8("block", tuple(block))
        if strategy in ("channel", "tensor"):
            return fp8.ct_fp8(strategy, None)
    if fmt == "nvfp4-pack-quantized" and (bits, kind, strategy, w.get("group_size")) == (
            4, "float", "tensor_group", 16):
        return nvfp4.ct_nvfp4()
    if fmt == "pack-quantized" and (bits, kind) == (4, "int") and strategy in ("group",
                                                                               "channel"):
        group_size = w.get("group_size") if strategy == "group" else None
        if group_size is not None:
            _check_k(group_size, "group_size", where)
        return int4.CtPacked(group_size, bool(w.get("symmetric", True)))
    raise WeightFormatError(
        f"{where}: compressed-tensors format {fmt!r} with {bits}-bit {kind} weights "
        f"({strategy} strategy) is not supported (supported: float-quantized fp8 "
        "block/channel/tensor, nvfp4-pack-quantized, pack-quantized int4 group/channel)")


_CLASS_TARGETS = ("Linear",)   # a class-name target: every Linear not otherwise matched
_MISSING = object()


def _targets_rule(groups: list[tuple[list[str], Layout | None]], ignore
                  ) -> Callable[[str], Layout | None]:
    """Module name -> the layout of the config group that targets it, in compressed-tensors'
    order of precedence: a module's own name (or a parent's: ModelOpt may name
    `mlp.experts` once for all experts) over `re:`/glob patterns (in sorted order) over a
    class name; a target listed by two groups belongs to the later one. Ignored: None."""
    by_target: dict[str, Layout | None] = {}
    for targets, layout in groups:
        by_target.update(dict.fromkeys(map(str, targets), layout))
    exact, patterns, by_class = {}, [], _MISSING
    for target, layout in sorted(by_target.items()):
        if target in _CLASS_TARGETS:
            by_class = layout
        elif target.startswith("re:") or any(c in target for c in "*?["):
            patterns.append((target, layout))
        else:
            exact[_strip(target)] = layout
    skip = _ignored(ignore)

    def rule(name: str) -> Layout | None:
        if skip(name):
            return None
        parts = _strip(name).split(".")
        for end in range(len(parts), 0, -1):
            hit = exact.get(".".join(parts[:end]), _MISSING)
            if hit is not _MISSING:
                return hit
        for target, layout in patterns:
            if matches(target, name):
                return layout
        return None if by_class is _MISSING else by_class

    return rule


def _scheme_of_groups(groups: list[tuple[list[str], Layout | None]], ignore,
                      prefix: str = "") -> Scheme:
    labels = sorted({layout.label for _, layout in groups if layout is not None})
    label = " + ".join(labels) if labels else "none"
    return Scheme(f"{prefix} {label}" if prefix and labels else label,
                  _targets_rule(groups, ignore))


def _compressed_tensors(qc: dict, where: str) -> Scheme:
    """compressed-tensors: `config_groups` {name: {weights, input_activations, targets,
    format?}}, `ignore`, `format`. With groups in different formats (an FP8 group and an
    NVFP4 one, say) the top-level `format` is "mixed-precision" and each group carries its
    own `format` (one that names none is an error); otherwise a group without a format
    takes the top-level one."""
    groups = qc.get("config_groups")
    if groups == {} and qc.get("kv_cache_scheme"):
        return UNQUANTIZED     # llm-compressor's KV-cache-only recipe (scales: kv_scales.py)
    if not isinstance(groups, dict) or not groups:
        raise WeightFormatError(f"{where}: compressed-tensors config without config_groups")
    if qc.get("sparsity_config"):
        raise WeightFormatError(f"{where}: sparse compressed-tensors checkpoints are not "
                                "supported")
    top = qc.get("format")
    rules = []
    for key, group in groups.items():
        at = f"{where}.config_groups.{key}"
        if not isinstance(group, dict):
            raise WeightFormatError(f"{at} must be an object")
        if top == "mixed-precision" and not group.get("format") and group.get("weights"):
            raise WeightFormatError(f"{at}: the top-level format is mixed-precision, so each "
                                    "group must name its own format (it names none)")
        rules.append((list(group.get("targets") or []), _ct_layout(group, top, at)))
    return _scheme_of_groups(rules, qc.get("ignore"))


def _modelopt_layout(algo: str, group: Any, where: str) -> Layout:
    if algo == "NVFP4":
        if group not in (None, 16):
            raise WeightFormatError(f"{where}: NVFP4 group_size {group!r} (16 expected)")
        return nvfp4.modelopt_nvfp4()
    if algo == "FP8":
        return fp8.modelopt_fp8()
    raise WeightFormatError(f"{where}: quant_algo {algo!r} is not supported (supported: "
                            "NVFP4, FP8, MIXED_PRECISION of those)")


# ModelOpt MIXED_PRECISION, as read here (nvidia-modelopt's export, convert_hf_config.py):
# - hf_quant_config.json {producer, quantization: {quant_algo: MIXED_PRECISION,
#   quantized_layers: {module name: {quant_algo: FP8 | NVFP4 | ..., group_size?}},
#   exclude_modules?, kv_cache_quant_algo}}.
# - config.json `quantization_config`, converted from that at the same export: quant_method
#   "modelopt", quant_algo, ignore (= exclude_modules), kv_cache_scheme, producer and
#   config_groups: one group per distinct per-layer config, named group_0, group_1, ... in
#   order of first appearance, each {weights, input_activations?, targets: the sorted full
#   module names}; newer exports also keep quantized_layers beside it. A group's `weights`
#   tell the format: FP8 is {num_bits 8, type float} (per-tensor: `weight` e4m3 with a 0-dim
#   `weight_scale`, 0-dim `input_scale`); NVFP4 is {num_bits 4, type float, group_size 16};
#   an algorithm the converter has no group for is written as {quant_algo: NAME} alone.
#   Older exports wrote MIXED_PRECISION into config.json with no per-layer detail at all.
# Read: config_groups when present (targets matched as module names, a parent naming all
# of its children), else quantized_layers, else hf_quant_config.json's quantized_layers.
_MODELOPT_GROUPS = "FP8 (num_bits 8, type float), NVFP4 (num_bits 4, type float, group_size 16)"


def _modelopt_group(group: Any, where: str) -> Layout:
    if not isinstance(group, dict):
        raise WeightFormatError(f"{where} must be an object")
    w = group.get("weights")
    if not w:
        if "quant_algo" in group:   # the converter's record of an algorithm it cannot group
            return _modelopt_layout(str(group["quant_algo"]), group.get("group_size"), where)
        raise WeightFormatError(f"{where}: a group without weights (supported: "
                                f"{_MODELOPT_GROUPS})")
    if not isinstance(w, dict):
        raise WeightFormatError(f"{where}.weights must be an object")
    bits, kind, size = w.get("num_bits"), w.get("type"), w.get("group_size")
    strategy = w.get("strategy")
    if (bits, kind, size) == (8, "float", None) and strategy in (None, "tensor"):
        return fp8.modelopt_fp8()
    if (bits, kind, size) == (4, "float", 16) and strategy in (None, "tensor_group"):
        return nvfp4.modelopt_nvfp4()
    shape = f"group_size {size}" if size is not None else f"{strategy or 'tensor'} scales"
    raise WeightFormatError(f"{where}: ModelOpt weights of {bits}-bit {kind} with {shape} "
                            f"are not supported (supported groups: {_MODELOPT_GROUPS})")


def _modelopt(qc: dict, where: str) -> Scheme:
    if qc.get("quant_algo") is None and qc.get("kv_cache_quant_algo"):
        return UNQUANTIZED     # a KV-cache-only export (scales: kv_scales.py)
    algo = str(qc.get("quant_algo"))
    ignore = list(qc.get("exclude_modules") or []) + list(qc.get("ignore") or [])
    skip = _ignored(ignore)
    if algo == "MIXED_PRECISION":
        groups, layers = qc.get("config_groups"), qc.get("quantized_layers")
        if isinstance(groups, dict) and groups:
            rules = []
            for key, group in groups.items():
                at = f"{where}.config_groups.{key}"
                targets = group.get("targets") if isinstance(group, dict) else None
                if not isinstance(targets, list) or not targets:
                    raise WeightFormatError(f"{at}: no targets (a list of module names)")
                rules.append((targets, _modelopt_group(group, at)))
        elif isinstance(layers, dict) and layers:
            rules = [([name], _modelopt_layout(str(v.get("quant_algo")), v.get("group_size"),
                                               f"{where}.quantized_layers.{name}"))
                     for name, v in layers.items()]
        else:
            raise WeightFormatError(f"{where}: MIXED_PRECISION without config_groups or "
                                    f"quantized_layers (nor a {HF_QUANT_CONFIG} with them)")
        return _scheme_of_groups(rules, ignore, "mixed")
    layout = _modelopt_layout(algo, qc.get("group_size"), where)
    return Scheme(layout.label, lambda name: None if skip(name) or name.endswith("lm_head")
                  else layout)


def _awq(qc: dict, where: str) -> Scheme:
    _need(qc, "bits", (4,), where)
    if str(qc.get("version", "gemm")).lower() != "gemm":
        raise WeightFormatError(f"{where}: AutoAWQ version {qc.get('version')!r} is not "
                                "supported (gemm only)")
    if not qc.get("zero_point", True):
        raise WeightFormatError(f"{where}: AutoAWQ without zero_point is not supported")
    group = _check_k(qc.get("group_size", 128), "group_size", where)
    skip = _ignored(list(qc.get("modules_to_not_convert") or []) + ["lm_head"])
    layout = int4.AutoAWQ(group)
    return Scheme(layout.label, lambda name: None if skip(name) else layout)


def _gptq(qc: dict, where: str) -> Scheme:
    _need(qc, "bits", (4,), where)
    group = _check_k(qc.get("group_size", 128), "group_size", where)
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise WeightFormatError(f"{where}: GPTQ checkpoint_format {fmt!r} is not supported")
    # GPTQModel's `dynamic` rules: "-:REGEX" skips the modules the regex matches
    negative = [f"re:{key[2:]}" for key in (qc.get("dynamic") or {}) if key.startswith("-:")]
    skip = _ignored(list(qc.get("modules_to_not_convert") or []) + negative + ["lm_head"])
    layout = int4.Gptq(group, v1=fmt == "gptq")
    return Scheme(layout.label, lambda name: None if skip(name) else layout)
