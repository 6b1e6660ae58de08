"""NVFP4 weights (W4A16): E2M1 values, an e4m3 scale per 16 along K, one fp32 scale.

ModelOpt writes `weight` (uint8, packed) + `weight_scale` + `weight_scale_2` (a multiplier);
compressed-tensors' nvfp4-pack-quantized writes `weight_packed` + `weight_scale` +
`weight_global_scale` (a divisor: the reciprocal of ModelOpt's). Both pack element 2j in the
low nibble, which is the engine's layout too, so loading only copies bytes and inverts the
compressed-tensors global scale. Activation scales are read (headers checked) but unused:
compute is weight-only. Facts: FACTS.md section 11.
"""

from __future__ import annotations

import torch

from ...kernels.dispatch import dequantize_nvfp4, moe_nvfp4_gemm, nvfp4_gate_up, nvfp4_gemm
from .fp8 import FP8, FP8_MAX, e4m3_bits
from .layout import Layout, Quantize, TensorSpec, scalar
from .linear import QuantLinear
from .packing import pack_nibbles

GROUP = 16
E2M1_MAX = 6.0
# midpoints between the non-negative E2M1 values 0, .5, 1, 1.5, 2, 3, 4, 6
_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


class Nvfp4Linear(QuantLinear):
    family = "nvfp4"

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features)
        self._register()

    def packed_specs(self):
        n, k = self.out_features, self.in_features
        return {"packed": ((n, k // 2), torch.uint8), "scale": ((n, k // GROUP), torch.uint8),
                "global_scale": ((1,), torch.float32)}

    def operands(self):
        return self.packed, self.scale, self.global_scale

    def gemm(self, x):
        return nvfp4_gemm(x, *self.operands())

    def gate_up(self, x):
        return nvfp4_gate_up(x, *self.operands())

    def grouped(self, x, ids):
        gs = self.global_scale.view(self.expert_count, 2) if self.gated else \
            self.global_scale.view(-1)
        return moe_nvfp4_gemm(x, ids, self.packed, self.scale, gs, self.gated)

    def dequantized(self):
        return dequantize_nvfp4(self.packed, self.scale, self.global_scale)


def fits(k: int) -> bool:
    return k % GROUP == 0


def quantize_nvfp4(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Data-free NVFP4 (ModelOpt's weight recipe): global = amax(W) / (6 * 448); a group's
    scale = e4m3(amax(group) / 6 / global); values rounded to the nearest E2M1."""
    n, k = w.shape
    wf = w.float()
    amax = wf.abs().amax()
    global_scale = torch.where(amax > 0, amax / (E2M1_MAX * FP8_MAX), torch.ones_like(amax))
    groups = wf.view(n, k // GROUP, GROUP)
    bits = e4m3_bits(groups.abs().amax(-1) / E2M1_MAX / global_scale)
    step = bits.view(torch.float8_e4m3fn).float() * global_scale            # [n, k / 16]
    scaled = groups / torch.where(step > 0, step, torch.ones_like(step))[..., None]
    bounds = torch.tensor(_BOUNDS, device=w.device)
    code = torch.bucketize(scaled.abs(), bounds).to(torch.uint8)           # 0..7
    code = (code | torch.where(scaled < 0, 8, 0).to(torch.uint8)).view(n, k)
    return {"packed": pack_nibbles(code), "scale": bits,
            "global_scale": global_scale.reshape(1)}


class Nvfp4Packed(Layout):
    family = "nvfp4"

    def __init__(self, label: str, packed_name: str, global_name: str, divisor: bool,
                 optional: tuple[str, ...]):
        self.label, self.packed_name = label, packed_name
        self.global_name, self.divisor = global_name, divisor
        self.optional = optional

    def tensors(self, n, k):
        # the global scale is one value however it is stored (0-dim for ModelOpt, [1] for
        # compressed-tensors); activation scales are unused by weight-only compute
        specs = {self.packed_name: TensorSpec((n, k // 2), ("U8",)),
                 "weight_scale": TensorSpec((n, k // GROUP), FP8),
                 self.global_name: scalar()}
        specs.update({name: scalar(required=False) for name in self.optional})
        return specs

    def module(self, n, k):
        return Nvfp4Linear(k, n)

    def convert(self, tensors, n, k):
        g = tensors[self.global_name].float().reshape(1)
        return {"packed": tensors[self.packed_name], "scale": tensors["weight_scale"].view(
            torch.uint8), "global_scale": 1.0 / g if self.divisor else g}


def modelopt_nvfp4() -> Layout:
    return Nvfp4Packed("nvfp4 (ModelOpt)", "weight", "weight_scale_2", False, ("input_scale",))


def ct_nvfp4() -> Layout:
    return Nvfp4Packed("nvfp4 (compressed-tensors)", "weight_packed", "weight_global_scale", True,
                       ("input_global_scale",))


def quantize_at_load() -> Layout:
    return Quantize("nvfp4", Nvfp4Linear, quantize_nvfp4, "nvfp4 group 16 (quantized at load)")
