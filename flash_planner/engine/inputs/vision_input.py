"""A vision-language target's images, from patches to what its prefill takes.

`VisionInput` belongs to an engine whose checkpoint has a vision tower (`vision_config`):
it loads the tower on the first image (a text-only deployment never pays its memory),
keeps the embeddings of recent images keyed by their content (a robot re-sends the same
frame for a retry), and turns a prompt's image token runs and their images into
`PromptImages` (mrope.py) for `prefill.py`.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from ..models.qwen.vision import VisionTower
from .images import ImageConfig, ImagePatches
from .mrope import ImageSpan, PromptImages, expand_image_tokens, image_spans, prompt_positions


class VisionInput:
    def __init__(self, path: Path, raw: dict, image_token_id: int, dtype: torch.dtype,
                 device: torch.device, image_config: ImageConfig, cache_entries: int = 16):
        self.path, self.raw = path, raw          # the checkpoint's directory and config.json
        self.image_token_id = image_token_id
        self.dtype, self.device = dtype, device
        self.cache_entries = cache_entries
        self._tower: VisionTower | None = None
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[str, torch.Tensor] = collections.OrderedDict()
        self.image_config = image_config
        self.hits = 0                       # images whose embeddings came from the cache

    @property
    def tower(self) -> VisionTower:
        with self._lock:
            if self._tower is None:
                from ..checkpoint import load_vision_tower

                self._tower = load_vision_tower(self.path, self.dtype, self.device,
                                                self.raw)
            return self._tower

    @property
    def nbytes(self) -> int:
        """The tower's weights once loaded, and the cached embeddings."""
        with self._lock:
            tower = self._tower
            cached = sum(t.nbytes for t in self._cache.values())
        if tower is None:
            return cached
        return cached + sum(p.nbytes for p in tower.parameters())

    def embed(self, image: ImagePatches) -> torch.Tensor:
        """The tower's tokens for one image [tokens, hidden], from the cache when the same
        patches were embedded lately."""
        key = image.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return hit
        with torch.inference_mode():
            out = self.tower(image.patches.to(self.device), [image.grid])
        with self._lock:
            self._cache[key] = out
            while len(self._cache) > self.cache_entries:
                self._cache.popitem(last=False)
        return out

    def expand(self, ids: Sequence[int], images: Sequence[ImagePatches]) -> list[int]:
        """`ids` with one image token per image (a chat template's) expanded to each
        image's token count (`mrope.expand_image_tokens`)."""
        return expand_image_tokens(ids, self.image_token_id, [im.tokens for im in images])

    def prompt(self, ids: Sequence[int], images: Sequence[ImagePatches]) -> PromptImages:
        """The prompt's images as its prefill takes them; each image needs its own run of
        image tokens in `ids`, in order."""
        m = self.tower.cfg.spatial_merge_size
        starts = image_spans(ids, self.image_token_id, [im.tokens for im in images])
        spans = [ImageSpan(s, (im.grid[0], im.grid[1] // m, im.grid[2] // m))
                 for s, im in zip(starts, images)]
        positions, shift = prompt_positions(len(ids), spans)
        rows = torch.cat([torch.arange(s.start, s.start + s.tokens) for s in spans])
        embeddings = torch.cat([self.embed(im) for im in images])
        return PromptImages(rows.to(self.device), embeddings, positions.to(self.device), shift)


def vision_input(path: Path, raw: dict, dtype: torch.dtype, device: torch.device
                 ) -> VisionInput | None:
    """The engine's `VisionInput` when the checkpoint at `path` (its config.json `raw`) has a
    vision tower."""
    token = raw.get("image_token_id")
    vision = raw.get("vision_config")
    if not isinstance(token, int) or not isinstance(vision, dict):
        return None                     # a tower without an image token: no way to place it
    # the tower's own patch layout, where the processor's file leaves it out
    tower = {key: vision[name] for key, name in (("patch_size", "patch_size"),
                                                 ("merge_size", "spatial_merge_size"),
                                                 ("temporal_patch_size", "temporal_patch_size"))
             if isinstance(vision.get(name), int)}
    return VisionInput(path, raw, token, dtype, device, ImageConfig.load(path, **tower))
