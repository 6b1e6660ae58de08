"""A copy of the demo target whose final norm weight is NaN: its files are sound, so it
loads, and every forward's logits are NaN, so its warm-up is where a front door refuses it
(the CLI, serve and node tests of a model that cannot decode)."""

from __future__ import annotations

import shutil
from pathlib import Path


def write_nan_demo(path: Path) -> Path:
    """The demo target at `path` with `model.norm.weight` all NaN."""
    from safetensors.torch import load_file, save_file

    from flash_planner.planning.presets import asset_path

    shutil.copytree(asset_path("@assets/demo/target"), path)
    weights = load_file(path / "model.safetensors")
    weights["model.norm.weight"].fill_(float("nan"))
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path
