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
# head, the GDN's tiny per-head gates, and the MTP/drafter input projections (fc).
KEEP_FULL = ("lm_head", "in_proj_a", "in_proj_b", "fc")
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


def read_scheme(path: Path, raw: dict[str, Any]) -> Scheme:
    """The scheme of the model directory `path` whose config.json is `raw`."""
    qc = raw.get("quantization_config")
    where = f"{path / 'config.json'}: quantization_config"
    hf_file = path / HF_QUANT_CONFIG
    if qc is None and hf_file.is_file():
        try:
            qc = {"quant_method": "modelopt", **json.loads(hf_file.read_text())["quantization"]}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise WeightFormatError(f"{hf_file}: no readable 'quantization' ({exc})") from exc
        where = str(hf_file)
    if qc is None:
        return UNQUANTIZED
    if not isinstance(qc, dict):
        raise WeightFormatError(f"{where} must be an object")
    method = str(qc.get("quant_method", "")).lower()
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


def _compressed_tensors(qc: dict, where: str) -> Scheme:
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise WeightFormatError(f"{where}: compressed-tensors config without config_groups")
    if qc.get("sparsity_config"):
        raise WeightFormatError(f"{where}: sparse compressed-tensors checkpoints are not "
                                "supported")
    rules = [(list(g.get("targets") or []), _ct_layout(g, qc.get("format"),
                                                       f"{where}.config_groups.{key}"))
             for key, g in groups.items()]
    skip = _ignored(qc.get("ignore"))

    def rule(name: str) -> Layout | None:
        if skip(name):
            return None
        for targets, layout in rules:
            if any(t == "Linear" or matches(t, name) for t in targets):
                return layout
        return None

    labels = sorted({layout.label for _, layout in rules if layout is not None})
    return Scheme(", ".join(labels) or "none", rule)


def _modelopt_layout(algo: str, group: Any, where: str) -> Layout:
    if algo == "NVFP4":
        if group not in (None, 16):
            raise WeightFormatError(f"{where}: NVFP4 group_size {group!r} (16 expected)")
        return nvfp4.modelopt_nvfp4()
    if algo == "FP8":
        return fp8.modelopt_fp8()
    raise WeightFormatError(f"{where}: quant_algo {algo!r} is not supported (supported: "
                            "NVFP4, FP8, MIXED_PRECISION of those)")


def _modelopt(qc: dict, where: str) -> Scheme:
    algo = str(qc.get("quant_algo"))
    skip = _ignored(list(qc.get("exclude_modules") or []) + list(qc.get("ignore") or []))
    if algo == "MIXED_PRECISION":
        layers = qc.get("quantized_layers")
        if not isinstance(layers, dict) or not layers:
            raise WeightFormatError(f"{where}: MIXED_PRECISION without quantized_layers")
        table = {_strip(name): _modelopt_layout(str(v.get("quant_algo")), v.get("group_size"),
                                                f"{where}.quantized_layers.{name}")
                 for name, v in layers.items()}
        labels = sorted({layout.label for layout in table.values()})
        return Scheme("mixed " + " + ".join(labels),
                      lambda name: None if skip(name) else table.get(_strip(name)))
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
