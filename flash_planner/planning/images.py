"""Images a request carries, from each front door's form to the engine's patches.

Every front door hands the planner `ImageSource`s: encoded bytes (a file given to
`flash-planner plan --image`), a data URL (`/v1/plans`, `/v1/chat/completions`' `image_url`
parts, a JSON `~/task` message), an http(s) URL (only where `ImageLimits.allow_urls`), or RGB
pixels (a `sensor_msgs/Image`, converted by the ROS layer). `request_images` checks them
against the limits and turns them into the vision tower's patches with the checkpoint's own
image processing (engine/inputs/images.py): what reaches the engine is the same whichever door an
image came through. Every refusal is a `RequestError` naming the image's field.
"""

from __future__ import annotations

import base64
import binascii
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..engine.inputs.images import DECODE_PIXELS, ImagePatches, read_image, to_patches
from .request_error import RequestError

MAX_IMAGES = 4
MAX_IMAGE_BYTES = 8 << 20


@dataclass(frozen=True)
class ImageLimits:
    max_images: int = MAX_IMAGES          # per request
    # of one image as sent (width x height); the tower sees at most its processor's
    # max_pixels after resizing, so this bounds the decode: a "decompression bomb" is
    # refused from its header
    max_pixels: int = DECODE_PIXELS
    max_bytes: int = MAX_IMAGE_BYTES      # of one image as sent (encoded, or raw pixels)
    allow_urls: bool = False              # fetch http(s) image URLs (off: data URLs only)
    url_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("max_images", "max_pixels", "max_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not self.url_timeout_s > 0:
            raise ValueError(f"url_timeout_s must be positive, got {self.url_timeout_s!r}")


@dataclass(frozen=True)
class ImageSource:
    """One image as a front door received it; `label` names it in every error (the field
    it came in, e.g. "images[1]", "goal.images[0]", "--image cup.png")."""
    data: bytes | str | np.ndarray      # encoded bytes, a data/http(s) URL, RGB uint8 [H, W, 3]
    label: str
    age_ms: float | None = None         # a camera topic's frame: its age when attached


def oldest_ms(sources: Sequence[Any]) -> float | None:
    """The age of the oldest camera frame among `sources` (None: no frame says its age)."""
    ages = [s.age_ms for s in sources if isinstance(s, ImageSource) and s.age_ms is not None]
    return max(ages) if ages else None


def labelled(sources: Sequence[Any], field: str = "images") -> tuple[ImageSource, ...]:
    """`sources` as ImageSources; bare bytes, URLs and arrays are named `field[i]`."""
    return tuple(s if isinstance(s, ImageSource) else ImageSource(s, f"{field}[{i}]")
                 for i, s in enumerate(sources))


def url_bytes(url: str, where: str, limits: ImageLimits) -> bytes:
    """The image bytes of a `data:image/...;base64,` URL, or of an http(s) URL where the
    limits allow fetching."""
    if url.startswith("data:"):
        head, comma, payload = url.partition(",")
        if not comma or not head.endswith(";base64") or not head[5:].startswith("image/"):
            raise RequestError(f"{where}: a data URL must be data:image/<type>;base64,<data>",
                               where)
        if len(payload) * 3 // 4 > limits.max_bytes:
            raise RequestError(f"{where}: the image is about {len(payload) * 3 // 4} bytes, "
                               f"the limit is {limits.max_bytes}", where)
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise RequestError(f"{where}: the data URL's base64 is malformed", where) from None
    if url.startswith(("http://", "https://")):
        if not limits.allow_urls:
            raise RequestError(f"{where}: image URLs are not fetched here (send a data URL, "
                               "or allow URLs: --allow-image-urls)", where)
        return _fetch(url, where, limits)
    raise RequestError(f"{where}: an image must be a data URL (data:image/png;base64,...)"
                       f"{' or an http(s) URL' if limits.allow_urls else ''}, got "
                       f"{url[:40]!r}", where)


def _fetch(url: str, where: str, limits: ImageLimits) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=limits.url_timeout_s) as response:
            data = response.read(limits.max_bytes + 1)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise RequestError(f"{where}: fetching {url} failed: {reason}", where) from None
    if len(data) > limits.max_bytes:
        raise RequestError(f"{where}: {url} is over {limits.max_bytes} bytes (the limit)",
                           where)
    return data


def source_patches(source: ImageSource, config, limits: ImageLimits) -> ImagePatches:
    """One image's patches under the checkpoint's image processing `config`, or
    RequestError naming `source.label`."""
    where, data = source.label, source.data
    if isinstance(data, str):
        data = url_bytes(data, where, limits)
    try:
        if isinstance(data, (bytes, bytearray)):
            if len(data) > limits.max_bytes:
                raise ValueError(f"the image is {len(data)} bytes, the limit is "
                                 f"{limits.max_bytes}")
            return read_image(bytes(data), config, where, max_pixels=limits.max_pixels)
        if isinstance(data, np.ndarray):
            if data.ndim >= 2 and data.shape[0] * data.shape[1] > limits.max_pixels:
                raise ValueError(f"the image is {data.shape[1]} x {data.shape[0]} pixels, "
                                 f"the limit is {limits.max_pixels} pixels")
            return to_patches(data, config)
    except ValueError as exc:
        message = str(exc)
        if not message.startswith(where):
            message = f"{where}: {message}"
        raise RequestError(message, where) from None
    raise RequestError(f"{where}: an image must be bytes, a data URL or RGB pixels, got "
                       f"{type(data).__name__}", where)


def request_images(sources: Sequence[Any], engine, limits: ImageLimits
                   ) -> tuple[ImagePatches, ...]:
    """A request's images as the engine's patches (in order), or RequestError naming the
    field: too many, a text-only model, or an image that is not readable or over a limit."""
    if isinstance(sources, (str, bytes)) or not isinstance(sources, (list, tuple)):
        raise RequestError(f"images must be a list, got {type(sources).__name__}", "images")
    if len(sources) > limits.max_images:
        raise RequestError(f"images: {len(sources)} images, the limit is "
                           f"{limits.max_images} per request", "images")
    try:
        vision = engine.require_vision()
    except ValueError as exc:
        raise RequestError(f"images: {exc}", "images") from None
    return tuple(source_patches(source, vision.image_config, limits)
                 for source in labelled(sources))
