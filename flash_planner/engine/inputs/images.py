"""Images into the vision tower's patches, as the checkpoint's image processor asks.

A vision-language checkpoint ships `preprocessor_config.json` (Qwen2-VL's image processor,
which Qwen3.5/3.6 use): patch size, merge size, temporal patch size, the pixel budget
(`size.shortest_edge` / `size.longest_edge`: the least and most pixels after resizing, or
`min_pixels` / `max_pixels` in older files), the normalisation's mean and std. An image:

1. is resized (bicubic, by Pillow) to the nearest sides that are multiples of
   patch x merge, keeping the aspect ratio, scaled down or up into the pixel budget;
2. becomes float RGB in [0, 1], normalised per channel;
3. is cut into P x P patches, laid out in merge-block order (models/qwen/vision.py) and repeated
   over the temporal patch size (a still image is a clip of identical frames):
   `[N, C * T * P * P]`, grid (1, h, w) in patches.

Pillow decodes and resizes (its bicubic filter is the processor's); the rest is numpy.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..config import ConfigError, read_json_object

PREPROCESSOR_FILE = "preprocessor_config.json"
# the processor's defaults where a file leaves a field out (Qwen2-VL's image processor)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT = 200
# the most pixels an image file may hold before it is decoded (a 4096 x 4096 frame);
# front doors pass their own limit (planning/images.py)
DECODE_PIXELS = 4096 * 4096


@dataclass(frozen=True)
class ImageConfig:
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD
    rescale_factor: float = 1 / 255

    @classmethod
    def from_dict(cls, raw: dict, where: str) -> ImageConfig:
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: expected a JSON object")
        size = raw.get("size") or {}
        values = dict(
            patch_size=raw.get("patch_size", cls.patch_size),
            merge_size=raw.get("merge_size", cls.merge_size),
            temporal_patch_size=raw.get("temporal_patch_size", cls.temporal_patch_size),
            min_pixels=size.get("shortest_edge", raw.get("min_pixels", cls.min_pixels)),
            max_pixels=size.get("longest_edge", raw.get("max_pixels", cls.max_pixels)))
        for key, value in values.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{where}: {key} must be a positive integer, got {value!r}")
        if values["min_pixels"] > values["max_pixels"]:
            raise ConfigError(f"{where}: the least pixels ({values['min_pixels']}) exceed the "
                              f"most ({values['max_pixels']})")
        channels = {}
        for key, name, default in (("image_mean", "mean", cls.mean),
                                   ("image_std", "std", cls.std)):
            value = raw.get(key, default)
            if (not isinstance(value, (list, tuple)) or len(value) != 3
                    or not all(isinstance(v, (int, float)) for v in value)):
                raise ConfigError(f"{where}: {key} must be three numbers, got {value!r}")
            channels[name] = tuple(float(v) for v in value)
        if not all(s > 0 for s in channels["std"]):
            raise ConfigError(f"{where}: image_std must be positive, got {channels['std']}")
        rescale = raw.get("rescale_factor", cls.rescale_factor)
        if raw.get("do_rescale", True) is False:
            rescale = 1.0
        return cls(**values, **channels, rescale_factor=float(rescale))

    @classmethod
    def load(cls, path: str | Path, **tower: int) -> ImageConfig:
        """From a model directory's preprocessor_config.json (the defaults without one);
        `tower`: the vision tower's patch_size, merge_size and temporal_patch_size, which
        the file may leave out and must not contradict."""
        file = Path(path) / PREPROCESSOR_FILE
        raw = read_json_object(file) if file.is_file() else {}
        for key, value in tower.items():
            if raw.get(key, value) != value:
                raise ConfigError(f"{file}: {key} {raw[key]} contradicts the vision tower's "
                                  f"{value} (config.json vision_config)")
        return cls.from_dict({**tower, **raw}, str(file))

    @property
    def factor(self) -> int:
        """What each resized side is a multiple of: one merged token's pixels across."""
        return self.patch_size * self.merge_size


