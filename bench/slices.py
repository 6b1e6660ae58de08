"""Random-weight engine slices for the benches: a target's full shapes with few layers, its
Linears (and experts) in a chosen format, built in place on the device (no checkpoint)."""

from __future__ import annotations

import torch


def quantize_layout(fmt: str):
    from flash_planner.engine.weights import fp8, int4, nvfp4

    return {"fp8": fp8, "nvfp4": nvfp4, "int4": int4}[fmt].quantize_at_load()


def expert_stack(fmt: str, experts: int, n: int, k: int, device: str, dtype: torch.dtype):
    """A stack of `experts` random [N, K] weights in `fmt` (bf16: an ExpertLinear)."""
    from flash_planner.engine.weights.experts import ExpertLinear

    if fmt == "bf16":
        stack = ExpertLinear(experts, k, n).to(device=device, dtype=dtype)
        with torch.no_grad():
            stack.weight.normal_(0.0, 0.02)
        return stack
    layout = quantize_layout(fmt)
    with torch.device("meta"):
        stack = layout.module(n, k).stacked(experts)
    stack = stack.to_empty(device=device)
    for e in range(experts):
        w = torch.randn(n, k, device=device, dtype=torch.float32) * 0.02
        stack.set_packed(layout.convert({"weight": w}, n, k), expert=e)
    return stack


# the slices' layouts: the full models' shapes with 4 layers (3 GDN : 1 attention), or tiny
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 384,
        "linear_key_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_value_head_dim": 16, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2}


def slice_model(raw: dict, weights: str, dtype: torch.dtype, device: str):
    """A TargetModel of `raw` with random weights (std 0.02), its Linears as `weights`
    loads them (nvfp4: quantized from the random bf16 weights), built in place on the
    device: no checkpoint is written."""
    from flash_planner.engine.config import ModelConfig
    from flash_planner.engine.models.qwen.target import TargetModel
    from flash_planner.engine.weights.fuse import fuse_gate_up
    from flash_planner.engine.weights.load import plan_linears
    from flash_planner.engine.weights.scheme import UNQUANTIZED

    cfg = ModelConfig.from_hf_dict(raw)
    with torch.device("meta"):
        model = TargetModel(cfg)
    planned = plan_linears(model, lambda ours: ours, UNQUANTIZED, weights, ValueError)
    model = model.to_empty(device=device)
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data.to(dtype).normal_(0.0, 0.02)
        for name, p in planned.items():
            w = torch.randn(p.n, p.k, device=device, dtype=dtype) * 0.02
            model.get_submodule(name).set_packed(p.layout.convert({"weight": w}, p.n, p.k))
    if weights != "bf16":               # the experts too, one stack per projection
        from flash_planner.engine.weights.experts import ExpertLinear

        for parent in list(model.modules()):
            for child, stack in list(parent.named_children()):
                if isinstance(stack, ExpertLinear):
                    setattr(parent, child, expert_stack(weights, stack.expert_count,
                                                        stack.out_features,
                                                        stack.in_features, device, dtype))
    fuse_gate_up(model)
    return cfg, model.eval()
