"""Model and engine configuration as frozen dataclasses.

`ModelConfig.from_hf_dict` reads a Hugging Face `config.json` of a Qwen3 dense model or a
Qwen3.5/3.6 hybrid (text-only `qwen3_5_text`, or the multimodal `qwen3_5` wrapper whose text
part sits under `text_config`). Anything we cannot run raises `ConfigError` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"

# model_type -> family. The hybrid family has GDN layers, gated attention and (1 + w) norms.
SUPPORTED_MODEL_TYPES = {
    "qwen3": "dense",
    "qwen3_5": "hybrid",
    "qwen3_5_text": "hybrid",
}


class ConfigError(ValueError):
    """A model or engine configuration that cannot be run; the message names the field."""


def _require(cfg: dict[str, Any], key: str, where: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ConfigError(f"{where}: required field '{key}' is missing")
    return cfg[key]


def _positive(value: Any, name: str, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{where}: field '{name}' must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class RopeConfig:
    """Neox-style rotary embedding over the first `rotary_dim` dims of each head."""

    theta: float
    rotary_dim: int

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], head_dim: int, where: str) -> RopeConfig:
        params = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or {}
        rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
        # Text-only mRoPE has identical positions on all three axes, so it is plain 1-D RoPE.
        if rope_type not in (None, "default", "mrope"):
            raise ConfigError(f"{where}: rope_type '{rope_type}' is not supported (only default)")
        theta = params.get("rope_theta", cfg.get("rope_theta"))
        if theta is None:
            raise ConfigError(f"{where}: required field 'rope_theta' is missing")
        factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        rotary_dim = int(head_dim * factor)
        if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
            raise ConfigError(
                f"{where}: partial_rotary_factor {factor} gives rotary dim {rotary_dim}, "
                f"which must be even and within head_dim {head_dim}"
            )
        return cls(theta=float(theta), rotary_dim=rotary_dim)


@dataclass(frozen=True)
class ModelConfig:
    """The target model's architecture. `layer_types[i]` is full_attention or linear_attention."""

    model_type: str
    family: str  # "dense" (Qwen3) or "hybrid" (Qwen3.5/3.6)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: RopeConfig
    rms_norm_eps: float
    tie_word_embeddings: bool
    # Gated DeltaNet (hybrid only; zero elsewhere)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0
    eos_token_ids: tuple[int, ...] = ()
    max_position_embeddings: int = 0
    # Where the text weights live in the checkpoint ("model." or "model.language_model.").
    weight_prefix: str = "model."
    mtp_layers: int = 0            # mtp_num_hidden_layers: decoder layers of the MTP head
    mtp_dedicated_embeddings: bool = False
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_hybrid(self) -> bool:
        return self.family == "hybrid"

    @property
    def zero_centred_norm(self) -> bool:
        """Qwen3.5 norms compute x_hat * (1 + w); Qwen3 norms compute x_hat * w."""
        return self.is_hybrid

    @property
    def attn_output_gate(self) -> bool:
        """Qwen3.5 full attention emits [q | gate] per head and multiplies by sigmoid(gate)."""
        return self.is_hybrid

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def gdn_conv_dim(self) -> int:
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], where: str = "config.json") -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            supported = ", ".join(sorted(SUPPORTED_MODEL_TYPES))
            raise ConfigError(
                f"{where}: model_type {model_type!r} is not supported (supported: {supported})"
            )
        family = SUPPORTED_MODEL_TYPES[model_type]
        cfg = raw
        prefix = "model."
        if model_type == "qwen3_5":  # multimodal wrapper: text part under text_config
            cfg = dict(_require(raw, "text_config", where))
            cfg.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
            prefix = "model.language_model."
            where = f"{where} (text_config)"
        archs = raw.get("architectures") or []
        if any("ConditionalGeneration" in a for a in archs):
            prefix = "model.language_model."

        hidden = _positive(_require(cfg, "hidden_size", where), "hidden_size", where)
        num_layers = _positive(
            _require(cfg, "num_hidden_layers", where), "num_hidden_layers", where)
        num_heads = _positive(
            _require(cfg, "num_attention_heads", where), "num_attention_heads", where)
        num_kv = _positive(cfg.get("num_key_value_heads", num_heads), "num_key_value_heads", where)
        if num_heads % num_kv:
            raise ConfigError(f"{where}: num_attention_heads {num_heads} is not a multiple of "
                              f"num_key_value_heads {num_kv}")
        head_dim = _positive(cfg.get("head_dim") or hidden // num_heads, "head_dim", where)
        layer_types = _layer_types(cfg, family, num_layers, where)
        eos = cfg.get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))

        gdn: dict[str, int] = {}
        if family == "hybrid":
            for key, name in (("linear_num_key_heads", "linear_num_key_heads"),
                              ("linear_num_value_heads", "linear_num_value_heads"),
                              ("linear_key_head_dim", "linear_key_head_dim"),
                              ("linear_value_head_dim", "linear_value_head_dim"),
                              ("linear_conv_kernel", "linear_conv_kernel_dim")):
                gdn[key] = _positive(_require(cfg, name, where), name, where)
            if gdn["linear_num_value_heads"] % gdn["linear_num_key_heads"]:
                raise ConfigError(f"{where}: linear_num_value_heads must be a multiple of "
                                  "linear_num_key_heads")

        return cls(
            model_type=model_type,
            family=family,
            vocab_size=_positive(_require(cfg, "vocab_size", where), "vocab_size", where),
            hidden_size=hidden,
            intermediate_size=_positive(
                _require(cfg, "intermediate_size", where), "intermediate_size", where),
            num_layers=num_layers,
            layer_types=layer_types,
            num_heads=num_heads,
            num_kv_heads=num_kv,
            head_dim=head_dim,
            rope=RopeConfig.from_hf_dict(cfg, head_dim, where),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 0),
            weight_prefix=prefix,
            mtp_layers=int(cfg.get("mtp_num_hidden_layers") or 0),
            mtp_dedicated_embeddings=bool(cfg.get("mtp_use_dedicated_embeddings", False)),
            extra=raw,
            **gdn,
        )


def _layer_types(cfg: dict[str, Any], family: str, n: int, where: str) -> tuple[str, ...]:
    if family == "dense":
        types = cfg.get("layer_types")
        if types and any(t != FULL_ATTENTION for t in types):
            # Qwen3 sliding-window layers would need a windowed mask; no Qwen3 release uses them.
            raise ConfigError(f"{where}: layer_types other than full_attention are not supported "
                              "for qwen3 (sliding window)")
        return (FULL_ATTENTION,) * n
    types = cfg.get("layer_types")
    if types is None:
        interval = _positive(cfg.get("full_attention_interval", 4), "full_attention_interval",
                             where)
        types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION
                 for i in range(n)]
    if len(types) != n:
        raise ConfigError(f"{where}: layer_types has {len(types)} entries, "
                          f"num_hidden_layers is {n}")
    unknown = sorted({t for t in types} - {FULL_ATTENTION, LINEAR_ATTENTION})
    if unknown:
        raise ConfigError(f"{where}: unknown layer_types {unknown}")
    return tuple(types)
