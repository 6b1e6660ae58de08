"""What each Triton kernel is launched with, declared beside its launcher.

A `Spec` is one specialization: the argument types as Triton signature strings, the
constexpr values, `num_warps` and `num_stages`. Every kernel module lists its specs at the
model shapes we ship (Qwen3.6-27B on Thor, the demo) in `SPECS`, built with the same `meta`
function its launcher uses, and launchers go through `launch`, so the compile check
(`report.py`, test/kernels/test_compile.py) and the launches cannot drift apart:
test/kernels/test_specs.py records the engine's real launches and finds each among the
declared specs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

TORCH_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
               torch.uint8: "u8", torch.int8: "i8", torch.int32: "i32", torch.int64: "i64",
               torch.bool: "i1"}


@dataclass(frozen=True)
class Spec:
    """One specialization of a kernel, as it is launched."""

    kernel: Any                       # the @triton.jit function
    label: str                        # what makes it distinct, e.g. "27B bf16, steps"
    types: dict[str, str]             # runtime argument -> "*bf16", "i32", "fp32", ...
    constexprs: dict[str, Any]
    num_warps: int = 4
    num_stages: int = 3
    per_cycle: bool = True            # runs in every speculative cycle: must not spill
    shape_constexprs: tuple[str, ...] = ()  # derived from model shapes (differ per model)
    aligned: tuple[str, ...] = ()     # arguments divisible by 16 at the declared shapes, as
                                      # Triton specializes a launch (the report compiles so)

    @classmethod
    def from_meta(cls, kernel: Any, label: str, types: dict[str, str], meta: dict[str, Any],
                  **kw: Any) -> Spec:
        """The spec of a launch with `meta`, the dict a launcher passes to `launch`."""
        constexprs = dict(meta)
        warps, stages = constexprs.pop("num_warps"), constexprs.pop("num_stages")
        return cls(kernel, label, types, constexprs, warps, stages, **kw)

    @property
    def name(self) -> str:
        return kernel_name(self.kernel)

    def signature(self) -> dict[str, str]:
        """The full Triton signature: runtime types, then "constexpr" for the constexprs."""
        return {**self.types, **dict.fromkeys(self.constexprs, "constexpr")}

    def admits(self, launched: Spec) -> bool:
        """Whether a recorded launch is this specialization (shape-derived constexprs may
        differ: a tiny test model has other head sizes than the declared shapes)."""
        fixed = [k for k in self.constexprs if k not in self.shape_constexprs]
        return (self.name == launched.name and self.types == launched.types
                and set(self.constexprs) == set(launched.constexprs)
                and all(self.constexprs[k] == launched.constexprs[k] for k in fixed)
                and (self.num_warps, self.num_stages)
                == (launched.num_warps, launched.num_stages))


def aligned(types: dict[str, str], values: dict[str, int]) -> tuple[str, ...]:
    """A spec's `aligned`: its pointers, and its integers divisible by 16 at the declared
    shape (`values`; M aside: it varies), as Triton specializes a launch."""
    return tuple(name for name, kind in types.items() if kind.startswith("*")
                 or (name != "M" and values.get(name, 1) % 16 == 0))


def kernel_name(kernel: Any) -> str:
    fn = getattr(kernel, "fn", kernel)
    return fn.__name__


def arg_type(value: Any) -> str:
    """The Triton signature type of one runtime argument."""
    if isinstance(value, torch.Tensor):
        return "*" + TORCH_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


_recorders: list[list[Spec]] = []


@contextlib.contextmanager
def record_launches() -> Iterator[list[Spec]]:
    """Collect a `Spec` for every kernel launch made through `launch` inside the block."""
    launches: list[Spec] = []
    _recorders.append(launches)
    try:
        yield launches
    finally:
        _recorders.remove(launches)


def launch(kernel: Any, grid: tuple, args: dict[str, Any], meta: dict[str, Any]) -> None:
    """`kernel[grid](**args, **meta)`; `meta` holds the constexprs, num_warps, num_stages."""
    if _recorders:
        spec = Spec.from_meta(kernel, "launched", {k: arg_type(v) for k, v in args.items()},
                              meta)
        for launches in _recorders:
            launches.append(spec)
    kernel[grid](**args, **meta)
