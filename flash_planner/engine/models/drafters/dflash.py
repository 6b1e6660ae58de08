"""The DFlash block-diffusion drafters (DFlash and DFlash2), loaded from their upstream
on-disk format.

A drafter directory holds a Qwen3 `config.json` (`architectures: ["DFlashDraftModel"]`) with
`dflash_config` {target_layer_ids, mask_token_id, block_size?} and weights `fc`,
`hidden_norm`, `norm`, `layers.*` only; token embeddings and lm_head are the target's.

Context features = hidden_norm(fc(concat of the target's tapped hidden states)). They are
fed straight into every draft layer's k_proj / v_proj (with k_norm and RoPE at their absolute
positions, no input norm): "KV injection". Queries come only from the block
[anchor, mask x (B-1)] at positions start .. start+B-1. Each layer is causal within a window
(sliding_attention) or bidirectional (full_attention); a top-level `is_causal` overrides; a
window on a bidirectional layer applies on both sides (|q - k| < window).

DFlash2 (`DFlash2DraftModel`) adds, from `dflash_config`: a grouped dynamic causal conv around
each attention and MLP sublayer (`conv_kernel_size`, `conv_group_size`: draft_conv.py) and a
candidate selector that walks one path through the head's top-K candidates per position
(`selector_rank`, `selector_top_k`: selector.py). Its block size must be given.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...config import ConfigError, ModelConfig, RopeConfig
from ...weights.load import load_module, open_shard
from ...weights.scheme import WeightFormatError, read_scheme
from ..qwen.layers import MLP, RMSNorm, apply_rope, attention, rope_cos_sin
from .draft_conv import GroupedDynamicConv
from .selector import CandidateSelector

DFLASH, DFLASH2 = "DFlashDraftModel", "DFlash2DraftModel"
SUPPORTED_ARCHITECTURES = (DFLASH, DFLASH2)
# Every dflash_config key a DFlash2 drafter may carry; another one is refused by name
DFLASH2_KEYS = {"block_size", "mask_token_id", "target_layer_ids", "conv_kernel_size",
                "conv_group_size", "selector_rank", "selector_top_k", "output_multiplier",
                "final_logit_softcapping", "input_embedding_scale"}
DFLASH2_NEEDS = ("block_size", "conv_kernel_size", "conv_group_size", "selector_rank",
                 "selector_top_k")


class DrafterError(ValueError):
    """A drafter directory that cannot be loaded or does not fit the target."""


def default_tap_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The upstream fallback: one draft layer -> [N//2]; else evenly spaced over 1..N-3."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    first, last = 1, num_target_layers - 3
    step = (last - first) / (num_draft_layers - 1)
    return tuple(int(round(first + i * step)) for i in range(num_draft_layers))


@dataclass(frozen=True)
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope: RopeConfig
    block_size: int
    mask_token_id: int
    tap_ids: tuple[int, ...]
    layer_causal: tuple[bool, ...]           # per draft layer
    layer_window: tuple[int | None, ...]     # per draft layer; None = unlimited
    num_target_layers: int | None = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    architecture: str = DFLASH
    conv_kernel_size: int | None = None      # DFlash2's convs (None: none)
    conv_group_size: int = 16
    selector_rank: int | None = None         # DFlash2's candidate selector (None: argmax)
    selector_top_k: int = 16

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], where: str,
                     target_layers: int | None = None) -> DraftConfig:
        archs = raw.get("architectures") or []
        if any(a not in SUPPORTED_ARCHITECTURES for a in archs) or len(set(archs)) > 1:
            raise DrafterError(f"{where}: architecture {archs} is not supported (supported: "
                               f"one of {', '.join(SUPPORTED_ARCHITECTURES)})")
        arch = archs[0] if archs else DFLASH
        dflash = raw.get("dflash_config") or {}

        def need(key: str) -> Any:
            if raw.get(key) is None:
                raise DrafterError(f"{where}: required field '{key}' is missing")
            return raw[key]

        def draft_field(key: str, default: Any = None) -> Any:
            """A drafter setting: dflash_config's, else the top level's (as upstream)."""
            value = dflash.get(key)
            return raw.get(key, default) if value is None else value

        if arch == DFLASH2:
            _check_dflash2(raw, dflash, where)

        n = int(need("num_hidden_layers"))
        heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        head_dim = int(raw.get("head_dim") or hidden // heads)
        mask = dflash.get("mask_token_id", raw.get("mask_token_id"))
        if mask is None:
            raise DrafterError(f"{where}: dflash_config.mask_token_id is missing")
        num_target = raw.get("num_target_layers") or target_layers
        taps = dflash.get("target_layer_ids")
        if taps is None:
            if num_target is None:
                raise DrafterError(f"{where}: no dflash_config.target_layer_ids and no "
                                   "num_target_layers to derive them from")
            taps = default_tap_ids(int(num_target), n)
        block = draft_field("block_size", 16)
        types = raw.get("layer_types") or ["full_attention"] * n
        if len(types) != n:
            raise DrafterError(f"{where}: layer_types has {len(types)} entries for {n} layers")
        window = raw.get("sliding_window")
        if arch == DFLASH2 and raw.get("use_sliding_window") is False:
            window = None        # transformers' Qwen3 rule: the flag switches windows off
        override = raw.get("is_causal")
        causal, windows = [], []
        for t in types:
            if t not in ("full_attention", "sliding_attention"):
                raise DrafterError(f"{where}: unknown layer type {t!r}")
            sliding = t == "sliding_attention"
            causal.append(sliding if override is None else bool(override))
            windows.append(int(window) if sliding and window else None)
        try:
            rope = RopeConfig.from_hf_dict(raw, head_dim, where)
        except ConfigError as exc:
            raise DrafterError(str(exc)) from exc
        return cls(
            hidden_size=hidden, intermediate_size=int(need("intermediate_size")),
            num_layers=n, num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads), head_dim=head_dim,
            vocab_size=int(need("vocab_size")), rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=rope, block_size=int(block), mask_token_id=int(mask),
            tap_ids=tuple(int(t) for t in taps), layer_causal=tuple(causal),
            layer_window=tuple(windows),
            num_target_layers=None if num_target is None else int(num_target),
            input_embedding_scale=float(draft_field("input_embedding_scale") or 1.0),
            output_multiplier=float(draft_field("output_multiplier") or 1.0),
            final_logit_softcapping=draft_field("final_logit_softcapping"),
            architecture=arch,
            **({} if arch != DFLASH2 else {
                key: int(draft_field(key)) for key in DFLASH2_NEEDS[1:]}))

    @property
    def selects(self) -> bool:
        """Whether drafts are walked by a candidate selector (DFlash2), not argmax."""
        return self.selector_rank is not None

    def to_hf_dict(self) -> dict[str, Any]:
        """The upstream on-disk config.json (a Qwen3 config plus dflash_config)."""
        window = next((w for w in self.layer_window if w is not None), None)
        out = {
            "architectures": [self.architecture], "model_type": "qwen3",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "vocab_size": self.vocab_size, "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": "silu", "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope.theta},
            "layer_types": ["sliding_attention" if w is not None else "full_attention"
                            for w in self.layer_window],
            "use_sliding_window": window is not None, "sliding_window": window,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {"target_layer_ids": list(self.tap_ids),
                              "mask_token_id": self.mask_token_id,
                              "block_size": self.block_size},
        }
        if self.architecture == DFLASH2:
            out["dflash_config"].update({key: getattr(self, key) for key in DFLASH2_NEEDS[1:]})
        if any(c != (w is not None) for c, w in zip(self.layer_causal, self.layer_window)):
            out["is_causal"] = self.layer_causal[0]   # an override applies to every layer
        for key in ("input_embedding_scale", "output_multiplier"):
            if getattr(self, key) != 1.0:
                out[key] = getattr(self, key)
        if self.final_logit_softcapping:
            out["final_logit_softcapping"] = self.final_logit_softcapping
        return out

    def check_target(self, target: ModelConfig, where: str) -> None:
        """Refuse a drafter that was not made for this target."""
        problems = []
        if self.hidden_size != target.hidden_size:
            problems.append(f"hidden_size {self.hidden_size} != target's {target.hidden_size}")
        if self.vocab_size != target.vocab_size:
            problems.append(f"vocab_size {self.vocab_size} != target's {target.vocab_size}")
        bad = [t for t in self.tap_ids if not 0 <= t < target.num_layers]
        if bad:
            problems.append(f"target_layer_ids {bad} outside the target's "
                            f"{target.num_layers} layers")
        if not 0 <= self.mask_token_id < target.vocab_size:
            problems.append(f"mask_token_id {self.mask_token_id} outside the vocabulary")
        if self.num_target_layers not in (None, target.num_layers):
            problems.append(f"trained for a {self.num_target_layers}-layer target, this one "
                            f"has {target.num_layers}")
        if self.block_size < 2:
            problems.append(f"block_size {self.block_size} < 2")
        if self.conv_kernel_size is not None and (
                self.conv_kernel_size < 1 or self.conv_group_size < 1
                or self.hidden_size % self.conv_group_size):
            problems.append(f"conv_kernel_size {self.conv_kernel_size} / conv_group_size "
                            f"{self.conv_group_size}: need >= 1 and a group size dividing "
                            f"hidden_size {self.hidden_size}")
        if self.selects and not (self.selector_rank >= 1
                                 and 1 <= self.selector_top_k <= self.vocab_size):
            problems.append(f"selector_rank {self.selector_rank} / selector_top_k "
                            f"{self.selector_top_k}: need rank >= 1 and 1 <= top_k <= "
                            "vocab_size")
        if problems:
            raise DrafterError(f"{where}: drafter does not fit the target: "
                               + "; ".join(problems))


def _check_dflash2(raw: dict[str, Any], dflash: dict[str, Any], where: str) -> None:
    """A DFlash2 config names every setting its forward depends on; refuse what we would
    otherwise have to guess or ignore."""
    unknown = sorted(set(dflash) - DFLASH2_KEYS)
    if unknown:
        raise DrafterError(f"{where}: dflash_config {', '.join(unknown)} not supported for "
                           f"{DFLASH2} (supported: {', '.join(sorted(DFLASH2_KEYS))})")
    missing = [k for k in (*DFLASH2_NEEDS, "mask_token_id")
               if dflash.get(k, raw.get(k)) is None]
    if raw.get("layer_types") is None:
        missing.append("layer_types")
    if missing:
        raise DrafterError(f"{where}: {DFLASH2} needs {', '.join(missing)} (dflash_config "
                           "or top level); a missing block size is never taken as 16")
    if raw.get("attention_bias"):
        raise DrafterError(f"{where}: attention_bias true is not supported (no bias in the "
                           "published drafters)")
    if raw.get("hidden_act", "silu") != "silu":
        raise DrafterError(f"{where}: hidden_act {raw['hidden_act']!r} is not supported "
                           "(silu)")


class DraftAttention(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.h, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.h * self.d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.hkv * self.d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.hkv * self.d, bias=False)
        self.o_proj = nn.Linear(self.h * self.d, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps, zero_centred=False)
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps, zero_centred=False)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, T, hidden] -> k, v [B, T, Hkv, D] (k normed and rotated)."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.hkv, self.d))
        return apply_rope(k, cos, sin), self.v_proj(x).view(b, t, self.hkv, self.d)

    def forward(self, h: torch.Tensor, cos, sin, ctx_k: torch.Tensor, ctx_v: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        b, t, _ = h.shape
        q = apply_rope(self.q_norm(self.q_proj(h).view(b, t, self.h, self.d)), cos, sin)
        k, v = self.kv(h, cos, sin)
        keys = torch.cat((ctx_k, k), dim=1)                            # [B, C+T, Hkv, D]
        values = torch.cat((ctx_v, v), dim=1)
        out = attention(q, keys, values, mask, self.d ** -0.5)          # [B, T, H, D]
        return self.o_proj(out.reshape(b, t, self.h * self.d))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.self_attn = DraftAttention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centred=False)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                                                zero_centred=False)
        self.convs = cfg.conv_kernel_size is not None
        if self.convs:
            size = (cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
            self.attention_conv = GroupedDynamicConv(*size)
            self.mlp_conv = GroupedDynamicConv(*size)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):
        u = self.input_layernorm(x)
        if not self.convs:
            x = x + self.self_attn(u, cos, sin, ctx_k, ctx_v, mask)
            return x + self.mlp(self.post_attention_layernorm(x))
        conv = self.attention_conv
        deltas = conv.deltas(u)
        a = self.self_attn(conv.mix(u, deltas, 0), cos, sin, ctx_k, ctx_v, mask)
        x = x + conv.mix(a, deltas, 1)
        v = self.post_attention_layernorm(x)
        conv = self.mlp_conv
        deltas = conv.deltas(v)
        return x + conv.mix(self.mlp(conv.mix(v, deltas, 0)), deltas, 1)


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(len(cfg.tap_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centred=False)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centred=False)
        if cfg.selects:
            self.candidate_selector = CandidateSelector(cfg.hidden_size, cfg.vocab_size,
                                                        cfg.selector_rank, cfg.selector_top_k)
        # compiled proposals (compiled_drafts.StaticDrafter), when set: one request's, and
        # a batch's requests' together
        self.static = None
        self.batch_static = None

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        return rope_cos_sin(positions, self.cfg.rope.rotary_dim, self.cfg.rope.theta, dtype)

    def context_features(self, taps: torch.Tensor) -> torch.Tensor:
        """Concatenated taps [B, T, n*hidden] -> context features [B, T, hidden]."""
        return self.hidden_norm(self.fc(taps))

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor):
        """Per-layer keys/values of context rows: list of (k, v) [B, T, Hkv, D]."""
        cos, sin = self.rope(positions, features.dtype)
        return [layer.self_attn.kv(features, cos, sin) for layer in self.layers]

    def block_mask(self, layer: int, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """[..., T, C+T] visibility of keys at k_pos [..., C+T] for queries at q_pos [..., T]."""
        diff = q_pos[..., :, None] - k_pos[..., None, :]
        visible = torch.ones_like(diff, dtype=torch.bool)
        causal = self.cfg.layer_causal[layer]
        if causal:
            visible &= diff >= 0
        window = self.cfg.layer_window[layer]
        if window is not None:
            visible &= (diff if causal else diff.abs()) < window
        return visible

    def forward(self, block_embeds: torch.Tensor, start: int | torch.Tensor, ctx_kv,
                ctx_pos: torch.Tensor, context_window: int | None = None) -> torch.Tensor:
        """Blocks [K, T, hidden] starting at positions `start` (int or [K]) -> normed hidden.

        ctx_kv: per layer (k, v) of the context rows, [1 or K, C, Hkv, D]; ctx_pos [C], or
        [K, C] where each block has a context of its own (a batch of requests' windows).
        A context row is visible to a block only if it precedes the block's anchor (and lies
        within `context_window` rows of it): at inference the window already holds only such
        rows; in training one context serves blocks at many anchors.
        """
        k, t = block_embeds.shape[:2]
        device = block_embeds.device
        start = torch.as_tensor(start, device=device).reshape(-1, 1).expand(k, 1)
        q_pos = start + torch.arange(t, device=device)                 # [K, T]
        cos, sin = self.rope(q_pos, block_embeds.dtype)
        ctx = ctx_pos if ctx_pos.dim() == 2 else ctx_pos[None, :].expand(k, -1)  # [K, C]
        k_pos = torch.cat((ctx, q_pos), dim=1)                         # [K, C+T]
        in_context = ctx < start
        if context_window is not None:
            in_context &= ctx >= start - context_window
        visible_ctx = torch.cat((in_context, torch.ones_like(q_pos, dtype=torch.bool)), dim=1)
        x = block_embeds * self.cfg.input_embedding_scale
        for i, layer in enumerate(self.layers):
            ck, cv = ctx_kv[i]
            mask = self.block_mask(i, q_pos, k_pos) & visible_ctx[:, None, :]  # [K, T, C+T]
            x = layer(x, cos, sin, ck.expand(k, -1, -1, -1), cv.expand(k, -1, -1, -1),
                      mask[:, None])
        return self.norm(x)

    def draft_logits(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        logits = (hidden @ lm_head_weight.T).float() * self.cfg.output_multiplier
        cap = self.cfg.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def draft_output(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor,
                     anchor: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """What drafts are read from, for the draft rows' hidden [n, H]: the logits [n, V];
        with a candidate selector, its candidates [n, K] and pair scores [n, K, K]."""
        logits = self.draft_logits(hidden, lm_head_weight)
        if not self.cfg.selects:
            return logits
        return self.candidate_selector.edge_scores(hidden, logits, anchor)


def load_drafter(path: str | Path, target: ModelConfig, dtype: torch.dtype,
                 device: str | torch.device, weights: str = "auto") -> DFlashDrafter:
    """Load and check a drafter directory; fails before any request if it does not fit.
    `weights` as for the target (a quantized drafter loads as stored, or is dequantized)."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise DrafterError(f"drafter directory {path} does not exist")
    cfg_file = path / "config.json"
    try:
        raw = json.loads(cfg_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DrafterError(f"{cfg_file}: not readable ({exc})") from exc
    cfg = DraftConfig.from_hf_dict(raw, str(cfg_file), target_layers=target.num_layers)
    cfg.check_target(target, str(path))
    try:
        scheme = read_scheme(path, raw)
    except WeightFormatError as exc:
        raise DrafterError(str(exc)) from exc
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise DrafterError(f"{path}: no *.safetensors weights")
    files: dict[str, Path] = {}
    for shard in shards:
        with open_shard(shard, DrafterError) as f:
            files.update(dict.fromkeys(f.keys(), shard))
    with torch.device("meta"):
        model = DFlashDrafter(cfg)
    model, _, _ = load_module(model, lambda ours: ours, files, dtype, device, scheme, weights,
                              DrafterError)
    return model