def fitted_size(height: int, width: int, cfg: ImageConfig) -> tuple[int, int]:
    """The (height, width) an image is resized to: multiples of `cfg.factor` nearest its own,
    within the pixel budget, the aspect ratio kept as nearly as that allows."""
    if min(height, width) < 1:
        raise ValueError(f"an image of {height} x {width} pixels has nothing to see")
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ValueError(f"an image of {height} x {width} pixels is too elongated (aspect "
                         f"ratio at most {MAX_ASPECT})")
    f = cfg.factor
    h, w = round(height / f) * f, round(width / f) * f
    if h * w > cfg.max_pixels:
        scale = math.sqrt(height * width / cfg.max_pixels)
        h = max(f, math.floor(height / scale / f) * f)
        w = max(f, math.floor(width / scale / f) * f)
    elif h * w < cfg.min_pixels:
        scale = math.sqrt(cfg.min_pixels / (height * width))
        h = math.ceil(height * scale / f) * f
        w = math.ceil(width * scale / f) * f
    return h, w


@dataclass(frozen=True)
class ImagePatches:
    patches: torch.Tensor            # [N, C * T * P * P] float32, merge-block order
    grid: tuple[int, int, int]       # (t, h, w) in patches
    merge_unit: int                  # patches per image token (merge size squared)

    @property
    def tokens(self) -> int:
        """How many image tokens the tower makes of it (one per merge block)."""
        t, h, w = self.grid
        return t * h * w // self.merge_unit

    @functools.cached_property
    def key(self) -> str:
        """The patches' content hash (the vision input's cache key): computed once per
        image, though a planner request looks its embeddings up twice (ahead, at start)."""
        return hashlib.blake2b(self.patches.numpy().tobytes() + repr(self.grid).encode(),
                               digest_size=16).hexdigest()


def read_image(source: str | Path | bytes, cfg: ImageConfig, label: str | None = None,
               max_pixels: int = DECODE_PIXELS) -> ImagePatches:
    """An image file (or its bytes: PNG, JPEG, ...) -> its patches; a ValueError naming the
    source (or `label`, e.g. the flag that gave it) when it is not a readable image or holds
    more than `max_pixels` (checked from its header, before anything is decoded)."""
    import io
    import warnings

    Image = _pillow()
    where = label or ("the image bytes" if isinstance(source, bytes) else str(source))
    try:
        with warnings.catch_warnings():       # Pillow's bomb warning: `max_pixels` decides
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            opened = Image.open(io.BytesIO(source) if isinstance(source, bytes) else source)
        with opened as image:
            if image.width * image.height > max_pixels:
                raise ValueError(f"{where}: the image is {image.width} x {image.height} "
                                 f"pixels, the limit is {max_pixels} pixels")
            return to_patches(image, cfg)
    except Image.UnidentifiedImageError:   # an OSError whose text names a BytesIO
        raise ValueError(f"{where}: not a readable image (no format Pillow reads, or a "
                         "header it refuses, e.g. 0 x 0 pixels)") from None
    except OSError as exc:                 # truncated, corrupt
        raise ValueError(f"{where}: not a readable image ({exc})") from None
    except Image.DecompressionBombError as exc:
        raise ValueError(f"{where}: {exc}") from None
    except ValueError as exc:
        message = str(exc)
        raise ValueError(message if message.startswith(where) else f"{where}: {message}"
                         ) from None


def _pillow():
    try:
        from PIL import Image
    except ImportError:
        raise ValueError("images need Pillow: pip install 'flash_planner[vision]' "
                         "(or pillow)") from None
    return Image


def to_patches(image, cfg: ImageConfig) -> ImagePatches:
    """A Pillow image, or an RGB uint8 array [H, W, 3], -> its patches and grid."""
    Image = _pillow()
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
            raise ValueError(f"an image array must be uint8 [H, W, 3] (RGB), got "
                             f"{image.dtype} {list(image.shape)}")
        image = Image.fromarray(image, mode="RGB")
    image = image.convert("RGB")
    h, w = fitted_size(image.height, image.width, cfg)
    resized = image.resize((w, h), resample=Image.Resampling.BICUBIC)
    x = np.asarray(resized, dtype=np.float32) * np.float32(cfg.rescale_factor)
    x = (x - np.asarray(cfg.mean, np.float32)) / np.asarray(cfg.std, np.float32)
    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    gh, gw = h // p, w // p
    # [H, W, C] -> blocks (gh/m, gw/m), patches in a block (m, m), then C, P, P
    x = x.reshape(gh // m, m, p, gw // m, m, p, 3).transpose(0, 3, 1, 4, 6, 2, 5)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))
    patches = torch.from_numpy(np.ascontiguousarray(x).reshape(gh * gw, 3 * t * p * p))
    return ImagePatches(patches, (1, gh, gw), m * m)
