"""An MLP's quantized gate and up projections stacked into one module after loading.

The stacked module gives what the two projections and SwiGLU gave, through the references
and through the Triton kernels (interpreted on a CPU), for decode rows and a prefill chunk;
where the two cannot stack (two formats, FP8 scale blocks across the seam, full precision)
the MLP keeps them apart.
"""

from __future__ import annotations

import pytest
import torch

from flash_planner.engine.models.qwen.layers import MLP
from flash_planner.engine.weights import fp8, int4, nvfp4
from flash_planner.engine.weights.fuse import fuse_gate_up
from flash_planner.kernels import dispatch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FAMILIES = {"fp8": fp8, "nvfp4": nvfp4, "int4": int4}


def _quantized(family: str, n: int, k: int, gen: torch.Generator):
    layout = FAMILIES[family].quantize_at_load()
    w = torch.randn(n, k, generator=gen) * 0.05
    module = layout.module(n, k).to_empty(device=DEVICE)
    module.set_packed({name: t.to(DEVICE) for name, t in
                       layout.convert({"weight": w}, n, k).items()})
    return module


def _mlp(gate_family: str, up_family: str, hidden: int = 256, inter: int = 256) -> MLP:
    gen = torch.Generator().manual_seed(0)
    mlp = MLP(hidden, inter).to(DEVICE)
    mlp.gate_proj = _quantized(gate_family, inter, hidden, gen)
    mlp.up_proj = _quantized(up_family, inter, hidden, gen)
    mlp.down_proj = _quantized(gate_family, hidden, inter, gen)
    return mlp


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("family", FAMILIES)
def test_stacked_gate_up_gives_the_two_projections(family, backend):
    mlp = _mlp(family, family)
    x = torch.randn(2, 37, 256, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    dispatch.set_backend(backend)
    try:
        before = [mlp(x[:, :m]) for m in (1, 5, 37)]
        assert fuse_gate_up(mlp) == 1
        after = [mlp(x[:, :m]) for m in (1, 5, 37)]
    finally:
        dispatch.set_backend("auto")
    assert mlp.gate_up.gated and mlp.gate_up.family == family
    assert not hasattr(mlp, "gate_proj") and not hasattr(mlp, "up_proj")
    assert "gate and up stacked" in repr(mlp.gate_up)
    for b, a in zip(before, after):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert fuse_gate_up(mlp) == 0                       # nothing left to stack


@pytest.mark.parametrize("gate,up,inter", [("fp8", "nvfp4", 256), ("fp8", "fp8", 192)],
                         ids=["two-formats", "fp8-block-across-the-seam"])
def test_projections_that_cannot_stack_stay_apart(gate, up, inter):
    mlp = _mlp(gate, up, inter=inter)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    before = mlp(x)
    assert fuse_gate_up(mlp) == 0
    assert mlp.gate_up is None and mlp.gate_proj is not None
    torch.testing.assert_close(mlp(x), before)


def test_full_precision_mlps_are_left_alone():
    mlp = MLP(64, 128)
    assert fuse_gate_up(torch.nn.Sequential(mlp)) == 0 and mlp.gate_up is None


def test_stacked_nvfp4_dequantizes_each_half_with_its_own_global_scale():
    mlp = _mlp("nvfp4", "nvfp4")
    gate, up = mlp.gate_proj.dequantized(), mlp.up_proj.dequantized()
    assert not torch.equal(mlp.gate_proj.global_scale, mlp.up_proj.global_scale)
    fuse_gate_up(mlp)
    assert torch.equal(mlp.gate_up.dequantized(), torch.cat((gate, up)))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("family", [None, "fp8", "nvfp4", "int4"], ids=lambda f: f or "bf16")
def test_stacked_experts_give_the_two_projections(family, backend):
    """A mixture of experts' gate and up stacks, full precision or quantized, stacked per
    expert: the same routed rows as before, decode rows and a prefill chunk."""
    from flash_planner.engine.models.qwen.moe import Experts

    gen = torch.Generator().manual_seed(4)
    experts, hidden, inter = 4, 128, 128
    block = Experts(experts, hidden, inter).to(DEVICE)
    with torch.no_grad():
        for stack in (block.gate_proj, block.up_proj, block.down_proj):
            stack.weight.copy_(torch.randn(stack.weight.shape, generator=gen) * 0.05)
    if family is not None:
        layout = FAMILIES[family].quantize_at_load()
        for name in ("gate_proj", "up_proj", "down_proj"):
            old = getattr(block, name)
            with torch.device("meta"):
                stack = layout.module(old.out_features, old.in_features).stacked(experts)
            stack = stack.to_empty(device=DEVICE)
            for e in range(experts):
                stack.set_packed(layout.convert({"weight": old.weight[e].detach().cpu()},
                                                old.out_features, old.in_features), expert=e)
            setattr(block, name, stack)
    x = torch.randn(37, hidden, generator=gen).to(DEVICE)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:2] for _ in range(37)])
    ids = ids.to(device=DEVICE, dtype=torch.int32)
    weights = torch.rand(37, 2, generator=gen).to(DEVICE)
    dispatch.set_backend(backend)
    try:
        before = [block(x[:m], weights[:m], ids[:m]) for m in (1, 5, 37)]
        assert fuse_gate_up(block) == 1
        after = [block(x[:m], weights[:m], ids[:m]) for m in (1, 5, 37)]
    finally:
        dispatch.set_backend("auto")
    assert block.gate_up.gated and not hasattr(block, "gate_proj")
    for b, a in zip(before, after):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
