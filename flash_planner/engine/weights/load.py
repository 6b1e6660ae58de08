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

from .experts import PlannedStack, load_stack, plan_experts
from .fuse import fuse_gate_up
from .layout import Dequantize, Layout, TensorSpec
from .linear import QuantLinear
from .scheme import Scheme, WeightFormatError
from .shard import problem as shard_problem

log = logging.getLogger(__name__)

LOADABLE_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
# Tensors that mark a module as stored quantized, whatever its format
QUANT_MARKERS = ("weight_scale_inv", "weight_scale", "weight_packed", "qweight")


def stored_quantized(prefix: str, present: frozenset[str] | set[str] | dict) -> bool:
    """Whether the checkpoint (its tensor names `present`) stores module `prefix` quantized."""
    return any(f"{prefix}.{m}" in present for m in QUANT_MARKERS)


@dataclass(frozen=True)
class Planned:
    layout: Layout
    prefix: str      # the module's name in the checkpoint
    n: int
    k: int


def open_shard(shard: Path, error: type[Exception]):
    """The file opened by safetensors, which checks its header against its size; a file it
    refuses raises `error` naming the file and, from the header, what is wrong with it."""
    try:
        return safe_open(str(shard), framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        why = shard_problem(shard) or f"not a readable safetensors file ({exc})"
        raise error(f"{shard}: {why}") from exc


def plan_linears(module: nn.Module, names_of: Callable[[str], str], scheme: Scheme,
                 weights: str, error: type[Exception],
                 present: frozenset[str] | set[str] = frozenset()) -> dict[str, Planned]:
    """Swap each Linear that loads quantized (or dequantized) for its layout's module, on the
    meta device; our module name -> Planned. A module the engine keeps in full precision
    that is not a Linear (the shared expert's [1, H] gate) and that the checkpoint stores
    quantized anyway (a recipe quantizing every Linear without excluding it) is dequantized
    at load, in place (`present`: the checkpoint's tensor names)."""
    planned: dict[str, Planned] = {}
    for name, mod in list(module.named_modules()):
        if not isinstance(mod, nn.Linear):
            plain = _stored_quantized(mod, name, names_of, scheme, present)
            if plain is not None:
                planned[name] = plain
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
            swapped = layout.module(n, k)
            if mod.bias is not None:      # read with the plain tensors (load_module)
                swapped.bias = nn.Parameter(torch.empty(n))
            module.set_submodule(name, swapped)
        planned[name] = Planned(layout, prefix, n, k)
    return planned


def _stored_quantized(mod: nn.Module, name: str, names_of: Callable[[str], str],
                      scheme: Scheme, present: frozenset[str] | set[str]
                      ) -> Planned | None:
    """How a plain-by-design module with a 2-D weight loads when the checkpoint stores it
    quantized in a format the scheme names (None: it loads plain, or validate refuses it)."""
    weight = mod._parameters.get("weight") if name else None
    if weight is None or weight.dim() != 2:
        return None
    prefix = names_of(f"{name}.weight").removesuffix(".weight")
    stored = scheme.rule(prefix) if scheme.quantized else None
    if stored is None or not stored_quantized(prefix, present):
        return None
    n, k = weight.shape
    return Planned(Dequantize(stored), prefix, n, k)


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
             stacks: dict[str, PlannedStack], files: dict[str, Path], scheme: Scheme,
             error: type[Exception]) -> None:
    """Every tensor the module needs exists with the right shape and dtype (headers only)."""
    shapes = {name: tuple(t.shape) for name, t in module.state_dict().items()}
    plain_what = ("full precision" if scheme.quantized else
                  "full precision; quantized checkpoints need a quantization_config")
    # checkpoint name -> (spec, what it is for, why it is wanted: which module has which layout)
    wanted: dict[str, tuple[TensorSpec, str, str]] = {
        theirs: (TensorSpec(shapes[ours], tuple(LOADABLE_DTYPES)), plain_what, "")
        for ours, theirs in plain.items()}
    for p in planned.values():
        wanted.update({f"{p.prefix}.{suffix}": (spec, p.layout.label,
                                                f"; {p.prefix} is {p.layout.label}")
                       for suffix, spec in p.layout.tensors(p.n, p.k).items()})
    for stack in stacks.values():
        wanted.update({name: (spec, f"expert, {stack.label}",
                              f"; the experts are {stack.label}")
                       for name, spec in stack.tensors().items()})
    missing = sorted(name for name, (spec, _, _) in wanted.items()
                     if spec.required and name not in files)
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        why = wanted[missing[0]][2]
        where = next(iter(files.values())).parent if files else "checkpoint"
        raise error(f"{where}: missing tensor(s) {', '.join(missing[:3])}{more}{why}")
    full = [*(t for t in plain.values() if t.endswith(".weight")),
            *(f"{prefix}.weight" for s in stacks.values() if s.layout is None and not s.fused
              for prefix in s.prefixes)]
    markers = {f"{theirs.removesuffix('.weight')}.{m}": theirs for theirs in full
               for m in QUANT_MARKERS}
    headers = read_headers(set(wanted) | set(markers), files, error)
    for marker, theirs in markers.items():
        if marker in headers:
            raise error(f"{theirs.removesuffix('.weight')} is stored quantized (it has "
                        f"{marker}) but the quantization config ({scheme.label}) leaves it in "
                        "full precision: check modules_to_not_convert / ignore")
    for name, (spec, what, _) in wanted.items():
        if name not in headers:
            continue    # an optional tensor the checkpoint does not have
        shard, shape, dtype = headers[name]
        if not spec.fits(shape):
            raise error(f"{shard.name}: tensor {name} has shape {list(shape)}, expected "
                        f"{spec.expected_shape()} ({what})")
        if dtype not in spec.dtypes:
            raise error(f"{shard.name}: tensor {name} has dtype {dtype}, expected "
                        f"{'/'.join(spec.dtypes)} ({what})")


