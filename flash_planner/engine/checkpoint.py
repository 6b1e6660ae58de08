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
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from .config import ConfigError, ModelConfig
from .models.mtp import MTPHead
from .models.target import TargetModel

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
LOADABLE_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
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

    @property
    def weight_bytes(self) -> int:
        return sum(p.nbytes for p in self.model.parameters())


def read_config(path: Path) -> ModelConfig:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{path}: no config.json (is this a Hugging Face model directory?)")
    try:
        raw = json.loads(cfg_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{cfg_file}: not readable JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"{cfg_file}: expected a JSON object")
    try:
        return ModelConfig.from_hf_dict(raw, where=str(cfg_file))
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from exc


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
        with _open(shard) as f:
            files.update({name: shard for name in f.keys()})
    return files


def _open(shard: Path):
    try:
        return safe_open(str(shard), framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise CheckpointError(f"{shard}: not a readable safetensors file ({exc})") from exc


def _checkpoint_name(ours: str, cfg: ModelConfig) -> str:
    return ours if ours.startswith("lm_head.") else cfg.weight_prefix + ours


def _validate(module: torch.nn.Module, names: dict[str, str], files: dict[str, Path]) -> None:
    """Check every tensor `module` expects (ours -> checkpoint name) exists with the right
    shape and a loadable dtype, from the safetensors headers alone."""
    expected = {name: tuple(p.shape) for name, p in module.state_dict().items()}
    missing = [theirs for theirs in names.values() if theirs not in files]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise CheckpointError(f"checkpoint is missing tensor(s) {', '.join(missing[:3])}{more}")
    for shard, ours_list in _by_shard(names, files).items():
        with _open(shard) as f:
            for ours in ours_list:
                theirs = names[ours]
                sl = f.get_slice(theirs)
                shape, dtype = tuple(sl.get_shape()), sl.get_dtype()
                if shape != expected[ours]:
                    raise CheckpointError(f"{shard.name}: tensor {theirs} has shape "
                                          f"{list(shape)}, expected {list(expected[ours])}")
                if dtype not in LOADABLE_DTYPES:
                    raise CheckpointError(
                        f"{shard.name}: tensor {theirs} has dtype {dtype}; only "
                        f"{'/'.join(LOADABLE_DTYPES)} weights load (no quantized checkpoints)")


def _by_shard(names: dict[str, str], files: dict[str, Path]) -> dict[Path, list[str]]:
    by_shard: dict[Path, list[str]] = {}
    for ours, theirs in names.items():
        by_shard.setdefault(files[theirs], []).append(ours)
    return by_shard


def _load(module_cls, cfg: ModelConfig, names_of, files: dict[str, Path],
          dtype: torch.dtype, device: str | torch.device):
    """Build `module_cls(cfg)` without allocating, validate its tensors (`names_of(ours)`
    -> checkpoint name), then allocate on `device` and read each tensor once."""
    with torch.device("meta"):
        module = module_cls(cfg)
    names = {ours: names_of(ours) for ours in module.state_dict()}
    _validate(module, names, files)
    module = module.to_empty(device=device).to(dtype)
    params = dict(module.state_dict())
    with torch.no_grad():
        for shard, ours_list in _by_shard(names, files).items():
            with _open(shard) as f:
                for ours in ours_list:
                    params[ours].copy_(f.get_tensor(names[ours]))
    return module.eval(), names


def load_checkpoint(path: str | Path, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu", with_tokenizer: bool = True
                    ) -> Checkpoint:
    path = Path(path).expanduser()
    if not path.is_dir():
        raise CheckpointError(f"model directory {path} does not exist")
    cfg = read_config(path)
    files = weight_map(path)
    model, names = _load(TargetModel, cfg, lambda ours: _checkpoint_name(ours, cfg), files,
                         dtype, device)
    known = set(names.values())
    mtp = {n: s for n, s in files.items() if n.startswith(MTP_PREFIX)}
    ignored = [n for n in files if n not in known and n not in mtp
               and not n.startswith(IGNORED_PREFIXES) and n != "lm_head.weight"]
    if ignored:
        log.warning("%s: %d tensors not used by the text model, e.g. %s", path, len(ignored),
                    ignored[0])
    tokenizer = load_tokenizer(path) if with_tokenizer else None
    return Checkpoint(path, cfg, model, tokenizer, mtp)


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
        head, _ = _load(MTPHead, cfg, lambda ours: MTP_PREFIX + ours, checkpoint.mtp_weights,
                        dtype, device)
    except ConfigError as exc:
        raise CheckpointError(f"{where}: {exc}") from exc
    return head


def load_tokenizer(path: Path):
    """The directory's tokenizer, loaded offline; None when it ships none."""
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # transformers raises many types for a broken tokenizer
        raise CheckpointError(f"{path}: tokenizer files present but not loadable ({exc})") from exc
