"""int4 weights with a scale and a zero point per group along K (W4A16): compressed-tensors'
pack-quantized (what llm-compressor's GPTQ/AWQ recipes write), AutoAWQ GEMM and GPTQ.

The engine's layout is one for all: `packed` uint8 [N, ceil(K / 2)] (element 2j in the low
nibble, values 0..15), `scale` float32 and `zero` uint8 [N, ceil(K / group)]:
W = (q - zero) * scale. compressed-tensors' int32 words are already that byte order on a
little-endian host (values offset by 8); AutoAWQ's [K, N / 8] words in AWQ nibble order and
GPTQ's words packed along K are unpacked and repacked once, at load. Facts: FACTS.md 11.
"""

from __future__ import annotations

import sys

import torch

from ...kernels.dispatch import dequantize_int4, int4_gate_up, int4_gemm, moe_int4_gemm
from .layout import FLOAT_DTYPES, Layout, Quantize, TensorSpec
from .linear import QuantLinear
from .packing import cdiv as _cdiv
from .packing import pack_nibbles, word_nibbles

GROUP = 128
# AutoAWQ packs element e of each 8 into nibble AWQ_POSITION[e] of its int32 word
AWQ_POSITION = (0, 4, 1, 5, 2, 6, 3, 7)
INT = ("I32",)
assert sys.byteorder == "little", "int4 checkpoints are read as little-endian words"


class Int4Linear(QuantLinear):
    family = "int4"

    def __init__(self, in_features: int, out_features: int, group: int = GROUP):
        super().__init__(in_features, out_features)
        self.group = group
        self._register()

    def packed_specs(self):
        n, k, groups = self.out_features, self.in_features, _cdiv(self.in_features, self.group)
        return {"packed": ((n, _cdiv(k, 2)), torch.uint8),
                "scale": ((n, groups), torch.float32), "zero": ((n, groups), torch.uint8)}

    def operands(self):
        return self.packed, self.scale, self.zero, self.group

    def gemm(self, x):
        return int4_gemm(x, *self.operands())

    def gate_up(self, x):
        return int4_gate_up(x, *self.operands())

    def stacks_with(self, other):
        return super().stacks_with(other) and other.group == self.group

    def grouped(self, x, ids):
        return moe_int4_gemm(x, ids, self.packed, self.scale, self.zero, self.group,
                             self.gated)

    def dequantized(self):
        return dequantize_int4(self.packed, self.scale, self.zero, self.group, self.in_features)

    def extra_repr(self):
        return f"{super().extra_repr()}, group={self.group}"


def quantize_int4(w: torch.Tensor, group: int = GROUP) -> dict[str, torch.Tensor]:
    """Data-free asymmetric min/max quantization per group of `group` along K."""
    n, k = w.shape
    groups = _cdiv(k, group)
    wf = w.float()
    padded = torch.cat((wf, wf[:, -1:].expand(n, groups * group - k)), dim=1)  # repeats a value
    g = padded.view(n, groups, group)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scale = (hi - lo) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.round(-lo / scale).clamp(0, 15)
    q = torch.round(g / scale[..., None] + zero[..., None]).clamp(0, 15)
    q = q.view(n, groups * group)[:, :k].to(torch.uint8)
    return {"packed": pack_nibbles(q), "scale": scale, "zero": zero.to(torch.uint8)}


