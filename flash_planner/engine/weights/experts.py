"""Mixture-of-experts projections: the E experts' weights of one projection in one stack, so
a kernel indexes experts, and how a stack loads.

`ExpertLinear` is the full-precision stack (`weight` [E, N, K]); a quantized stack is the
layout's `QuantLinear` with every packed buffer [E, *shape] (`QuantLinear.stacked`). Both
compute `grouped(x, ids)`: y [M, k, N] = x[m, j or 0] @ W[ids[m, j]].T (kernels/moe_gemm).

On disk, one set of tensors per expert (`mlp.experts.{e}.gate_proj.weight`, ...: the
published checkpoints and transformers' `save_pretrained`), each in the layout the scheme
gives that module name (so every quantized format and quantize-at-load apply per expert),
or transformers' in-memory fused layout in full precision (`mlp.experts.gate_up_proj`
[E, 2I, H] with gate rows first, `mlp.experts.down_proj` [E, H, I]).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ...kernels.dispatch import moe_gemm
from .layout import FLOAT_DTYPES, Layout, TensorSpec
from .linear import QuantLinear
from .scheme import Scheme, WeightFormatError

# our projection -> (fused checkpoint tensor, which rows of it: 0 first half, 1 second, None all)
FUSED = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
         "down_proj": ("down_proj", None)}


class ExpertLinear(nn.Module):
    """E experts' [N, K] weights of one projection, in full precision."""

    gated = False        # each expert's gate rows then its up rows (fuse.py): silu(g) * u

    def __init__(self, num_experts: int, in_features: int, out_features: int):
        super().__init__()
        self.expert_count, self.in_features, self.out_features = (num_experts, in_features,
                                                             out_features)
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))

    def grouped(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return moe_gemm(x, ids, self.weight, self.gated)

    def extra_repr(self) -> str:
        return (f"experts={self.expert_count}, in_features={self.in_features}, "
                f"out_features={self.out_features}")


@dataclass(frozen=True)
class PlannedStack:
    """How one stack loads: per expert from `prefixes` in `layout` (None: full precision),
    or from the fused tensor `fused` (its `half` of the rows; None: all of them)."""

    layout: Layout | None
    prefixes: tuple[str, ...]       # the experts' module names in the checkpoint
    n: int
    k: int
    fused: str | None = None
    half: int | None = None

    def tensors(self) -> dict[str, TensorSpec]:
        """Checkpoint tensor name -> what it must be (headers only)."""
        if self.fused is not None:
            rows = self.n * (1 if self.half is None else 2)
            return {self.fused: TensorSpec((len(self.prefixes), rows, self.k), FLOAT_DTYPES)}
        specs = (self.layout.tensors(self.n, self.k) if self.layout is not None
                 else {"weight": TensorSpec((self.n, self.k), FLOAT_DTYPES)})
        return {f"{prefix}.{suffix}": spec for prefix in self.prefixes
                for suffix, spec in specs.items()}

    @property
    def label(self) -> str:
        return "full precision" if self.layout is None else self.layout.label


def plan_experts(module: nn.Module, names_of: Callable[[str], str], present: set[str],
                 scheme: Scheme, weights: str, error: type[Exception]
                 ) -> dict[str, PlannedStack]:
    """Swap each `ExpertLinear` whose experts load quantized for a stacked `QuantLinear`,
    on the meta device; our module name -> PlannedStack."""
    planned: dict[str, PlannedStack] = {}
    for name, mod in list(module.named_modules()):
        if not isinstance(mod, ExpertLinear):
            continue
        parent, proj = name.rsplit(".", 1)
        n, k, count = mod.out_features, mod.in_features, mod.expert_count
        prefixes = tuple(names_of(f"{parent}.{e}.{proj}.weight").removesuffix(".weight")
                         for e in range(count))
        fused, half = FUSED[proj]
        fused = names_of(f"{parent}.{fused}")
        if fused in present and f"{prefixes[0]}.weight" not in present:
            if scheme.quantized and weights == "auto":
                raise error(f"{fused}: fused expert tensors are loaded in full precision "
                            f"only, but the checkpoint is {scheme.label}")
            if weights not in ("auto", "bf16"):
                raise error(f"{fused}: fused expert tensors cannot be quantized at load "
                            f"(weights {weights!r}); use weights auto or bf16, or a "
                            "checkpoint with one tensor per expert")
            planned[name] = PlannedStack(None, prefixes, n, k, fused, half)
            continue
        try:
            layouts = [scheme.layout_for(prefix, n, k, weights) for prefix in prefixes]
        except WeightFormatError as exc:
            raise error(str(exc)) from exc
        labels = {None if lay is None else lay.label for lay in layouts}
        if len(labels) > 1:
            raise error(f"{parent}.*.{proj}: experts stored in different layouts "
                        f"({', '.join(sorted(map(str, labels)))}); one stack needs one")
        layout = layouts[0]
        if layout is not None:
            with torch.device("meta"):
                template = layout.module(n, k)
            if isinstance(template, QuantLinear):
                module.set_submodule(name, template.stacked(count))
        planned[name] = PlannedStack(layout, prefixes, n, k)
    return planned


def load_stack(stack: nn.Module, plan: PlannedStack, read: Callable[[str], torch.Tensor],
               present: set[str] | dict, error: type[Exception]) -> None:
    """Read every expert of `plan` into `stack` (built by `plan_experts`, allocated);
    `present`: the checkpoint's tensor names (optional tensors may be absent)."""
    device = next(iter(stack.state_dict().values())).device
    if plan.fused is not None:
        whole = read(plan.fused)                                        # [E, rows, K]
        rows = whole if plan.half is None else whole.chunk(2, dim=1)[plan.half]
        stack.weight.copy_(rows)
        return
    for e, prefix in enumerate(plan.prefixes):
        if plan.layout is None:
            stack.weight[e].copy_(read(f"{prefix}.weight"))
            continue
        converted = plan.layout.load(prefix, plan.n, plan.k, read, present, device, error)
        if isinstance(stack, QuantLinear):
            stack.set_packed(converted, expert=e)
        else:
            stack.weight[e].copy_(converted["weight"])
