"""The quantized Linear the loader swaps in for `nn.Linear`: weight-only, y = x @ W.T.

Each format family (fp8.py, nvfp4.py, int4.py) subclasses `QuantLinear` with its packed
buffers in the engine's layout (the one its kernel in kernels/<family>_gemm reads) and its
GEMM. Buffers, not parameters: nothing here trains, and `module.to(dtype)` in the loader
must leave packed bytes and float32 scales alone.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn


class QuantLinear(nn.Module):
    """Weight-only quantized Linear. No Linear of the language models has a bias; the vision
    tower's do, and `load.plan_linears` gives its swapped modules one."""

    family = ""          # "fp8" | "nvfp4" | "int4"
    expert_count = 0     # > 0: a stack of this many experts' weights (experts.py)
    gated = False        # an MLP's gate and up projections stacked (fuse.py): silu(g) * u
    # row bucket (1, 2, 4, 8, 16) -> the vendor GEMM measured faster than ours for this
    # weight there (tuning.route_vendors); None: ours everywhere
    vendor_routes: dict[int, Callable[[torch.Tensor], torch.Tensor]] | None = None

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.register_parameter("bias", None)

    def packed_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Buffer name -> (shape, dtype) in the engine's layout."""
        raise NotImplementedError

    def operands(self) -> tuple:
        """The GEMM's arguments after x (kernels/dispatch: `<family>_gemm(x, *operands)`)."""
        raise NotImplementedError

    def gemm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def gate_up(self, x: torch.Tensor) -> torch.Tensor:
        """A gated module's fused GEMM: silu(x @ gate.T) * (x @ up.T) (kernels/gemm)."""
        raise NotImplementedError

    def stacks_with(self, other: QuantLinear) -> bool:
        """Whether this weight and `other`, stacked row-wise (per expert, for two stacks of
        as many experts), form one weight of this layout (the same family, shape and format
        parameters; no scale block across the seam)."""
        return (type(other) is type(self) and other.expert_count == self.expert_count
                and not (self.gated or other.gated)
                and (other.in_features, other.out_features)
                == (self.in_features, self.out_features))

    def grouped(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """A stack's grouped GEMM: y [M, k, N] = x[m, j or 0] @ W[ids[m, j]].T for x
        [M, 1 or k, K] and ids [M, k] (kernels/moe_gemm)."""
        raise NotImplementedError

    def stacked(self, experts: int) -> QuantLinear:
        """An empty stack of `experts` weights in this layout (meta device): every packed
        buffer gains a leading expert dimension."""
        with torch.device("meta"):
            stack = copy.deepcopy(self)
            stack.expert_count = experts
            for name, (shape, dtype) in self.packed_specs().items():
                stack.register_buffer(name, torch.empty((experts, *shape), dtype=dtype))
        return stack

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [N, K] (ONNX export, `weights: bf16` of a quantized checkpoint)."""
        raise NotImplementedError

    def _register(self) -> None:
        for name, (shape, dtype) in self.packed_specs().items():
            self.register_buffer(name, torch.empty(shape, dtype=dtype))

    def set_packed(self, tensors: dict[str, torch.Tensor], expert: int | None = None) -> None:
        """Copy the engine-layout tensors in (one expert's, in a stack), checking them
        against `packed_specs()`."""
        for name, (shape, dtype) in self.packed_specs().items():
            t = tensors[name]
            if tuple(t.shape) != shape:
                raise ValueError(f"{self.family} {name}: shape {list(t.shape)}, expected "
                                 f"{list(shape)}")
            buf = getattr(self, name)
            (buf if expert is None else buf[expert]).copy_(t.to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        route = self._route(x)
        if route is not None:
            y = route(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], -1)
        else:
            y = self.gate_up(x) if self.gated else self.gemm(x)
        return y if self.bias is None else y + self.bias

    def _route(self, x: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
        if not self.vendor_routes:
            return None
        rows = x.numel() // self.in_features
        return (self.vendor_routes.get(1 << (rows - 1).bit_length())
                if 1 <= rows <= max(self.vendor_routes) else None)

    def extra_repr(self) -> str:
        stack = f", experts={self.expert_count}" if self.expert_count else ""
        gated = ", gate and up stacked: silu(gate) * up" if self.gated else ""
        return (f"{self.family}, in_features={self.in_features}, "
                f"out_features={self.out_features}{stack}{gated}")
