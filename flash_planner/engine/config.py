"""Model and engine configuration as frozen dataclasses.

`EngineConfig` says what an engine loads and how much state it preallocates; it sits here,
below both `engine.py` and the proposers that read it, so neither imports the other.

`ModelConfig.from_hf_dict` reads a Hugging Face `config.json` of a Qwen3 dense model, a
Qwen3.5/3.6 hybrid (text-only `qwen3_5_text`, or the multimodal `qwen3_5` wrapper whose text
part sits under `text_config`), or either family's mixture-of-experts variant (`qwen3_moe`,
`qwen3_5_moe[_text]`: `MoeConfig`). Anything we cannot run raises `ConfigError` naming the
field.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from .flash_next_config import INDEXED_ATTENTION, FlashNextConfig
from .flash_next_config import parse as parse_flash_next
from .methods import METHODS
from .weights.scheme import WEIGHTS

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"

# model_type -> family. The hybrid family has GDN layers, gated attention and (1 + w) norms.
# The *_moe types have a sparse mixture-of-experts MLP (models/qwen/moe.py) in place of the
# dense one.
SUPPORTED_MODEL_TYPES = {
    "qwen3": "dense",
    "qwen3_moe": "dense",
    "qwen3_5": "hybrid",
    "qwen3_5_text": "hybrid",
    "qwen3_5_moe": "hybrid",
    "qwen3_5_moe_text": "hybrid",
    "qwen4_exp": "hybrid",          # Qwen3.8-Flash-Next: flash_next_config.py
    "qwen4_exp_text": "hybrid",
}
# Multimodal wrappers whose text part sits under text_config
WRAPPERS = ("qwen3_5", "qwen3_5_moe", "qwen4_exp")


def cache_home() -> Path:
    """The root of everything flash_planner caches on disk (compiled graphs, built engine
    segments, fetched peer sources): $FLASH_PLANNER_CACHE, else $XDG_CACHE_HOME/flash_planner,
    else ~/.cache/flash_planner."""
    if os.environ.get("FLASH_PLANNER_CACHE"):
        return Path(os.environ["FLASH_PLANNER_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flash_planner"


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# KV cache storage: fp8 rows are e4m3 bytes (uint8) with a scale per row and head
KV_DTYPES = {**DTYPES, "fp8": torch.uint8}
DENSE_BACKENDS = ("torch", "onnxruntime", "tensorrt", "auto")
COMPILE_MODES = ("off", "on", "auto")


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


def read_json_object(file: Path, error: type[Exception] = ConfigError) -> dict:
    """A JSON file holding an object; `error` naming the file when it is not one."""
    try:
        raw = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"{file}: not readable JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise error(f"{file}: expected a JSON object")
    return raw


@dataclass(frozen=True)
class RopeConfig:
    """Neox-style rotary embedding over the first `rotary_dim` dims of each head."""

    theta: float
    rotary_dim: int
    # Qwen3.5/3.6 mRoPE: how many rotary pairs turn with an image token's (t, h, w) position,
    # interleaved (pair j: h where j % 3 == 1 and j < 3 h, w where j % 3 == 2 and j < 3 w,
    # t otherwise); None: 1-D only. Text has equal positions on all three axes, so for text
    # it is plain 1-D RoPE either way.
    mrope_section: tuple[int, int, int] | None = None

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
        section = params.get("mrope_section")
        if section is not None:
            if (not isinstance(section, (list, tuple)) or len(section) != 3
                    or not all(isinstance(v, int) and v >= 0 for v in section)
                    or sum(section) != rotary_dim // 2):
                raise ConfigError(f"{where}: mrope_section {section!r} must be three "
                                  f"non-negative integers summing to {rotary_dim // 2}, the "
                                  "rotary pairs")
            section = tuple(section)
        return cls(theta=float(theta), rotary_dim=rotary_dim, mrope_section=section)


@dataclass(frozen=True)
class MoeConfig:
    """The sparse MLP: a router over `num_experts` SwiGLU experts, `top_k` chosen per token,
    and (Qwen3.5/3.6 MoE) a shared expert scaled by a sigmoid gate."""

    num_experts: int
    top_k: int
    expert_intermediate: int       # moe_intermediate_size
    shared_intermediate: int = 0   # shared_expert_intermediate_size; 0: no shared expert
    norm_topk: bool = True         # divide the k chosen probabilities by their sum
    dense_layers: tuple[int, ...] = ()   # mlp_only_layers and those decoder_sparse_step skips

    def is_sparse(self, i: int) -> bool:
        return i not in self.dense_layers

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], model_type: str, num_layers: int,
                     where: str) -> MoeConfig | None:
        if not model_type.startswith(("qwen3_moe", "qwen3_5_moe", "qwen4_exp")):
            return None
        # transformers' Qwen3MoeConfig saves num_experts as num_local_experts
        experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        if experts is None:
            raise ConfigError(f"{where}: required field 'num_experts' is missing")
        experts = _positive(experts, "num_experts", where)
        top_k = _positive(_require(cfg, "num_experts_per_tok", where), "num_experts_per_tok",
                          where)
        if top_k > experts:
            raise ConfigError(f"{where}: num_experts_per_tok {top_k} exceeds num_experts "
                              f"{experts}")
        inter = _positive(_require(cfg, "moe_intermediate_size", where),
                          "moe_intermediate_size", where)
        if model_type.startswith(("qwen3_5_moe", "qwen4_exp")):
            # every layer sparse, a shared expert, always renormalised (transformers 5.23)
            shared = _positive(_require(cfg, "shared_expert_intermediate_size", where),
                               "shared_expert_intermediate_size", where)
            return cls(experts, top_k, inter, shared)
        step = _positive(cfg.get("decoder_sparse_step", 1), "decoder_sparse_step", where)
        only = cfg.get("mlp_only_layers") or []
        if not isinstance(only, list) or any(not isinstance(i, int) for i in only):
            raise ConfigError(f"{where}: mlp_only_layers must be a list of layer indices")
        dense = tuple(i for i in range(num_layers) if i in only or (i + 1) % step)
        return cls(experts, top_k, inter, 0, bool(cfg.get("norm_topk_prob", False)), dense)


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
    moe: MoeConfig | None = None   # the sparse MLP of *_moe models; None: every MLP is dense
    flash_next: FlashNextConfig | None = None   # qwen4_exp's additions (hyper-connections...)
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_hybrid(self) -> bool:
        return self.family == "hybrid"

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    def is_sparse_layer(self, i: int) -> bool:
        """Whether decoder layer i's MLP is the mixture of experts."""
        return self.moe is not None and self.moe.is_sparse(i)

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
        if model_type in WRAPPERS:  # multimodal wrapper: text part under text_config
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

        moe = MoeConfig.from_hf_dict(cfg, model_type, num_layers, where)
        rope = RopeConfig.from_hf_dict(cfg, head_dim, where)
        flash_next = (parse_flash_next(cfg, hidden, head_dim, rope.rotary_dim, layer_types,
                                       LINEAR_ATTENTION, eos_ids, where, ConfigError)
                      if model_type.startswith("qwen4_exp") else None)
        # Qwen3.5/3.6 MoE configs have no dense MLP and so no intermediate_size
        dense_mlp = moe is None or any(not moe.is_sparse(i) for i in range(num_layers))
        intermediate = (_positive(_require(cfg, "intermediate_size", where),
                                  "intermediate_size", where) if dense_mlp
                        else int(cfg.get("intermediate_size") or 0))
        return cls(
            model_type=model_type,
            family=family,
            vocab_size=_positive(_require(cfg, "vocab_size", where), "vocab_size", where),
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_layers=num_layers,
            layer_types=layer_types,
            num_heads=num_heads,
            num_kv_heads=num_kv,
            head_dim=head_dim,
            rope=rope,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 0),
            weight_prefix=prefix,
            mtp_layers=int(cfg.get("mtp_num_hidden_layers") or 0),
            mtp_dedicated_embeddings=bool(cfg.get("mtp_use_dedicated_embeddings", False)),
            moe=moe,
            flash_next=flash_next,
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
    if types is not None:       # qwen4_exp: a full-attention layer runs the QSA indexer
        types = [FULL_ATTENTION if t == INDEXED_ATTENTION else t for t in types]
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


