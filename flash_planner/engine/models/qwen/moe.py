"""The sparse mixture-of-experts MLP of Qwen3.5/3.6 MoE and Qwen3 MoE, with upstream names.

`mlp.gate` (the router, [E, H]): logits in the model's dtype, softmax over the experts in
float32, the top k, divided by their sum when `norm_topk` (always for Qwen3.5/3.6), cast back.
`mlp.experts.{gate,up,down}_proj`: one stack per projection (weights/experts.py), so the
grouped GEMM reads each chosen expert's weights once for all the rows that chose it.
`mlp.shared_expert` (Qwen3.5/3.6): a SwiGLU MLP every row runs, scaled by
sigmoid(`mlp.shared_expert_gate`(x)) ([1, H]). The router and the shared-expert gate are
plain parameters, not Linears: they stay in full precision whatever the weight format (a
checkpoint that stores the gate quantized anyway is dequantized at load: weights/load.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...config import MoeConfig
from ...weights.experts import ExpertLinear
from .layers import MLP


class RoutingRecord:
    """The expert ids of one forward, per sparse layer in order ([T, k] each), when asked."""

    def __init__(self) -> None:
        self.ids: list[torch.Tensor] = []

    def distinct_per_layer(self, num_experts: int) -> torch.Tensor:
        """[layers] how many distinct experts each layer's rows chose (on the device)."""
        if not self.ids:
            return torch.zeros(0)
        hit = torch.stack([F.one_hot(ids.reshape(-1).long(), num_experts).amax(0)
                           for ids in self.ids])                      # [layers, E]
        return hit.sum(-1)


class Router(nn.Module):
    def __init__(self, num_experts: int, hidden: int, top_k: int, norm_topk: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.top_k, self.norm_topk = top_k, norm_topk

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] in x's dtype, expert ids [T, k] int32)."""
        probs = torch.softmax(F.linear(x, self.weight), dim=-1, dtype=torch.float32)
        top, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(x.dtype), ids.to(torch.int32)


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = ExpertLinear(num_experts, hidden, intermediate)
        self.up_proj = ExpertLinear(num_experts, hidden, intermediate)
        self.down_proj = ExpertLinear(num_experts, intermediate, hidden)
        # set after loading (weights/fuse.py): gate and up stacked per expert, one grouped
        # GEMM giving silu(gate) * up; gate_proj / up_proj gone
        self.gate_up: nn.Module | None = None

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
                ) -> torch.Tensor:
        """x [T, H], weights and ids [T, k] -> sum_j weights[t, j] * expert_ids[t, j](x[t])."""
        rows = x[:, None, :]                                           # [T, 1, H]
        if self.gate_up is not None:
            h = self.gate_up.grouped(rows, ids)
        else:
            h = F.silu(self.gate_proj.grouped(rows, ids)) * self.up_proj.grouped(rows, ids)
        out = self.down_proj.grouped(h, ids)                           # [T, k, H]
        return (out * weights[..., None]).sum(dim=1)


class ScalarGate(nn.Module):
    """sigmoid(x @ w.T) with w [1, H]: the shared expert's share of each row."""

    def __init__(self, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(F.linear(x, self.weight))


class SparseMoeBlock(nn.Module):
    def __init__(self, moe: MoeConfig, hidden: int):
        super().__init__()
        self.num_experts = moe.num_experts
        self.gate = Router(moe.num_experts, hidden, moe.top_k, moe.norm_topk)
        self.experts = Experts(moe.num_experts, hidden, moe.expert_intermediate)
        if moe.shared_intermediate:
            self.shared_expert = MLP(hidden, moe.shared_intermediate)
            self.shared_expert_gate = ScalarGate(hidden)
        else:
            self.shared_expert = self.shared_expert_gate = None
        # set by the target's forward for the length of one forward (TargetModel.forward)
        self.record: RoutingRecord | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, ids = self.routed(x)
        if self.record is not None:
            self.record.ids.append(ids)
        return out

    def routed(self, x: torch.Tensor, valid: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, H] -> (out [B, T, H], expert ids [B*T, k]). valid [B, T] bool marks the
        real rows of a padded block (compiled.py): padding rows reuse the first row's experts,
        so padding reads no expert weights the block did not already need."""
        shape = x.shape
        rows = x.reshape(-1, shape[-1])                                # [B*T, H]
        weights, ids = self.gate(rows)
        if valid is not None:
            ids = torch.where(valid.reshape(-1, 1), ids, ids[:1])
        out = self.experts(rows, weights, ids)
        if self.shared_expert is not None:
            out = out + self.shared_expert_gate(rows) * self.shared_expert(rows)
        return out.reshape(shape), ids