class CtPacked(Layout):
    """compressed-tensors pack-quantized int4: `weight_packed` int32 [N, ceil(K / 8)] (values
    + 8), `weight_scale` [N, groups], `weight_shape`, `weight_zero_point` int32
    [ceil(N / 8), groups] packed along N when asymmetric."""

    family = "int4"

    def __init__(self, group: int | None, symmetric: bool):
        self.group, self.symmetric = group, symmetric   # group None: one per channel
        kind = f"group {group}" if group else "per-channel"
        self.label = f"int4 {kind} {'symmetric' if symmetric else 'asymmetric'} " \
                     "(compressed-tensors pack-quantized)"

    def _groups(self, k: int) -> int:
        return _cdiv(k, self.group) if self.group else 1

    def tensors(self, n, k):
        specs = {"weight_packed": TensorSpec((n, _cdiv(k, 8)), INT),
                 "weight_scale": TensorSpec((n, self._groups(k)), FLOAT_DTYPES),
                 "weight_shape": TensorSpec((2,), ("I64", "I32"))}
        if not self.symmetric:
            specs["weight_zero_point"] = TensorSpec((_cdiv(n, 8), self._groups(k)), INT)
        return specs

    def module(self, n, k):
        return Int4Linear(k, n, self.group or GROUP)

    def convert(self, tensors, n, k):
        packed = tensors["weight_packed"].contiguous().view(torch.uint8)[:, :_cdiv(k, 2)]
        scale = tensors["weight_scale"].float()
        if self.symmetric:
            zero = torch.full_like(scale, 8, dtype=torch.uint8)
        else:
            zero = word_nibbles(tensors["weight_zero_point"].T.contiguous())[:, :n].T
        if self.group is None:  # per channel: the same scale for every 128-group
            scale = scale.expand(n, _cdiv(k, GROUP))
            zero = zero.expand(n, _cdiv(k, GROUP))
        return {"packed": packed, "scale": scale.contiguous(), "zero": zero.contiguous()}

    def check(self, tensors, n, k):
        shape = [int(v) for v in tensors["weight_shape"].tolist()]
        return None if shape == [n, k] else f"weight_shape says {shape}, expected {[n, k]}"


class AutoAWQ(Layout):
    """AutoAWQ GEMM: `qweight` int32 [K, N / 8] and `qzeros` int32 [K / G, N / 8] in AWQ
    nibble order, `scales` fp16 [K / G, N]."""

    family = "int4"

    def __init__(self, group: int):
        self.group = group
        self.label = f"int4 group {group} (AutoAWQ GEMM)"

    def tensors(self, n, k):
        return {"qweight": TensorSpec((k, n // 8), INT),
                "qzeros": TensorSpec((k // self.group, n // 8), INT),
                "scales": TensorSpec((k // self.group, n), FLOAT_DTYPES)}

    def module(self, n, k):
        return Int4Linear(k, n, self.group)

    @staticmethod
    def _unpack(words: torch.Tensor) -> torch.Tensor:
        """[R, N / 8] AWQ words -> uint8 [R, N] in element order."""
        nib = word_nibbles(words).view(words.shape[0], -1, 8)
        return nib[..., list(AWQ_POSITION)].flatten(-2)

    def convert(self, tensors, n, k):
        q = self._unpack(tensors["qweight"]).T.contiguous()                # [N, K]
        return {"packed": pack_nibbles(q), "scale": tensors["scales"].float().T.contiguous(),
                "zero": self._unpack(tensors["qzeros"]).T.contiguous()}


class Gptq(Layout):
    """GPTQ: `qweight` int32 [K / 8, N] packed along K, `qzeros` int32 [K / G, N / 8],
    `scales` [K / G, N], `g_idx` [K]; v1 checkpoints store zero - 1."""

    family = "int4"

    def __init__(self, group: int, v1: bool):
        self.group, self.v1 = group, v1
        self.label = f"int4 group {group} (GPTQ {'v1' if v1 else 'v2'})"

    def tensors(self, n, k):
        return {"qweight": TensorSpec((k // 8, n), INT),
                "qzeros": TensorSpec((k // self.group, n // 8), INT),
                "scales": TensorSpec((k // self.group, n), FLOAT_DTYPES),
                "g_idx": TensorSpec((k,), INT, required=False)}

    def module(self, n, k):
        return Int4Linear(k, n, self.group)

    def convert(self, tensors, n, k):
        q = word_nibbles(tensors["qweight"].T.contiguous())                # [N, K]
        zero = word_nibbles(tensors["qzeros"]).T.contiguous()              # [N, K / G]
        if self.v1:
            zero = (zero + 1) & 0xF   # stored as (zero - 1) mod 16
        return {"packed": pack_nibbles(q), "scale": tensors["scales"].float().T.contiguous(),
                "zero": zero}

    def check(self, tensors, n, k):
        g_idx = tensors.get("g_idx")
        if g_idx is None:
            return None
        plain = torch.arange(k, device=g_idx.device) // self.group
        if not torch.equal(g_idx.long(), plain):
            return ("g_idx is not the identity order (act-order / desc_act GPTQ): not "
                    "supported; re-quantize with desc_act false or use compressed-tensors")
        return None


def quantize_at_load() -> Layout:
    return Quantize("int4", lambda k, n: Int4Linear(k, n, GROUP), quantize_int4,
                    f"int4 group {GROUP} asymmetric (quantized at load)")