# max_batch auto, (CPU, GPU). On a CPU, bench/batch.py's choice (docs/performance.md,
# "Several requests at once"). On a GPU the figure, not yet measured here: a batch's
# forwards compile per batch bucket (a lone request in it runs the graphs it runs alone),
# and a verify of 8 reads the weights once, as a verify of one does.
AUTO_MAX_BATCH = (8, 8)


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    dtype: str = "auto"          # auto | fp32 | bf16 | fp16  (auto: bf16 on CUDA, fp32 on CPU)
    kv_dtype: str = "auto"       # auto | fp32 | bf16 | fp16 | fp8  (auto: the compute dtype)
    device: str = "auto"         # auto | cpu | cuda[:N]
    max_context: int = 4096      # prompt + generated tokens
    prefill_chunk: int = 256
    max_block: int = 16          # the largest verify block (speculative) the state must hold
    drafter_path: str | None = None   # a DFlash drafter directory; None = plain decoding
    block_size: int | None = None     # verify block (anchor + drafts); None = the drafter's
    window: int = 128                 # drafter context window, committed tokens
    window_seed: bool = True          # seed the window from the prompt's tail at prefill
    method: str = "auto"              # auto | dflash | mtp | none: the default proposer
    mtp_steps: int = 3                # drafts per cycle of the MTP head (verify block k+1)
    dense_backend: str = "torch"      # torch | onnxruntime | tensorrt | auto
    segment_cache: str | None = None  # exported/built segments; None = ~/.cache/flash_planner
    prefix_cache: bool = True         # keep the state of declared prompt prefixes
    prefix_cache_entries: int = 2     # snapshots kept (least recently used dropped)
    weights: str = "auto"             # auto | bf16 | fp8 | nvfp4 | int4 (quantized at load)
    compile: str = "auto"             # off | on | auto: decode/verify as compiled static-shape
                                      # graphs (CUDA graphs on a GPU); auto = on on CUDA
    compile_cache: str | None = None  # compiled graphs on disk; None = ~/.cache/flash_planner
    compile_lazy: bool = True         # on a CPU, the rarer row buckets and a batch's for
                                      # several requests compile in the background after
                                      # warm-up, their forwards eager until then
                                      # (StaticGraphs.warm_up); False: all at warm-up
    threads: int = 0                  # torch intra-op threads; 0 = auto (threads.py)
    max_batch: int = 0                # requests decoded at once (batch.py); 0 = auto:
                                      # AUTO_MAX_BATCH for the device

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be auto or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.kv_dtype != "auto" and self.kv_dtype not in KV_DTYPES:
            raise ConfigError(
                f"kv_dtype must be auto or one of {sorted(KV_DTYPES)}, got {self.kv_dtype!r}")
        if not (self.device in ("auto", "cpu") or self.device.startswith("cuda")):
            raise ConfigError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.weights not in WEIGHTS:
            raise ConfigError(f"weights must be one of {WEIGHTS}, got {self.weights!r}")
        if self.method not in METHODS:
            raise ConfigError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.compile not in COMPILE_MODES:
            raise ConfigError(f"compile must be one of {COMPILE_MODES}, got {self.compile!r}")
        if self.compile == "on" and self.dense_backend != "torch":
            raise ConfigError(f"compile 'on' runs the dense parts inside its compiled graphs; "
                              f"it cannot be combined with dense_backend "
                              f"{self.dense_backend!r} (use one or the other)")
        if self.dense_backend not in DENSE_BACKENDS:
            raise ConfigError(f"dense_backend must be one of {DENSE_BACKENDS}, "
                              f"got {self.dense_backend!r}")
        if not isinstance(self.threads, int) or isinstance(self.threads, bool) \
                or self.threads < 0:
            raise ConfigError(f"threads must be a non-negative integer (0 = auto), "
                              f"got {self.threads!r}")
        if self.block_size is not None and not 2 <= self.block_size <= self.max_block:
            raise ConfigError(f"block_size must be within 2..max_block ({self.max_block}), "
                              f"got {self.block_size!r}")
        if isinstance(self.mtp_steps, int) and not 1 <= self.mtp_steps < self.max_block:
            raise ConfigError(f"mtp_steps must be within 1..max_block-1 ({self.max_block - 1}), "
                              f"got {self.mtp_steps!r}")
        if not isinstance(self.max_batch, int) or isinstance(self.max_batch, bool) \
                or self.max_batch < 0:
            raise ConfigError(f"max_batch must be a non-negative integer (0 = auto), "
                              f"got {self.max_batch!r}")
        for name in ("max_context", "prefill_chunk", "max_block", "window", "mtp_steps",
                     "prefix_cache_entries"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown engine setting(s) {unknown}; known: {sorted(known)}")
        return cls(**values)

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device 'cuda' requested but no CUDA GPU is available")
        return device

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return DTYPES[self.dtype]

    def resolve_compile(self, device: torch.device) -> bool:
        """Whether decode and verify run compiled: on, or auto on a CUDA device."""
        return self.compile == "on" or (self.compile == "auto" and device.type == "cuda"
                                        and self.dense_backend == "torch")

    def resolve_max_batch(self, device: torch.device) -> int:
        """Requests decoded at once: max_batch, or auto's measured choice for the device."""
        return self.max_batch or AUTO_MAX_BATCH[device.type == "cuda"]

    def resolve_kv_dtype(self, compute: torch.dtype) -> torch.dtype:
        return compute if self.kv_dtype == "auto" else KV_DTYPES[self.kv_dtype]
