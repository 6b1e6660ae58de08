"""Inference mode entered once per request, not once per call.

`generate` runs a whole request inside `torch.inference_mode()`. The target's forward, the
MTP head's and the proposers' steps also work outside it (tests, warm-up, training tools),
so each needs the mode, but entering it costs ~5 us a call on a CPU: a fair part of a small
model's decode step. `inference` enters it only where it is not on yet.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)


def inference(fn: F) -> F:
    """`fn` under torch.inference_mode(), entered only when the mode is off."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode():
            return fn(*args, **kwargs)

    return call  # type: ignore[return-value]
