"""FP8 e4m3 weights with block scales (W8A16): Qwen's official FP8, compressed-tensors'
float-quantized (block, channel or tensor scales) and ModelOpt's per-tensor FP8.

Every flavour is a multiplier scale over a grid of blocks, so the engine keeps one layout:
`weight` uint8 [N, K] (e4m3 bits) and `scale` float32 [ceil(N / bn), ceil(K / bk)] with
(bn, bk) = (128, 128) for block scales and (1, 128) for per-channel ones; a per-tensor scale
is spread over the (128, 128) grid. Facts: FACTS.md section 11.
"""

from __future__ import annotations

import torch

from ...kernels.dispatch import dequantize_fp8, fp8_gate_up, fp8_gemm, moe_fp8_gemm
from .layout import FLOAT_DTYPES, Layout, Quantize, TensorSpec, scalar
from .linear import QuantLinear
from .packing import cdiv as _cdiv

FP8_MAX = 448.0
BLOCK = 128
FP8 = ("F8_E4M3",)


class Fp8Linear(QuantLinear):
    family = "fp8"

    def __init__(self, in_features: int, out_features: int, block_n: int = BLOCK,
                 block_k: int = BLOCK):
        super().__init__(in_features, out_features)
        self.block_n, self.block_k = block_n, block_k
        self._register()

    def packed_specs(self):
        n, k = self.out_features, self.in_features
        return {"weight": ((n, k), torch.uint8),
                "scale": ((_cdiv(n, self.block_n), _cdiv(k, self.block_k)), torch.float32)}

    def operands(self):
        return self.weight, self.scale, self.block_n, self.block_k

    def gemm(self, x):
        return fp8_gemm(x, *self.operands())

    def gate_up(self, x):
        return fp8_gate_up(x, *self.operands())

    def stacks_with(self, other):
        return (super().stacks_with(other) and self.out_features % self.block_n == 0
                and (other.block_n, other.block_k) == (self.block_n, self.block_k))

    def grouped(self, x, ids):
        return moe_fp8_gemm(x, ids, self.weight, self.scale, self.block_n, self.block_k,
                            self.gated)

    def dequantized(self):
        return dequantize_fp8(self.weight, self.scale, self.block_n, self.block_k)


def e4m3_bits(x: torch.Tensor) -> torch.Tensor:
    """float -> e4m3 bit patterns (uint8), round to nearest even, saturated at +-448."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def quantize_fp8(w: torch.Tensor, block: int = BLOCK) -> dict[str, torch.Tensor]:
    """Data-free block quantization: scale = amax(block) / 448 (Qwen's recipe)."""
    n, k = w.shape
    rows, cols = _cdiv(n, block), _cdiv(k, block)
    padded = w.new_zeros(rows * block, cols * block, dtype=torch.float32)
    padded[:n, :k] = w.float()
    amax = padded.view(rows, block, cols, block).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    expanded = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]
    return {"weight": e4m3_bits(w.float() / expanded), "scale": scale}


class Fp8Blocks(Layout):
    """`weight` e4m3 [N, K] + a multiplier scale per (bn x bk) block under `scale_name`."""

    family = "fp8"

    def __init__(self, label: str, scale_name: str, block_n: int, block_k: int,
                 scale_dtypes: tuple[str, ...] = FLOAT_DTYPES, optional: tuple[str, ...] = ()):
        self.label, self.scale_name = label, scale_name
        self.block_n, self.block_k = block_n, block_k
        self.scale_dtypes, self.optional = scale_dtypes, optional

    def scale_shape(self, n: int, k: int) -> tuple[int, ...]:
        return (_cdiv(n, self.block_n), _cdiv(k, self.block_k))

    def scale_spec(self, n: int, k: int) -> TensorSpec:
        return TensorSpec(self.scale_shape(n, k), self.scale_dtypes)

    def tensors(self, n, k):
        specs = {"weight": TensorSpec((n, k), FP8), self.scale_name: self.scale_spec(n, k)}
        # activation scales (static W8A8 recipes) are unused by weight-only compute: one
        # value, stored however the writing library stores it, passes
        specs.update({name: scalar(required=False) for name in self.optional})
        return specs

    def module(self, n, k):
        return Fp8Linear(k, n, self.block_n, BLOCK if self.block_k >= k else self.block_k)

    def convert(self, tensors, n, k):
        scale = tensors[self.scale_name].float().reshape(self.scale_shape(n, k))
        if self.block_k >= k:  # one scale per row: spread over the module's 128-wide blocks
            scale = scale.expand(-1, _cdiv(k, BLOCK))
        return {"weight": tensors["weight"].view(torch.uint8), "scale": scale.contiguous()}


class PerTensor(Fp8Blocks):
    """One scale for the whole weight: 0-dim (ModelOpt) or [1] (compressed-tensors), in
    float32 or the model's dtype."""

    def __init__(self, label: str, scale_name: str, optional: tuple[str, ...] = ()):
        super().__init__(label, scale_name, 1 << 30, 1 << 30, optional=optional)

    def scale_spec(self, n, k):
        return scalar()

    def module(self, n, k):
        return Fp8Linear(k, n, BLOCK, BLOCK)

    def convert(self, tensors, n, k):
        scale = tensors[self.scale_name].float().reshape(1, 1)
        return {"weight": tensors["weight"].view(torch.uint8),
                "scale": scale.expand(_cdiv(n, BLOCK), _cdiv(k, BLOCK)).contiguous()}


def qwen_fp8(block: tuple[int, int]) -> Layout:
    """Qwen's official FP8: `weight_scale_inv`, which is a multiplier despite its name."""
    return Fp8Blocks(f"fp8 block {block[0]}x{block[1]} (Qwen)", "weight_scale_inv", *block)


def ct_fp8(strategy: str, block: tuple[int, int] | None) -> Layout:
    """compressed-tensors float-quantized: `weight_scale` per block, channel or tensor."""
    if strategy == "block":
        return Fp8Blocks(f"fp8 block {block[0]}x{block[1]} (compressed-tensors)",
                         "weight_scale", *block, optional=("input_scale",))
    if strategy == "channel":
        # [N, 1] on disk: one block per row spanning all of K
        return Fp8Blocks("fp8 per-channel (compressed-tensors)", "weight_scale", 1, 1 << 30,
                         optional=("input_scale",))
    return PerTensor("fp8 per-tensor (compressed-tensors)", "weight_scale",
                     optional=("input_scale",))


def modelopt_fp8() -> Layout:
    return PerTensor("fp8 per-tensor (ModelOpt)", "weight_scale", optional=("input_scale",))


def quantize_at_load() -> Layout:
    return Quantize("fp8", lambda k, n: Fp8Linear(k, n), quantize_fp8,
                    "fp8 block 128x128 (quantized at load)")
