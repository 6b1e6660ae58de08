"""The weight formats of the GEMM family, one row each: what every launcher, reference, spec,
the tuner and the checks read.

A format names its tensors (in the launchers' order after x, and after topk_ids for experts;
its integer parameters follow them), its weight bits, the K step of the tiled kernel, and:
  layout(n, k, params, gated)   each tensor's dtype (None: x's) and shape for one weight of
                                n rows (experts prepend E); a nvfp4 global scale holds one
                                value per stacked half
  ints(tensors, params, half)   the kernels' three integer slots i0, i1, i2
  k_align(params)               the K extent a block scale or group covers
  validate(op, ...)             what a shape cannot say (K tiles, gated halves)
The kernels take every format through the same slots (w, s, z; i0, i1, i2): a format with
fewer tensors passes its weight in the free ones, and the Triton specializations see FORMAT
as a constexpr, so each compiles only its own branch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

NVFP4_GROUP = 16
# The tiled kernel's K step in values (nvfp4's on 2-D weights: 64), which block_k and group
# must be multiples of; the skinny kernel's comes from configs.step_k.
TILED_K = 32


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Format:
    name: str
    bits: int
    tensors: tuple[str, ...]
    layout: Callable[..., tuple[tuple[torch.dtype | None, tuple[int, ...]], ...]]
    ints: Callable[..., tuple[int, int, int]]
    k_align: Callable[[tuple], int]
    tiled_k: int = TILED_K            # tiled kernel's K step on 2-D weights
    routed_k: int = TILED_K           # and on experts
    flat_last: bool = False           # the last tensor read flat (nvfp4's global scale)

    def slots(self, tensors: tuple) -> tuple:
        """(w, s, z): the tensors, the weight repeated into the slots a format leaves free;
        nvfp4's global scale flat, whatever shape holds its values."""
        if self.flat_last:
            tensors = (*tensors[:-1], tensors[-1].reshape(-1))
        return (*tensors, *(tensors[0],) * (3 - len(tensors)))

    def validate(self, op: str, k: int, n: int, params: tuple, gated: bool,
                 kernel: bool) -> None:
        """ValueError naming what is wrong beyond the tensors' dtypes and shapes; `kernel`:
        the Triton kernels' own needs too (K tiles)."""
        if self.name == "fp8":
            block_n, block_k = params
            if block_n < 1 or block_k < 1:
                raise ValueError(f"{op}: block_n and block_k must be >= 1, got "
                                 f"({block_n}, {block_k})")
            if kernel and block_k % TILED_K:
                raise ValueError(f"{op}: block_k must be a multiple of {TILED_K} (the "
                                 f"kernel's K tile), got {block_k}")
        elif self.name == "int4" and (params[0] < 1 or (kernel and params[0] % TILED_K)):
            need = f"a multiple of {TILED_K} (the kernel's K tile)" if kernel else ">= 1"
            raise ValueError(f"{op}: group must be {need}, got {params[0]}")
        elif self.name == "nvfp4" and k % NVFP4_GROUP:
            raise ValueError(f"{op}: K (x's last dim) must be a multiple of {NVFP4_GROUP}, "
                             f"got {k}")
        block_n = params[0] if self.name == "fp8" else 1
        if gated and (n % 2 or (n // 2) % block_n):
            raise ValueError(f"{op}: a gated weight holds gate rows, then as many up rows (I "
                             f"a multiple of block_n {block_n}), got {n} rows")


def _fp8_layout(n, k, params, gated):
    block_n, block_k = params
    return ((torch.uint8, (n, k)), (torch.float32, (cdiv(n, block_n), cdiv(k, block_k))))


def _nvfp4_layout(n, k, params, gated):
    return ((torch.uint8, (n, k // 2)), (torch.uint8, (n, k // NVFP4_GROUP)),
            (torch.float32, (2,) if gated else ()))


def _int4_layout(n, k, params, gated):
    groups = cdiv(k, params[0])
    return ((torch.uint8, (n, cdiv(k, 2))), (torch.float32, (n, groups)),
            (torch.uint8, (n, groups)))


FORMATS = {
    # float experts (bf16, fp16, or the fp32 demo's), x's dtype
    "float": Format("float", 16, ("weight",), lambda n, k, params, gated: ((None, (n, k)),),
                    lambda tensors, params, half: (0, 0, 0), lambda params: 16),
    # e4m3 bits, one float32 scale per (block_n x block_k): i0 block_n, i1 block_k, i2 the
    # scale's columns
    "fp8": Format("fp8", 8, ("weight", "scale"), _fp8_layout,
                  lambda tensors, params, half: (*params, tensors[1].shape[-1]),
                  lambda params: params[1]),
    # E2M1 nibbles, an e4m3 scale per 16, an fp32 scale per stacked half: i0 and i1 the
    # row strides of packed and scale, i2 the first row of the second half (N when none)
    "nvfp4": Format("nvfp4", 4, ("packed", "scale", "global_scale"), _nvfp4_layout,
                    lambda tensors, params, half: (tensors[0].shape[-1], tensors[1].shape[-1],
                                                   half),
                    lambda params: NVFP4_GROUP, tiled_k=64, flat_last=True),
    # nibbles with a float32 scale and a uint8 zero point per group: i0 packed's row stride,
    # i1 the group, i2 the groups per row
    "int4": Format("int4", 4, ("packed", "scale", "zero"), _int4_layout,
                   lambda tensors, params, half: (tensors[0].shape[-1], params[0],
                                                  tensors[1].shape[-1]),
                   lambda params: params[0]),
}

# Triton pointer types of the slots (None: x's), as the kernels are declared and launched
SLOT_TYPES = {"float": (None, None, None), "fp8": ("*u8", "*fp32", "*u8"),
              "nvfp4": ("*u8", "*u8", "*fp32"), "int4": ("*u8", "*fp32", "*u8")}
# integer slot values at a declared shape (n weight rows, K), for the specs
DECLARED_INTS = {"float": lambda n, k: (0, 0, 0),
                 "fp8": lambda n, k: (128, 128, cdiv(k, 128)),
                 "nvfp4": lambda n, k: (k // 2, k // NVFP4_GROUP, n),
                 "int4": lambda n, k: (cdiv(k, 2), 128, cdiv(k, 128))}
DECLARED_ALIGN = {"float": 16, "fp8": 128, "nvfp4": NVFP4_GROUP, "int4": 128}
