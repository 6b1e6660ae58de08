"""The Qwen3.5/3.6 vision tower: image patches -> embeddings in the language model's width.

Published Qwen3.5/3.6 checkpoints are vision-language models (`*ForConditionalGeneration`):
beside the language model (`model.language_model.*`) sits this tower (`model.visual.*`).
Parameter names follow the checkpoint, so it loads without renaming.

An image arrives as the image processor lays it out: `[N, C * T * P * P]` patches (channels,
`temporal_patch_size` frames, a P x P square each), grid (t, h, w) in patches, the patches
of each frame in merge-block order: every `spatial_merge_size` x `spatial_merge_size` block
of neighbouring patches consecutive, blocks in raster order. The tower:

1. embeds each patch (a 3-D convolution whose kernel is its stride: one linear map of the
   flattened patch), adds the learned position table resampled bilinearly (corners aligned)
   from its square grid to the image's (h, w);
2. runs `depth` pre-norm blocks (LayerNorm, attention with 2-D rotary positions over all
   patches of the same frame, LayerNorm, MLP);
3. merges each block of m x m patches into one token (LayerNorm per patch, the m^2 patches
   concatenated, a GELU MLP to the language model's width): N / m^2 image tokens.

The rotary positions are axial: half of each head's rotary pairs turn with the patch's row,
half with its column, frequencies as the language model's RoPE over head_dim / 2.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...config import ConfigError
from .layers import embedding

VISION_PREFIX = "model.visual."

# the activations Qwen vision configs name, as torch computes them
ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "silu": F.silu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    hidden_act: str
    rope_theta: float
    eps: float = 1e-6

    @classmethod
    def from_hf_dict(cls, raw: dict, where: str) -> VisionConfig:
        """From a checkpoint's `vision_config` (`where` names it in errors)."""
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: vision_config must be an object")

        def positive(key: str, default: int | None = None) -> int:
            value = raw.get(key, default)
            if isinstance(value, (list, tuple)) and len(set(value)) == 1:
                value = value[0]                 # (P, P): a square patch written as a pair
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{where}: vision_config.{key} must be a positive integer, "
                                  f"got {value!r}")
            return value

        act = raw.get("hidden_act", "gelu_pytorch_tanh")
        if act not in ACTIVATIONS:
            raise ConfigError(f"{where}: vision_config.hidden_act {act!r} is not supported "
                              f"(supported: {', '.join(ACTIVATIONS)})")
        rope = raw.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ConfigError(f"{where}: vision_config.rope_parameters.rope_type "
                              f"{rope.get('rope_type')!r} is not supported (axial)")
        cfg = cls(depth=positive("depth"), hidden_size=positive("hidden_size"),
                  intermediate_size=positive("intermediate_size"),
                  num_heads=positive("num_heads"), in_channels=positive("in_channels", 3),
                  patch_size=positive("patch_size"),
                  temporal_patch_size=positive("temporal_patch_size", 2),
                  spatial_merge_size=positive("spatial_merge_size", 2),
                  out_hidden_size=positive("out_hidden_size"),
                  num_position_embeddings=positive("num_position_embeddings"),
                  hidden_act=act, rope_theta=float(rope.get("rope_theta", 10000.0)))
        if cfg.hidden_size % cfg.num_heads or cfg.head_dim % 4:
            raise ConfigError(f"{where}: vision_config.hidden_size {cfg.hidden_size} over "
                              f"num_heads {cfg.num_heads} must give a head size divisible by 4")
        if cfg.grid_side ** 2 != cfg.num_position_embeddings:
            raise ConfigError(f"{where}: vision_config.num_position_embeddings "
                              f"{cfg.num_position_embeddings} is not a square grid")
        return cfg

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """The length of one flattened patch: C * T * P * P."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def grid_side(self) -> int:
        """The side of the learned position table's square grid."""
        return round(self.num_position_embeddings ** 0.5)


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel, stride=kernel)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """[N, C*T*P*P] -> [N, hidden]: the convolution's kernel is its stride, so each patch
        is one dot product with each output channel's kernel."""
        w = self.proj.weight
        return F.linear(patches.to(w.dtype), w.reshape(w.shape[0], -1), self.proj.bias)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                frames: Sequence[int]) -> torch.Tensor:
        """x [N, hidden]; each frame's patches (`frames`: their counts, in order) attend to
        each other only."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        out = []
        for qs, ks, vs in zip(*(t.split(list(frames)) for t in (q, k, v))):
            o = F.scaled_dot_product_attention(qs.transpose(0, 1)[None], ks.transpose(0, 1)[None],
                                               vs.transpose(0, 1)[None])
            out.append(o[0].transpose(0, 1))
        return self.proj(torch.cat(out).reshape(n, -1))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions over the whole head (halves paired), in float32: x [N, heads, D],
    cos/sin [N, D]."""
    xf = x.float()
    half = xf.shape[-1] // 2
    turned = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos[:, None] + turned * sin[:, None]).to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.eps)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.eps)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                frames: Sequence[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, frames)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        merged = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.eps)
        self.linear_fc1 = nn.Linear(merged, merged, bias=True)
        self.linear_fc2 = nn.Linear(merged, cfg.out_hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[N, hidden] (merge blocks consecutive) -> [N / m^2, out_hidden]."""
        x = self.norm(x).reshape(-1, self.linear_fc1.in_features)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionTower(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)

    def forward(self, patches: torch.Tensor, grids: Sequence[tuple[int, int, int]]
                ) -> torch.Tensor:
        """patches [N, C*T*P*P] of the images with these (t, h, w) grids, in order ->
        image tokens [N / m^2, out_hidden], each image's consecutive."""
        cfg = self.cfg
        m = cfg.spatial_merge_size
        if patches.dim() != 2 or patches.shape[1] != cfg.patch_dim:
            raise ValueError(f"patches must be [N, {cfg.patch_dim}], got {list(patches.shape)}")
        for t, h, w in grids:
            if min(t, h, w) < 1 or h % m or w % m:
                raise ValueError(f"grid {(t, h, w)}: h and w must be positive multiples of "
                                 f"spatial_merge_size {m}")
        if sum(t * h * w for t, h, w in grids) != patches.shape[0]:
            raise ValueError(f"grids {list(grids)} hold {sum(t * h * w for t, h, w in grids)} "
                             f"patches, got {patches.shape[0]}")
        rows, cols = zip(*(merge_order(t, h, w, m, patches.device) for t, h, w in grids))
        row, col = torch.cat(rows), torch.cat(cols)
        x = self.patch_embed(patches)
        x = x + torch.cat([self._positions(t, h, w, r, c) for (t, h, w), r, c
                           in zip(grids, rows, cols)]).to(x.dtype)
        d = cfg.head_dim // 2              # each axis turns half of the rotary pairs
        inv_freq = 1.0 / cfg.rope_theta ** (
            torch.arange(0, d, 2, dtype=torch.float32, device=patches.device) / d)
        angles = torch.cat((row[:, None] * inv_freq, col[:, None] * inv_freq), dim=-1)
        angles = torch.cat((angles, angles), dim=-1)                       # [N, head_dim]
        cos, sin = angles.cos(), angles.sin()
        frames = [h * w for t, h, w in grids for _ in range(t)]
        for block in self.blocks:
            x = block(x, cos, sin, frames)
        return self.merger(x)

    def _positions(self, t: int, h: int, w: int, row: torch.Tensor, col: torch.Tensor
                   ) -> torch.Tensor:
        """The position table resampled to an (h, w) grid, at each patch's (row, col)."""
        side = self.cfg.grid_side
        table = self.pos_embed.weight.float().T.reshape(1, -1, side, side)
        grid = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0]
        return grid[:, row, col].T                                          # [t*h*w, hidden]


def merge_order(t: int, h: int, w: int, m: int, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each patch's (row, col) in the processor's order: frames, then m x m blocks in raster
    order, then the patches of a block in raster order."""
    r = torch.arange(h, device=device).view(h // m, m, 1, 1)
    c = torch.arange(w, device=device).view(1, 1, w // m, m)
    rows = r.expand(h // m, m, w // m, m).transpose(1, 2).reshape(-1)
    cols = c.expand(h // m, m, w // m, m).transpose(1, 2).reshape(-1)
    return rows.repeat(t), cols.repeat(t)
