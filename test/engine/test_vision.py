"""The vision tower (engine/models/vision.py) against transformers' own, on tiny random
Qwen3.5 / Qwen3.5-MoE vision-language checkpoints written by `save_pretrained`."""

from __future__ import annotations

import pytest
import torch

from flash_planner.engine.checkpoint import CheckpointError, load_vision_tower
from flash_planner.engine.config import ConfigError
from flash_planner.engine.models.vision import VisionConfig

# (t, h, w) in patches: square and not, one frame each (an image) and two (a pair of frames)
GRIDS = [[(1, 4, 4)], [(1, 6, 8), (1, 2, 4)], [(2, 4, 6)], [(1, 10, 6), (1, 4, 4), (1, 8, 2)]]


def _transformers_model(path):
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    cls = getattr(transformers, config.architectures[0])
    return cls.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def wide_towers(checkpoints, tmp_path_factory):
    """kind -> a copy of the tiny checkpoint whose tower has weights of std 0.2 (the written
    ones, std 0.02, leave every activation near 0, where GELU's two forms agree to 1e-7)."""
    made = {}

    def get(kind):
        if kind not in made:
            model = _transformers_model(checkpoints(kind))
            gen = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for p in model.model.visual.parameters():
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (p.dim() == 1))
            path = tmp_path_factory.mktemp(kind)
            model.save_pretrained(path)
            made[kind] = path, model.model.visual
        return made[kind]

    return get


@pytest.mark.parametrize("kind", ["hybrid_vl", "hybrid_moe_vl"])
def test_the_tower_equals_transformers_for_images_of_several_sizes(wide_towers, kind):
    path, theirs = wide_towers(kind)
    ours = load_vision_tower(path)
    gen = torch.Generator().manual_seed(0)
    for grids in GRIDS:
        n = sum(t * h * w for t, h, w in grids)
        patches = torch.randn(n, ours.cfg.patch_dim, generator=gen)
        with torch.no_grad():
            want = theirs(patches, grid_thw=torch.tensor(grids)).pooler_output
            got = ours(patches, grids)
        m2 = ours.cfg.spatial_merge_size ** 2
        assert got.shape == (n // m2, ours.cfg.out_hidden_size) == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_text_only_checkpoint_has_no_tower_and_says_so(checkpoints):
    with pytest.raises(CheckpointError, match="text-only.*cannot take images"):
        load_vision_tower(checkpoints("hybrid"))


def test_patches_that_do_not_fit_their_grids_are_refused(checkpoints):
    tower = load_vision_tower(checkpoints("hybrid_vl"))
    d = tower.cfg.patch_dim
    with pytest.raises(ValueError, match="hold 16 patches, got 12"):
        tower(torch.zeros(12, d), [(1, 4, 4)])
    with pytest.raises(ValueError, match="multiples of spatial_merge_size 2"):
        tower(torch.zeros(15, d), [(1, 3, 5)])
    with pytest.raises(ValueError, match=rf"\[N, {d}\]"):
        tower(torch.zeros(16, d + 1), [(1, 4, 4)])


def test_a_vision_config_names_the_field_it_cannot_use():
    good = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=4,
                out_hidden_size=64, num_position_embeddings=16)
    assert VisionConfig.from_hf_dict(good, "x").patch_dim == 3 * 2 * 4 * 4
    for field, value, message in [("num_heads", 0, "num_heads must be a positive integer"),
                                  ("num_position_embeddings", 15, "not a square grid"),
                                  ("hidden_act", "relu6", "hidden_act 'relu6'"),
                                  ("hidden_size", 36, "head size divisible by 4")]:
        with pytest.raises(ConfigError, match=message):
            VisionConfig.from_hf_dict({**good, field: value}, "x")
