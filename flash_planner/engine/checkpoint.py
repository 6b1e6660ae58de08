"""Load a Hugging Face model directory: config.json, safetensors (one file or sharded), tokenizer.

Every tensor's name, shape and dtype is checked from the safetensors headers before any data
is read, so a bad checkpoint fails with one error naming the file and tensor, never with a
half-loaded model. Qwen3.6 checkpoints (`Qwen3_5ForConditionalGeneration`) keep their text
weights under `model.language_model.`; vision weights are ignored and `mtp.*` weights (at
the top level in both layouts) are indexed, and loaded by `load_mtp_head` when asked for.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from .config import ConfigError, ModelConfig, read_json_object
from .models.drafters.mtp import MTPHead
from .models.flash_next.flash_next import FlashNextModel, open_ngram_tables
from .models.flash_next.flash_next_mtp import FlashNextHead
from .models.qwen.target import TargetModel
from .models.qwen.vision import VISION_PREFIX, VisionConfig, VisionTower
from .state.kv_scales import KVScales, read_kv_scales
from .weights.bytes import bytes_per_forward, module_bytes
from .weights.load import load_module, open_shard, stored_quantized
from .weights.scheme import UNQUANTIZED, WEIGHTS, Scheme, WeightFormatError, read_scheme

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
IGNORED_PREFIXES = ("model.visual.", "visual.")
MTP_PREFIX = "mtp."
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")


class CheckpointError(ValueError):
    """A model directory that cannot be loaded; the message names the file or tensor."""


@dataclass
class Checkpoint:
    path: Path
    config: ModelConfig
    model: TargetModel
    tokenizer: object | None
    mtp_weights: dict[str, Path] = field(default_factory=dict)  # tensor name -> shard
    scheme: Scheme = UNQUANTIZED          # how the checkpoint stores its Linears
    weights: str = "auto"                 # the `weights` setting it was loaded with
    quantized: dict[str, int] = field(default_factory=dict)  # layout label -> Linears
    raw_config: dict = field(default_factory=dict)   # config.json as read (vision_config...)
    kv_scales: KVScales | None = None     # the FP8 KV cache's scales, where it stores them

    @property
    def weight_bytes(self) -> int:
        return module_bytes(self.model)

    @property
    def bytes_per_forward(self) -> int:
        """Weights one single-token forward reads (an MoE reads top-k experts per layer)."""
        moe = self.config.moe
        return bytes_per_forward(self.model, moe.top_k if moe else None)


def read_config(path: Path) -> ModelConfig:
    return _parse_config(path, _raw_config(path))


def _raw_config(path: Path) -> dict:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{path}: no config.json (is this a Hugging Face model directory?)")
    return read_json_object(cfg_file, CheckpointError)


def _parse_config(path: Path, raw: dict) -> ModelConfig:
    try:
        return ModelConfig.from_hf_dict(raw, where=str(path / "config.json"))
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from exc


# where a text decoder's tensors may live; transformers' own save_pretrained writes either
# for the same text-only class (5.2 writes Qwen3_5ForCausalLM under model.language_model.,
# 5.24 under model.)
TEXT_PREFIXES = ("model.", "model.language_model.")


def stored_prefix(cfg: ModelConfig, files: dict[str, Path]) -> ModelConfig:
    """`cfg` with the prefix its decoder's tensors are stored under, when that is not the
    one its config implies (unchanged when neither holds the embeddings: the loader then
    names what is missing)."""
    if f"{cfg.weight_prefix}embed_tokens.weight" in files:
        return cfg
    for prefix in TEXT_PREFIXES:
        if f"{prefix}embed_tokens.weight" in files:
            log.info("the decoder's tensors are stored under %s (its config implies %s)",
                     prefix, cfg.weight_prefix)
            return replace(cfg, weight_prefix=prefix)
    return cfg


def weight_map(path: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from the index or the single file's header."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            entries = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: no readable 'weight_map' ({exc})") from exc
        files = {name: path / shard for name, shard in entries.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise CheckpointError(f"{index} lists shard {shard.name}, which is missing")
        return files
    shards = [path / SINGLE_FILE] if (path / SINGLE_FILE).is_file() else sorted(
        path.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"{path}: no weights ({SINGLE_FILE} or {INDEX_FILE} expected)")
    files: dict[str, Path] = {}
    for shard in shards:
        with open_shard(shard, CheckpointError) as f:
            files.update({name: shard for name in f.keys()})
    return files


def _checkpoint_name(ours: str, cfg: ModelConfig) -> str:
    return ours if ours.startswith("lm_head.") else cfg.weight_prefix + ours


def _load(module_cls, cfg: ModelConfig, names_of, files: dict[str, Path],
          dtype: torch.dtype, device: str | torch.device, scheme: Scheme, weights: str):
    """Build `module_cls(cfg)` without allocating, check its tensors (`names_of(ours)` ->
    checkpoint name) from the headers, then allocate on `device` and read each once."""
    with torch.device("meta"):
        module = module_cls(cfg)
    return load_module(module, names_of, files, dtype, device, scheme, weights,
                       CheckpointError)


def load_checkpoint(path: str | Path, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu", with_tokenizer: bool = True,
                    weights: str = "auto") -> Checkpoint:
    """`weights`: auto (as stored) | bf16 (full precision in `dtype`; a quantized checkpoint
    is dequantized) | fp8 | nvfp4 | int4 (a full-precision checkpoint quantized at load)."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise CheckpointError(f"model directory {path} does not exist")
    if weights not in WEIGHTS:
        raise CheckpointError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    raw = _raw_config(path)
    cfg = _parse_config(path, raw)
    try:
        scheme = read_scheme(path, raw)
    except WeightFormatError as exc:
        raise CheckpointError(str(exc)) from exc
    files = weight_map(path)
    cfg = stored_prefix(cfg, files)
    model_cls = TargetModel if cfg.flash_next is None else FlashNextModel
    if cfg.flash_next is not None and scheme.quantized:
        # its recipes leave modules plain that no exclusion names (the hyper-connection
        # mixers; compressed-tensors leaves transformers' fused experts, not Linears)
        scheme = as_stored(scheme, files)
    model, known, counts = _load(model_cls, cfg, lambda ours: _checkpoint_name(ours, cfg),
                                 files, dtype, device, scheme, weights)
    if cfg.flash_next is not None:
        known |= open_ngram_tables(model, files, lambda ours: _checkpoint_name(ours, cfg),
                                  CheckpointError)
    kv_scales = read_kv_scales(path, raw, cfg, files, CheckpointError)
    if kv_scales is not None:
        known |= kv_scales.names
    mtp = {n: s for n, s in files.items() if n.startswith(MTP_PREFIX)}
    ignored = [n for n in files if n not in known and n not in mtp
               and not n.startswith(IGNORED_PREFIXES) and n != "lm_head.weight"]
    if ignored:
        log.warning("%s: %d tensors not used by the text model, e.g. %s", path, len(ignored),
                    ignored[0])
    tokenizer = load_tokenizer(path) if with_tokenizer else None
    return Checkpoint(path, cfg, model, tokenizer, mtp, scheme, weights, dict(counts), raw,
                      kv_scales)


