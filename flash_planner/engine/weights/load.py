"""Load a module's weights from safetensors shards: plain, quantized, quantized at load.

The module is built on the meta device; every Linear gets its `Layout` from the scheme and
the `weights` setting and is swapped for the layout's module; every tensor is then checked
from the headers (name, shape, dtype) before any data is read, so a bad checkpoint fails
with one error naming the tensor and what was expected. Reading goes one module at a time,
so quantizing at load never holds a full-precision copy of more than one weight.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from .layout import Layout
from .linear import QuantLinear
from .scheme import Scheme, WeightFormatError

log = logging.getLogger(__name__)

LOADABLE_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
# Tensors that mark a module as stored quantized, whatever its format
QUANT_MARKERS = ("weight_scale_inv", "weight_scale", "weight_packed", "qweight")


@dataclass(frozen=True)
class Planned:
    layout: Layout
    prefix: str      # the module's name in the checkpoint
    n: int
    k: int


def open_shard(shard: Path, error: type[Exception]):
    try:
        return safe_open(str(shard), framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise error(f"{shard}: not a readable safetensors file ({exc})") from exc


def plan_linears(module: nn.Module, names_of: Callable[[str], str], scheme: Scheme,
                 weights: str, error: type[Exception]) -> dict[str, Planned]:
    """Swap each Linear that loads quantized (or dequantized) for its layout's module, on the
    meta device; our module name -> Planned."""
    planned: dict[str, Planned] = {}
    for name, mod in list(module.named_modules()):
        if not isinstance(mod, nn.Linear):
            continue
        prefix = names_of(f"{name}.weight").removesuffix(".weight")
        n, k = mod.out_features, mod.in_features
        try:
            layout = scheme.layout_for(prefix, n, k, weights)
        except WeightFormatError as exc:
            raise error(str(exc)) from exc
        if layout is None:
            continue
        with torch.device("meta"):
            module.set_submodule(name, layout.module(n, k))
        planned[name] = Planned(layout, prefix, n, k)
    return planned


def _check(headers: dict[str, tuple[Path, tuple[int, ...], str]], name: str,
           shape: tuple[int, ...], dtypes: tuple[str, ...], what: str,
           error: type[Exception]) -> None:
    shard, got_shape, got_dtype = headers[name]
    if got_shape != shape:
        raise error(f"{shard.name}: tensor {name} has shape {list(got_shape)}, expected "
                    f"{list(shape)} ({what})")
    if got_dtype not in dtypes:
        raise error(f"{shard.name}: tensor {name} has dtype {got_dtype}, expected "
                    f"{'/'.join(dtypes)} ({what})")


def read_headers(names: set[str], files: dict[str, Path], error: type[Exception]
                 ) -> dict[str, tuple[Path, tuple[int, ...], str]]:
    """name -> (shard, shape, safetensors dtype) for the names present in `files`."""
    by_shard: dict[Path, list[str]] = {}
    for name in names:
        if name in files:
            by_shard.setdefault(files[name], []).append(name)
    headers = {}
    for shard, shard_names in by_shard.items():
        with open_shard(shard, error) as f:
            for name in shard_names:
                sl = f.get_slice(name)
                headers[name] = (shard, tuple(sl.get_shape()), sl.get_dtype())
    return headers


def validate(module: nn.Module, plain: dict[str, str], planned: dict[str, Planned],
             files: dict[str, Path], scheme: Scheme, error: type[Exception]) -> None:
    """Every tensor the module needs exists with the right shape and dtype (headers only)."""
    wanted = set(plain.values())
    for p in planned.values():
        wanted.update(f"{p.prefix}.{s}" for s in p.layout.tensors(p.n, p.k))
    missing = [name for name in sorted(wanted) if name not in files and not any(
        name == f"{p.prefix}.{s}" and not spec.required for p in planned.values()
        for s, spec in p.layout.tensors(p.n, p.k).items())]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        owner = next((p for p in planned.values() if missing[0].startswith(p.prefix + ".")),
                     None)
        why = f"; {owner.prefix} is {owner.layout.label}" if owner else ""
        where = next(iter(files.values())).parent if files else "checkpoint"
        raise error(f"{where}: missing tensor(s) {', '.join(missing[:3])}{more}{why}")
    markers = {f"{theirs.removesuffix('.weight')}.{m}": theirs for theirs in plain.values()
               if theirs.endswith(".weight") for m in QUANT_MARKERS}
    headers = read_headers(wanted | set(markers), files, error)
    for marker, theirs in markers.items():
        if marker in headers:
            raise error(f"{theirs.removesuffix('.weight')} is stored quantized (it has "
                        f"{marker}) but the quantization config ({scheme.label}) leaves it in "
                        "full precision: check modules_to_not_convert / ignore")
    expected = {name: tuple(t.shape) for name, t in module.state_dict().items()}
    for ours, theirs in plain.items():
        _check(headers, theirs, expected[ours], tuple(LOADABLE_DTYPES),
               "full precision" if scheme.quantized else "full precision; "
               "quantized checkpoints need a quantization_config", error)
    for p in planned.values():
        for suffix, spec in p.layout.tensors(p.n, p.k).items():
            name = f"{p.prefix}.{suffix}"
            if name in headers:
                _check(headers, name, spec.shape, spec.dtypes, p.layout.label, error)


def load_module(module: nn.Module, names_of: Callable[[str], str], files: dict[str, Path],
                dtype: torch.dtype, device: str | torch.device, scheme: Scheme, weights: str,
                error: type[Exception]) -> tuple[nn.Module, dict[str, str], Counter]:
    """Fill `module` (built on the meta device) from `files`; returns it, the plain tensor
    names (ours -> theirs) and a count of modules per layout label."""
    planned = plan_linears(module, names_of, scheme, weights, error)
    quant_prefixes = tuple(f"{name}." for name in planned)
    plain = {ours: names_of(ours) for ours in module.state_dict()
             if not ours.startswith(quant_prefixes)}
    validate(module, plain, planned, files, scheme, error)
    module = module.to_empty(device=device)
    for param in module.parameters():
        param.data = param.data.to(dtype)
    params = dict(module.state_dict())
    with contextlib.ExitStack() as stack, torch.no_grad():
        handles: dict[Path, object] = {}

        def read(name: str) -> torch.Tensor:
            shard = files[name]
            if shard not in handles:
                handles[shard] = stack.enter_context(open_shard(shard, error))
            return handles[shard].get_tensor(name)

        for ours, theirs in plain.items():
            params[ours].copy_(read(theirs))
        for name, p in planned.items():
            specs = p.layout.tensors(p.n, p.k)
            tensors = {s: read(f"{p.prefix}.{s}").to(device) for s in specs
                       if f"{p.prefix}.{s}" in files}
            why = p.layout.check(tensors, p.n, p.k)
            if why:
                raise error(f"{p.prefix} ({p.layout.label}): {why}")
            target = module.get_submodule(name)
            converted = p.layout.convert(tensors, p.n, p.k)
            if isinstance(target, QuantLinear):
                target.set_packed(converted)
            else:
                target.weight.copy_(converted["weight"])
            del tensors, converted
    counts = Counter(p.layout.label for p in planned.values())
    if counts:
        log.info("quantized Linears: %s", ", ".join(f"{n} {label}" for label, n in
                                                     sorted(counts.items())))
    return module.eval(), plain, counts
