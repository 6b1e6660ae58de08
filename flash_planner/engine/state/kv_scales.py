"""FP8 KV-cache scales a quantized checkpoint stores beside its attention layers.

llm-compressor's `kv_cache_scheme` (compressed-tensors) writes `self_attn.k_scale` and
`self_attn.v_scale` for every attention layer: [1] with strategy tensor, [num_kv_heads, 1, 1]
with strategy attn_head, in the model's dtype (bf16 for a bf16 model). NVIDIA ModelOpt's FP8
KV export writes per-tensor float32 scalars under the projections, `self_attn.k_proj.k_scale`
and `self_attn.v_proj.v_scale`; older compressed-tensors exports wrote `k_proj.output_scale`
and `v_proj.output_scale` (vLLM reads all three spellings). Every one is the multiplier of
the e4m3 values, x_fp8 = e4m3(x / scale) and x = x_fp8 * scale, the convention of our cache
(kernels/kv_append), so they load as stored: float32, one per kv head.

A layer with scales here is never calibrated (`KVCache.fixed`); the others calibrate on the
first prompt as before. A checkpoint that declares a KV cache other than FP8 (ModelOpt's
NVFP4 KV, an int8 `kv_cache_scheme`) keeps its scales unread: they are not e4m3 scales.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ModelConfig
from ..weights.load import LOADABLE_DTYPES, open_shard, read_headers
from ..weights.scheme import HF_QUANT_CONFIG

log = logging.getLogger(__name__)

# where a layer's scale may be stored, after `...layers.{i}.self_attn.`, for K ("k") and V
SPELLINGS = ("{kv}_scale", "{kv}_proj.{kv}_scale", "{kv}_proj.output_scale")


@dataclass(frozen=True)
class KVScales:
    """The checkpoint's scales: model layer index -> float32 [Hkv], for K and for V."""

    k: dict[int, torch.Tensor]
    v: dict[int, torch.Tensor]
    names: frozenset[str]          # the tensors read (the loader counts them as used)

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted(self.k))


def _not_fp8(path: Path, raw: dict) -> str | None:
    """What the checkpoint declares its KV cache to be, when that is not FP8 e4m3 (None:
    FP8, or nothing declared): config.json's `kv_cache_scheme` (compressed-tensors, newer
    ModelOpt exports) or ModelOpt's `kv_cache_quant_algo` (there or in hf_quant_config.json)."""
    qc = raw.get("quantization_config")
    declared = [("config.json", qc if isinstance(qc, dict) else {})]
    hf_file = path / HF_QUANT_CONFIG
    if hf_file.is_file():
        try:
            declared.append((HF_QUANT_CONFIG, dict(json.loads(hf_file.read_text())
                                                   ["quantization"])))
        except (OSError, ValueError, KeyError, TypeError):
            pass            # the weights' scheme reports an unreadable file
    for where, config in declared:
        scheme, algo = config.get("kv_cache_scheme"), config.get("kv_cache_quant_algo")
        bits, kind = (scheme.get("num_bits"), scheme.get("type")) if isinstance(
            scheme, dict) else (8, "float")
        if (bits, kind) != (8, "float"):
            return f"{where}'s kv_cache_scheme is {bits}-bit {kind}"
        if algo not in (None, "FP8"):
            return f"{where}'s kv_cache_quant_algo is {algo}"
    return None


def _stored_name(base: str, kv: str, files: dict[str, Path], error: type[Exception]
                 ) -> str | None:
    found = [name for name in (f"{base}.{s.format(kv=kv)}" for s in SPELLINGS)
             if name in files]
    if len(found) > 1:
        raise error(f"{base} has two {kv.upper()} cache scales, {found[0]} and {found[1]}; "
                    "a checkpoint stores one")
    return found[0] if found else None


def _per_head(name: str, header: tuple[Path, tuple[int, ...], str], read: Callable,
              heads: int, error: type[Exception]) -> torch.Tensor:
    """One stored scale as float32 [heads], checked: a scalar or one per kv head, in a float
    dtype, finite and > 0."""
    shard, shape, dtype = header
    numel = math.prod(shape)
    per_head = numel == heads and sum(d != 1 for d in shape) <= 1
    if dtype not in LOADABLE_DTYPES or not (numel == 1 or per_head):
        raise error(f"{shard.name}: KV cache scale {name} is {dtype} {list(shape)}, expected "
                    f"{'/'.join(LOADABLE_DTYPES)} of one value ([] or [1]) or one per kv head "
                    f"([{heads}] or [{heads}, 1, 1])")
    scale = read(name).float().reshape(-1)
    bad = ~torch.isfinite(scale) | (scale <= 0)
    if bad.any():
        raise error(f"{shard.name}: KV cache scale {name} must be finite and > 0, got "
                    f"{scale[bad][0].item()}")
    return scale.expand(heads).clone()


def read_kv_scales(path: Path, raw: dict, cfg: ModelConfig, files: dict[str, Path],
                   error: type[Exception]) -> KVScales | None:
    """The K and V scales the checkpoint stores for its attention layers (None: none), each
    checked from the headers and then its values; a layer with only one of them, two
    spellings of one, or a malformed one is an `error` naming the tensor."""
    names: dict[int, tuple[str, str]] = {}
    for layer in cfg.full_attention_layers:
        base = f"{cfg.weight_prefix}layers.{layer}.self_attn"
        k, v = (_stored_name(base, kv, files, error) for kv in ("k", "v"))
        if (k is None) != (v is None):
            have, lacks = ("K", "V") if v is None else ("V", "K")
            spellings = ", ".join(s.format(kv=lacks.lower()) for s in SPELLINGS)
            raise error(f"{base} stores a {have} cache scale ({k or v}) but no {lacks} one "
                        f"(expected one of {spellings})")
        if k is not None:
            names[layer] = (k, v)
    if not names:
        return None
    reason = _not_fp8(path, raw)
    if reason is not None:
        log.warning("%s: %s, so its KV cache scales are not FP8 ones and go unread; an FP8 KV "
                    "cache calibrates its own", path, reason)
        return None
    wanted = {name for pair in names.values() for name in pair}
    headers = read_headers(wanted, files, error)
    with contextlib.ExitStack() as stack:
        handles: dict[Path, object] = {}

        def read(name: str) -> torch.Tensor:
            shard = headers[name][0]
            if shard not in handles:
                handles[shard] = stack.enter_context(open_shard(shard, error))
            return handles[shard].get_tensor(name)

        scales = {layer: [_per_head(n, headers[n], read, cfg.num_kv_heads, error)
                          for n in pair] for layer, pair in names.items()}
    return KVScales({layer: kv[0] for layer, kv in scales.items()},
                    {layer: kv[1] for layer, kv in scales.items()}, frozenset(wanted))


def kv_scales_label(scales: KVScales | None, attention_layers: int, kv_dtype: torch.dtype
                    ) -> str:
    """Where an engine's KV cache scales come from, for its load report."""
    have = 0 if scales is None else len(scales.layers)
    rest = attention_layers - have

    def layers(n: int) -> str:
        return f"{n} layer" if n == 1 else f"{n} layers"

    if kv_dtype != torch.uint8:
        kind = str(kv_dtype).split(".")[-1]
        if have:
            return f"KV scales: in the checkpoint ({layers(have)}), not needed (KV cache {kind})"
        return f"KV scales: none needed (KV cache {kind})"
    if not have:
        return "KV scales: calibrated on the first prompt"
    more = f", calibrated on the first prompt ({layers(rest)})" if rest else ""
    return f"KV scales: from the checkpoint ({layers(have)}){more}"