def load_mtp_head(checkpoint: Checkpoint, dtype: torch.dtype,
                  device: str | torch.device) -> MTPHead:
    """The checkpoint's `mtp.*` head, checked like the target's weights."""
    cfg, where = checkpoint.config, checkpoint.path
    if not cfg.is_hybrid:
        raise CheckpointError(f"{where}: {cfg.model_type} is a dense Qwen3 target; only "
                              "Qwen3.5/3.6 hybrid checkpoints carry an MTP head (use dflash)")
    if not checkpoint.mtp_weights:
        raise CheckpointError(f"{where}: the checkpoint has no {MTP_PREFIX}* tensors, so no "
                              "MTP head (some conversions drop it; use dflash or none)")
    if cfg.mtp_layers == 0:
        raise CheckpointError(f"{where}: {MTP_PREFIX}* tensors are present but config.json "
                              "has no mtp_num_hidden_layers")
    try:
        head_cls = MTPHead if cfg.flash_next is None else FlashNextHead
        head, _, _ = _load(head_cls, cfg, lambda ours: MTP_PREFIX + ours,
                           checkpoint.mtp_weights, dtype, device, checkpoint.scheme,
                           checkpoint.weights)
    except ConfigError as exc:
        raise CheckpointError(f"{where}: {exc}") from exc
    return head


def load_tokenizer(path: Path):
    """The directory's tokenizer, loaded offline; None when it ships none."""
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        return None
    try:
        return _tokenizer_class(path).from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # transformers raises many types for a broken tokenizer
        raise CheckpointError(f"{path}: tokenizer files present but not loadable ({exc})") from exc


def _tokenizer_class(path: Path):
    """The class tokenizer_config.json names where it is transformers' generic one over a
    tokenizer.json (TokenizersBackend, PreTrainedTokenizerFast: the demo's); else
    AutoTokenizer, whose import costs half a second of a start."""
    from transformers import PreTrainedTokenizerBase
    from transformers import tokenization_utils_tokenizers as generic

    try:
        name = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        name = None
    cls = getattr(generic, name, None) if isinstance(name, str) else None
    if isinstance(cls, type) and issubclass(cls, PreTrainedTokenizerBase):
        return cls
    from transformers import AutoTokenizer

    return AutoTokenizer


def load_vision_tower(path: str | Path, dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu", raw: dict | None = None
                      ) -> VisionTower:
    """The checkpoint's vision tower (`model.visual.*`), checked like the target's weights
    and loaded as stored: full precision, or the quantized layouts the checkpoint's
    quantization config gives its Linears (compressed-tensors recipes that do not ignore the
    tower quantize it too); a text-only checkpoint is refused naming its model type. `raw`:
    its config.json when already read."""
    path = Path(path).expanduser()
    raw = _raw_config(path) if raw is None else raw
    vision = raw.get("vision_config")
    if vision is None:
        raise CheckpointError(f"{path}: {raw.get('model_type', 'the model')} is a text-only "
                              "model (config.json has no vision_config): it cannot take images")
    try:
        cfg = VisionConfig.from_hf_dict(vision, where=str(path / "config.json"))
        scheme = read_scheme(path, raw)
    except (ConfigError, WeightFormatError) as exc:
        raise CheckpointError(str(exc)) from exc
    files = weight_map(path)
    # A quantization config written for the language model may not name the tower it left
    # in full precision (Qwen FP8's modules_to_not_convert, ModelOpt's exclude lists): the
    # tower loads as stored (compressed-tensors recipes that do not ignore it quantize it)
    tower, _, _ = _load(VisionTower, cfg, lambda ours: VISION_PREFIX + ours, files,
                        dtype, device, as_stored(scheme, files), "auto")
    return tower


def as_stored(scheme: Scheme, files: dict[str, Path]) -> Scheme:
    """`scheme`, except that a module stored as a plain weight (no quantization tensors
    beside it) loads as one: what a quantization config may leave in full precision without
    naming it."""
    return Scheme(scheme.label, lambda name: scheme.rule(name)
                  if stored_quantized(name, files) else None)
