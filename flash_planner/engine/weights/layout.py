"""How one Linear's weight is stored in a checkpoint, and how it becomes the engine's module.

A `Layout` names the tensors one module has on disk (suffix -> shape and safetensors dtypes,
checked from the headers before any data is read) and turns them, once read, into the
engine's module: a `QuantLinear` of its family, or a plain `nn.Linear`. The checkpoint's own
formats (fp8.py, nvfp4.py, int4.py), quantize-at-load (`Quantize`: a float weight on disk
becomes a packed module) and dequantize-at-load (`Dequantize`) are all layouts, so the loader
has one path for all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .linear import QuantLinear

FLOAT_DTYPES = ("F32", "BF16", "F16")
# A one-value scale is written 0-dim by ModelOpt and [1] by compressed-tensors, in float32 or
# in the model's own dtype (compressed-tensors gives a bf16 model bf16 scales): any of these
SCALAR_SHAPES = ((), (1,))
SCALAR_DTYPES = (*FLOAT_DTYPES, "F64")


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtypes: tuple[str, ...]
    required: bool = True
    scalar: bool = False     # one value, either of SCALAR_SHAPES (`shape` is then unused)

    def fits(self, shape: tuple[int, ...]) -> bool:
        return shape in SCALAR_SHAPES if self.scalar else tuple(shape) == self.shape

    def expected_shape(self) -> str:
        if self.scalar:
            return " or ".join(str(list(shape)) for shape in SCALAR_SHAPES)
        return str(list(self.shape))


def scalar(required: bool = True) -> TensorSpec:
    """A per-tensor scale: one value of any float dtype, 0-dim or [1]."""
    return TensorSpec((), SCALAR_DTYPES, required, scalar=True)


class Layout:
    family = ""   # the engine module's family: "fp8" | "nvfp4" | "int4" | "" (plain Linear)
    label = ""    # the checkpoint format, for messages and reports

    def tensors(self, n: int, k: int) -> dict[str, TensorSpec]:
        """Tensor suffix (after the module name and a dot) -> what it must be."""
        raise NotImplementedError

    def module(self, n: int, k: int) -> nn.Module:
        """The engine's module for an [n, k] weight (built on the meta device)."""
        raise NotImplementedError

    def convert(self, tensors: dict[str, torch.Tensor], n: int, k: int
                ) -> dict[str, torch.Tensor]:
        """The read tensors -> the module's tensors (buffer or parameter name -> value)."""
        raise NotImplementedError

    def check(self, tensors: dict[str, torch.Tensor], n: int, k: int) -> str | None:
        """A data check after reading (e.g. GPTQ's g_idx); why it cannot load, or None."""
        return None

    def load(self, prefix: str, n: int, k: int, read, present, device: torch.device,
             error: type[Exception]) -> dict[str, torch.Tensor]:
        """Read module `prefix`'s tensors (`read(name)`; optional ones absent from `present`
        are skipped), check them and convert them to the module's tensors."""
        tensors = {s: read(f"{prefix}.{s}").to(device) for s in self.tensors(n, k)
                   if f"{prefix}.{s}" in present}
        why = self.check(tensors, n, k)
        if why:
            raise error(f"{prefix} ({self.label}): {why}")
        return self.convert(tensors, n, k)


class Quantize(Layout):
    """A float weight on disk, quantized while it loads by `quantize(w) -> packed tensors`."""

    def __init__(self, family: str, make, quantize, label: str):
        self.family, self.label = family, label
        self._make, self._quantize = make, quantize

    def tensors(self, n, k):
        return {"weight": TensorSpec((n, k), FLOAT_DTYPES)}

    def module(self, n, k):
        return self._make(k, n)

    def convert(self, tensors, n, k):
        return self._quantize(tensors["weight"])


class Dequantize(Layout):
    """A quantized weight on disk, loaded as a plain Linear (`weights: bf16`)."""

    def __init__(self, stored: Layout):
        self.stored = stored
        self.label = f"{stored.label} dequantized"

    def tensors(self, n, k):
        return self.stored.tensors(n, k)

    def module(self, n, k):
        return nn.Linear(k, n, bias=False)

    def convert(self, tensors, n, k):
        with torch.device("meta"):
            packed = self.stored.module(n, k)
        assert isinstance(packed, QuantLinear)
        packed = packed.to_empty(device=tensors[next(iter(tensors))].device)
        packed.set_packed(self.stored.convert(tensors, n, k))
        return {"weight": packed.dequantized()}

    def check(self, tensors, n, k):
        return self.stored.check(tensors, n, k)
