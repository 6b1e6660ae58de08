"""The engine: one loaded target model, its tokenizer and its preallocated inference state.

`EngineConfig` says what to load and how much to preallocate; `Engine.load` does all the
heavy work up front (weights, KV cache, GDN state, step checkpoints) and reports the bytes
it holds. Requests that cannot fit are refused before prefill by `check_fits`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from .cache import KV_DTYPES, ContextOverflowError, InferenceState
from .checkpoint import Checkpoint, load_checkpoint
from .config import ConfigError
from .methods import METHODS
from .prefix import PrefixCache
from .proposer import Proposer
from .proposers import WHY_MISSING, ProposerBytes, build_proposers
from .trt.backends import DENSE_BACKENDS, make_dense
from .weights.scheme import WEIGHTS

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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
        if self.dense_backend not in DENSE_BACKENDS:
            raise ConfigError(f"dense_backend must be one of {DENSE_BACKENDS}, "
                              f"got {self.dense_backend!r}")
        if self.block_size is not None and not 2 <= self.block_size <= self.max_block:
            raise ConfigError(f"block_size must be within 2..max_block ({self.max_block}), "
                              f"got {self.block_size!r}")
        if isinstance(self.mtp_steps, int) and not 1 <= self.mtp_steps < self.max_block:
            raise ConfigError(f"mtp_steps must be within 1..max_block-1 ({self.max_block - 1}), "
                              f"got {self.mtp_steps!r}")
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

    def resolve_kv_dtype(self, compute: torch.dtype) -> torch.dtype:
        return compute if self.kv_dtype == "auto" else KV_DTYPES[self.kv_dtype]


@dataclass(frozen=True)
class MemoryReport:
    weights: int
    kv_cache: int
    gdn_state: int
    checkpoints: int
    weights_per_forward: int = 0   # what one target forward reads (decode is bound by it)

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.gdn_state + self.checkpoints

    def as_dict(self) -> dict[str, int]:
        return {"weights": self.weights, "kv_cache": self.kv_cache,
                "gdn_state": self.gdn_state, "checkpoints": self.checkpoints,
                "total": self.total, "weights_per_forward": self.weights_per_forward}

    def __str__(self) -> str:
        mib = 1 << 20
        return (f"weights {self.weights / mib:.1f} MiB, KV {self.kv_cache / mib:.1f} MiB, "
                f"GDN state {self.gdn_state / mib:.1f} MiB, step checkpoints "
                f"{self.checkpoints / mib:.1f} MiB, total {self.total / mib:.1f} MiB; one "
                f"target forward reads {self.weights_per_forward / mib:.1f} MiB of weights")


class Engine:
    def __init__(self, config: EngineConfig, checkpoint: Checkpoint, state: InferenceState,
                 device: torch.device, dtype: torch.dtype,
                 proposers: dict[str, Proposer] | None = None,
                 extra_bytes: ProposerBytes | None = None):
        self.config = config
        self.checkpoint = checkpoint
        self.model = checkpoint.model
        self.model_config = checkpoint.config
        self.tokenizer = checkpoint.tokenizer
        self.state = state
        self.device = device
        self.dtype = dtype
        # method -> proposer: dflash and/or mtp as loaded, auto (routing among them and
        # plain decoding) when the method is auto
        self.proposers = proposers or {}
        self.extra_bytes = extra_bytes or ProposerBytes(0, 0)
        self.prefix_cache = (PrefixCache(config.prefix_cache_entries) if config.prefix_cache
                             else None)

    @property
    def seed_tap_ids(self) -> tuple[int, ...]:
        """Every target layer a loaded proposer taps (what a prefix snapshot keeps)."""
        return tuple(sorted({t for p in self.proposers.values() for t in p.tap_ids}))

    @property
    def seed_rows(self) -> int:
        """The most prompt-tail rows a loaded proposer seeds from."""
        return max((p.seed_rows for p in self.proposers.values()), default=0)

    @property
    def proposer(self) -> Proposer | None:
        """The default proposer (config.method); None decodes plainly."""
        if self.config.method == "none" or not self.proposers:
            return None
        return self.proposers[self.config.method]

    def proposer_for(self, method: str | None) -> Proposer | None:
        """The proposer a request asks for: None = the default; 'none' = plain decoding."""
        if method is None:
            return self.proposer
        if method == "none":
            return None
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if method == "auto" and not self.proposers:
            return None       # nothing to route to: plain decoding
        if method not in self.proposers:
            loaded = ", ".join(self.proposers) or "none (plain decoding only)"
            raise ValueError(f"method {method!r} is not loaded in this engine (loaded: "
                             f"{loaded}); {WHY_MISSING[method]}")
        return self.proposers[method]

    @classmethod
    def load(cls, config: EngineConfig, progress: Callable[[str], None] | None = None
             ) -> Engine:
        """Load weights (and drafter), preallocate state, and set up the dense backend;
        `progress` receives one line per exported/built segment."""
        device = config.resolve_device()
        dtype = config.resolve_dtype(device)
        checkpoint = load_checkpoint(Path(config.model_path), dtype=dtype, device=device,
                                     weights=config.weights)
        if config.dense_backend != "torch":
            checkpoint.model.set_dense(make_dense(
                checkpoint.model, config.dense_backend, config.segment_cache,
                max_tokens=max(config.prefill_chunk, config.max_block),
                opt_tokens=config.max_block, progress=progress))
        state = InferenceState(checkpoint.config, capacity=config.max_context + config.max_block,
                               max_steps=config.max_block,
                               kv_dtype=config.resolve_kv_dtype(dtype), compute_dtype=dtype,
                               device=device)
        proposers, extra = build_proposers(config, checkpoint, state, dtype, device)
        engine = cls(config, checkpoint, state, device, dtype, proposers, extra)
        log.info("loaded %s on %s (%s, weights %s, dense segments: %s, proposers: %s): %s",
                 config.model_path, device, dtype, engine.weights_label,
                 checkpoint.model.dense.name, ", ".join(proposers) or "none", engine.memory)
        return engine

    @property
    def weights_label(self) -> str:
        """How the target's Linears are held, e.g. "fp8 block 128x128 (Qwen)" or "fp32"."""
        return ", ".join(sorted(self.checkpoint.quantized)) or str(self.dtype).split(".")[-1]

    @property
    def memory(self) -> MemoryReport:
        held, extra = self.state.nbytes, self.extra_bytes
        return MemoryReport(weights=self.checkpoint.weight_bytes + extra.weights,
                            kv_cache=held.kv + extra.kv, gdn_state=held.gdn_state,
                            checkpoints=held.checkpoints,
                            weights_per_forward=self.checkpoint.bytes_per_forward)

    def check_fits(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """Refuse, before any work, a request the preallocated context cannot hold."""
        if prompt_tokens == 0:
            raise ValueError("the prompt is empty")
        needed = prompt_tokens + max_new_tokens
        if needed > self.config.max_context:
            raise ContextOverflowError(
                f"prompt ({prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) = "
                f"{needed} exceeds max_context {self.config.max_context}")

    def eos_ids(self) -> tuple[int, ...]:
        ids = set(self.model_config.eos_token_ids)
        tok = self.tokenizer
        if tok is not None and getattr(tok, "eos_token_id", None) is not None:
            ids.add(tok.eos_token_id)
        return tuple(sorted(ids))
