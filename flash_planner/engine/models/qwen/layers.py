"""Dense building blocks shared by the target models: norms, MLP, rotary embedding."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel


def embedding(num: int, dim: int) -> nn.Embedding:
    """nn.Embedding(num, dim); on the meta device (a model built before its weights load)
    without its random init, which the weights replace anyway: nn.init.normal_ under a
    device context goes through torch._refs, and that imports torch._dynamo (1.2 s of an
    eager start here)."""
    if torch.get_default_device().type == "meta":
        return nn.Embedding(num, dim, _weight=torch.empty(num, dim))
    return nn.Embedding(num, dim)


class RMSNorm(nn.Module):
    """RMSNorm in float32. Zero-centred (Qwen3.5): x_hat * (1 + w); plain (Qwen3): w * x_hat."""

    def __init__(self, dim: int, eps: float, zero_centred: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centred else torch.ones(dim))
        self.eps = eps
        self.zero_centred = zero_centred

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centred:
            return (xf * (1.0 + self.weight.float())).type_as(x)
        return self.weight * xf.type_as(x)


class GatedRMSNorm(nn.Module):
    """The GDN output norm: w * rmsnorm(o) * act(z), per value head; act is SiLU (Qwen3.5/3.6)
    or the sigmoid (Qwen3.8-Flash-Next's output_gate_type)."""

    def __init__(self, dim: int, eps: float, activation: str = "silu"):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.act = torch.sigmoid if activation == "sigmoid" else F.silu

    def forward(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        of = o.float()
        of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (self.weight * of.to(o.dtype)) * self.act(z.float())
        return out.to(o.dtype)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        # set after loading where gate and up are quantized alike (weights/fuse.py): one
        # module computing silu(gate(x)) * up(x), and gate_proj / up_proj gone
        self.gate_up: nn.Module | None = None
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            return self.down_proj(self.gate_up(x))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, T, rotary_dim] for integer positions [B, T] (neox half-split layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32,
                                             device=positions.device) / rotary_dim))
    freqs = positions.float()[..., None] * inv_freq                   # [B, T, rotary_dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)                           # [B, T, rotary_dim]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def mrope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float,
                  section: tuple[int, int, int], dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, T, rotary_dim] for (t, h, w) positions [3, B, T] (RopeConfig's
    `mrope_section`: rotary pair j turns with h where j % 3 == 1 and j < 3 * section[1],
    with w where j % 3 == 2 and j < 3 * section[2], else with t)."""
    pairs = rotary_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32,
                                             device=positions.device) / rotary_dim))
    j = torch.arange(pairs, device=positions.device)
    axis = torch.zeros(pairs, dtype=torch.long, device=positions.device)
    axis[(j % 3 == 1) & (j < 3 * section[1])] = 1
    axis[(j % 3 == 2) & (j < 3 * section[2])] = 2
    chosen = positions.float()[axis]                      # [pairs, B, T]: each pair's axis
    freqs = chosen.permute(1, 2, 0) * inv_freq            # [B, T, pairs]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] dims of x [B, T, H, D]; the rest pass through."""
    r = cos.shape[-1]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]                 # [B, T, 1, r]
    x_rot, x_pass = x[..., :r], x[..., r:]
    x1, x2 = x_rot[..., : r // 2], x_rot[..., r // 2:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)


# cuDNN's SDPA backend builds an execution graph per shape; PyTorch may pick it for a masked
# grouped-query call in bf16/fp16 on CUDA (flash takes no mask, the memory-efficient kernel no
# grouped heads). Eager forwards change the key length at every call, so on CUDA they expand
# the grouped heads and keep cuDNN out: the memory-efficient kernel takes the call (math where
# it refuses). Compiled forwards (static shapes, traced by dynamo) keep every backend.
EAGER_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
              scale: float) -> torch.Tensor:
    """q [B, T, H, D] over keys, values [B, L, Hkv, D] (Hkv divides H) where mask [T, L]
    -> [B, T, H, D]."""
    if q.is_cuda and not torch.compiler.is_compiling():
        return expanded_attention(q, keys, values, mask, scale)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask,
        scale=scale, enable_gqa=q.shape[2] != keys.shape[2])
    return out.transpose(1, 2)


def expanded_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       mask: torch.Tensor, scale: float) -> torch.Tensor:
    """`attention` with the grouped heads expanded and cuDNN's backend left out (CUDA's
    eager path)."""
    group = q.shape[2] // keys.shape[2]
    if group > 1:
        keys = keys.repeat_interleave(group, dim=2)
        values = values.repeat_interleave(group, dim=2)
    with sdpa_kernel(EAGER_BACKENDS):
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask,
            scale=scale)
    return out.transpose(1, 2)
