"""Where the package's config lives, and model presets (config/models/*.yaml).

The config directory is found, in order, from `FLASH_PLANNER_CONFIG`, a source checkout
(editable installs, colcon --symlink-install), `<prefix>/share/flash_planner/config` (pip and
colcon installs), or the ament index when ROS is sourced. Preset paths starting with
`@assets/` point into the installed package's own data (the embedded demo model); a path
that is a Hugging Face repo id (`org/name[@revision]`) resolves through huggingface_hub's
cache (`sources.py`).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from ..engine.config import AUTO_MAX_BATCH, EngineConfig
from . import sources


class PresetError(ValueError):
    """A model preset or path that cannot be used; the message says which and why."""


def config_dir() -> Path:
    candidates = []
    if os.environ.get("FLASH_PLANNER_CONFIG"):
        candidates.append(Path(os.environ["FLASH_PLANNER_CONFIG"]))
    candidates.append(Path(__file__).resolve().parents[2] / "config")
    candidates.append(Path(sys.prefix) / "share" / "flash_planner" / "config")
    try:
        from ament_index_python.packages import get_package_share_directory

        candidates.append(Path(get_package_share_directory("flash_planner")) / "config")
    except Exception:  # ament_index is absent without ROS, or the package is not indexed
        pass
    for path in candidates:
        if (path / "skills.yaml").is_file():
            return path
    raise PresetError("cannot find flash_planner's config directory (looked in "
                      f"{', '.join(map(str, candidates))}); set FLASH_PLANNER_CONFIG")


ASSETS_PREFIX = "@assets/"


def asset_path(path: str | None) -> str | None:
    """Expand an `@assets/...` preset path to the package's data directory."""
    if path is None or not path.startswith(ASSETS_PREFIX):
        return path
    return str(Path(__file__).resolve().parents[1] / "assets" / path[len(ASSETS_PREFIX):])


def default_skills_path() -> Path:
    return config_dir() / "skills.yaml"


def preset_names() -> list[str]:
    return sorted(p.stem for p in (config_dir() / "models").glob("*.yaml"))


@dataclass(frozen=True)
class ModelPreset:
    name: str
    target_path: str
    drafter_path: str | None = None
    dtype: str = "auto"
    kv_dtype: str = "auto"
    weights: str = "auto"          # auto | bf16 | fp8 | nvfp4 | int4 (EngineConfig.weights)
    max_context: int = 4096
    block_size: int | None = None
    window: int = 128
    method: str = "auto"           # auto | dflash | mtp | none (EngineConfig.method)
    mtp_steps: int = 3
    relaxed_thinking: bool = False
    refusal_hint: bool = True      # tell the model the refusal shape (PlannerConfig)
    recovery: bool = False         # plans may retry and fall back (PlannerConfig.recovery)
    compile: str = "auto"          # off | on | auto (EngineConfig.compile: on CUDA by default)
    threads: int = 0               # torch CPU threads; 0 = auto (EngineConfig.threads)
    max_batch: int = 0             # requests decoded at once; 0 = auto (EngineConfig.max_batch)
    # how requests sample unless they say (PlannerConfig.sampling): a mode, greedy | model |
    # card, or a mapping per phase; model = the checkpoint's generation_config.json
    sampling: Any = "model"
    # passed to chat templates that take it (PlannerConfig.reasoning_effort: Qwen3.8's
    # xhigh | medium | low) unless a request says; None = the template's default
    reasoning_effort: str | None = None
    # where plans are made (PlannerConfig.backend): local | remote | remote_or_local, and the
    # remote's base url and model id (its key comes from the environment, never a preset)
    backend: str = "local"
    remote_url: str = ""
    remote_model: str = ""

    @classmethod
    def load(cls, name: str) -> ModelPreset:
        path = config_dir() / "models" / f"{name}.yaml"
        if not path.is_file():
            raise PresetError(f"unknown model preset '{name}' (available: "
                              f"{', '.join(preset_names()) or 'none'})")
        data = yaml.safe_load(path.read_text()) or {}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PresetError(f"{path}: unknown field(s) {unknown}")
        try:
            return cls(**{"name": name, **data})
        except TypeError as exc:
            raise PresetError(f"{path}: {exc}") from exc

    def repos(self) -> list[sources.RepoSource]:
        """The Hugging Face repos this preset's target and drafter come from."""
        found = (sources.parse(self.target_path), sources.parse(self.drafter_path))
        return [s for s in found if s is not None]

    def engine_config(self, allow_download: bool = False, progress=None,
                      **overrides: Any) -> EngineConfig:
        """The engine's config, repo ids (the preset's or an override's) resolved to local
        snapshots: downloaded only when `allow_download`, else a model missing from the
        cache raises SourceError naming the command that fetches it."""
        values = dict(model_path=self.target_path, drafter_path=self.drafter_path,
                      dtype=self.dtype, kv_dtype=self.kv_dtype, weights=self.weights,
                      max_context=self.max_context,
                      block_size=self.block_size, window=self.window, method=self.method,
                      mtp_steps=self.mtp_steps, compile=self.compile,
                      threads=self.threads, max_batch=self.max_batch)
        values.update({k: v for k, v in overrides.items() if v is not None})
        for key in ("model_path", "drafter_path"):
            values[key] = sources.resolve(asset_path(values[key]), allow_download, progress)
        return EngineConfig(**values)


def auto_max_batch(device: str) -> int:
    """max_batch 0's choice for a device setting (cpu, cuda[:N]; auto: the larger, since
    the device is not known before loading)."""
    if device == "auto":
        return max(AUTO_MAX_BATCH)
    return AUTO_MAX_BATCH[device != "cpu"]


def resolve_model(model: str) -> ModelPreset:
    """A model given as a checkpoint directory, a Hugging Face repo id or a preset name."""
    path = Path(model).expanduser()
    if path.is_dir():
        return ModelPreset(name=path.name, target_path=str(path))
    if sources.parse(model) is not None:
        return ModelPreset(name=model, target_path=model)
    if os.sep in model or model.startswith((".", "~")):
        raise PresetError(f"model directory {model} does not exist")
    return ModelPreset.load(model)