def load_module(module: nn.Module, names_of: Callable[[str], str], files: dict[str, Path],
                dtype: torch.dtype, device: str | torch.device, scheme: Scheme, weights: str,
                error: type[Exception]) -> tuple[nn.Module, set[str], Counter]:
    """Fill `module` (built on the meta device) from `files`; returns it, the names of the
    checkpoint tensors it read and a count of modules per layout label."""
    planned = plan_linears(module, names_of, scheme, weights, error, set(files))
    stacks = plan_experts(module, names_of, set(files), scheme, weights, error)
    own_loader = tuple(f"{name}." for name in (*planned, *stacks))
    biases = {f"{name}.bias" for name in planned}     # a swapped Linear's bias stays plain
    plain = {ours: names_of(ours) for ours in module.state_dict()
             if not ours.startswith(own_loader) or ours in biases}
    validate(module, plain, planned, stacks, files, scheme, error)
    module = module.to_empty(device=device)
    for param in module.parameters():
        param.data = param.data.to(dtype)
    params = dict(module.state_dict())
    used: set[str] = set()
    with contextlib.ExitStack() as open_shards, torch.no_grad():
        handles: dict[Path, object] = {}

        def read(name: str) -> torch.Tensor:
            used.add(name)
            shard = files[name]
            if shard not in handles:
                handles[shard] = open_shards.enter_context(open_shard(shard, error))
            return handles[shard].get_tensor(name)

        for ours, theirs in plain.items():
            params[ours].copy_(read(theirs))
        for name, p in planned.items():
            target = module.get_submodule(name)
            converted = p.layout.load(p.prefix, p.n, p.k, read, files, device, error)
            if isinstance(target, QuantLinear):
                target.set_packed(converted)
            else:
                target.weight.copy_(converted["weight"])
            del converted
        for name, stack in stacks.items():
            load_stack(module.get_submodule(name), stack, read, files, error)
    counts = Counter(p.layout.label for p in planned.values())
    for stack in stacks.values():     # an expert counts as one Linear
        if stack.layout is not None:
            counts[stack.layout.label] += len(stack.prefixes)
    if counts:
        log.info("quantized Linears: %s", ", ".join(f"{n} {label}" for label, n in
                                                     sorted(counts.items())))
    fused = fuse_gate_up(module)
    if fused:
        log.info("MLP gate and up projections fused (one GEMM with SwiGLU): %d", fused)
    return module.eval(), used, counts
