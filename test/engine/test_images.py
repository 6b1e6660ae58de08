"""Images into patches (engine/inputs/images.py) against transformers' own Qwen2-VL image processor
(the Pillow one, which Qwen3.5/3.6 checkpoints name), over sizes that need rounding, scaling
down into the pixel budget and scaling up to its least."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from packaging.version import Version

from flash_planner.engine.config import ConfigError
from flash_planner.engine.inputs.images import ImageConfig, fitted_size, to_patches

PROCESSOR = {"patch_size": 4, "merge_size": 2, "temporal_patch_size": 2,
             "size": {"shortest_edge": 24 * 24, "longest_edge": 96 * 96},
             "image_mean": [0.5, 0.4, 0.3], "image_std": [0.2, 0.25, 0.3]}
SIZES = [(37, 53), (64, 64), (300, 100), (9, 14), (1000, 800), (17, 250)]


def _theirs(images):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    processor = Qwen2VLImageProcessorPil(**PROCESSOR)
    out = processor(images=images, return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


@pytest.mark.skipif(Version(transformers.__version__) < Version("5.24"),
                    reason="the reference is transformers 5.24's PIL image processor "
                           f"(image_processing_pil_qwen2_vl; installed: "
                           f"{transformers.__version__}, which has none)")
def test_patches_equal_the_image_processors(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    cfg = ImageConfig.load(tmp_path)
    assert (cfg.patch_size, cfg.min_pixels, cfg.max_pixels) == (4, 24 * 24, 96 * 96)
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in SIZES]
    want, grids = _theirs(images)
    ours = [to_patches(image, cfg) for image in images]
    assert [list(o.grid) for o in ours] == grids.tolist()
    torch.testing.assert_close(torch.cat([o.patches for o in ours]), want, rtol=0, atol=1e-6)
    for (h, w), o in zip(SIZES, ours):
        fh, fw = fitted_size(h, w, cfg)
        assert fh % 8 == fw % 8 == 0 and 24 * 24 <= fh * fw <= 96 * 96
        assert o.tokens == fh * fw // 64        # one token per 8 x 8 pixels (4 x 4 x merge 2)


def test_bad_images_and_configs_are_named():
    cfg = ImageConfig(patch_size=4)
    with pytest.raises(ValueError, match="uint8 \\[H, W, 3\\]"):
        to_patches(np.zeros((8, 8), np.uint8), cfg)
    with pytest.raises(ValueError, match="too elongated"):
        fitted_size(2, 500, cfg)
    with pytest.raises(ConfigError, match="patch_size must be a positive integer"):
        ImageConfig.from_dict({"patch_size": 0}, "p.json")
    with pytest.raises(ConfigError, match="image_std must be three numbers"):
        ImageConfig.from_dict({"image_std": [1, 2]}, "p.json")
    with pytest.raises(ConfigError, match="least pixels"):
        ImageConfig.from_dict({"min_pixels": 100, "max_pixels": 10}, "p.json")


def test_a_processor_file_that_contradicts_the_tower_is_refused(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"patch_size": 14}))
    with pytest.raises(ConfigError, match="patch_size 14 contradicts the vision tower's 16"):
        ImageConfig.load(tmp_path, patch_size=16, merge_size=2)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"image_mean": [0, 0, 0]}))
    cfg = ImageConfig.load(tmp_path, patch_size=16, merge_size=2)      # left out: the tower's
    assert (cfg.patch_size, cfg.merge_size, cfg.mean) == (16, 2, (0.0, 0.0, 0.0))
