"""Attention's two paths give the same result: the grouped-query SDPA call (compiled forwards,
CPUs) and the expanded-heads call without cuDNN (eager forwards on CUDA, whose key length
changes at every call)."""

from __future__ import annotations

import pytest
import torch

from flash_planner.engine.models.qwen.layers import attention, expanded_attention

CUDA = torch.cuda.is_available()


def _inputs(device: str, dtype: torch.dtype, heads: int = 8, kv_heads: int = 2):
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    q = torch.randn(1, 5, heads, 32, generator=gen)
    keys = torch.randn(1, 23, kv_heads, 32, generator=gen)
    values = torch.randn(1, 23, kv_heads, 32, generator=gen)
    mask = torch.ones(5, 23, dtype=torch.bool).tril(23 - 5)    # a verify block's causal rows
    return [t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
            for t in (q, keys, values, mask)]


def _written_out(q, keys, values, mask, scale):
    """Softmax attention per head in float64, each query head on its group's kv head."""
    group = q.shape[2] // keys.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(q.shape[2]):
        s = q[0, :, h].double() @ keys[0, :, h // group].double().T * scale
        s = s.masked_fill(~mask, float("-inf"))
        out[0, :, h] = torch.softmax(s, -1) @ values[0, :, h // group].double()
    return out


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4)], ids=["gqa", "mha"])
def test_both_paths_give_the_written_out_attention(heads, kv_heads):
    q, keys, values, mask = _inputs("cpu", torch.float32, heads, kv_heads)
    want = _written_out(q, keys, values, mask, 0.2)
    for fn in (attention, expanded_attention):
        out = fn(q, keys, values, mask, 0.2)
        assert out.shape == q.shape
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not CUDA, reason="no CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_eager_cuda_attention_is_the_written_out_one(dtype):
    q, keys, values, mask = _inputs("cuda", dtype)
    want = _written_out(*(t.cpu() for t in (q, keys, values, mask)), 0.2)
    out = attention(q, keys, values, mask, 0.2)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double().cpu(), want, rtol=tol, atol=tol)
