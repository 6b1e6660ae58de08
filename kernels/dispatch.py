"""The one dispatch point between Triton kernels and their torch references.

The engine calls the functions exported here. Each picks the Triton kernel for CUDA tensors
when one exists and the plain-torch reference otherwise; `FLASH_PLANNER_KERNELS=torch|triton`
(or `set_backend`) forces one side. Every fallback is logged once with its reason.
"""

from __future__ import annotations

import logging
import os

import torch

from .checkpoint_select.reference import checkpoint_select as _checkpoint_select_ref
from .gdn_steps.reference import gdn_steps as _gdn_steps_ref
from .kv_append.reference import kv_append as _kv_append_ref
from .kv_append.reference import kv_read as _kv_read_ref

log = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "triton")
_backend = os.environ.get("FLASH_PLANNER_KERNELS", "auto")
_warned: set[str] = set()

# op name -> Triton implementation; filled in as kernels land (none are registered yet).
TRITON_OPS: dict[str, object] = {}


def set_backend(name: str) -> None:
    if name not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, got {name!r}")
    global _backend
    _backend = name


def backend() -> str:
    if _backend not in BACKENDS:
        raise ValueError(f"FLASH_PLANNER_KERNELS must be one of {BACKENDS}, got {_backend!r}")
    return _backend


def _pick(op: str, reference, tensor: torch.Tensor):
    choice = backend()
    if choice == "torch":
        return reference
    impl = TRITON_OPS.get(op)
    if impl is not None and (tensor.is_cuda or choice == "triton"):
        return impl
    if choice == "triton" and op not in _warned:
        _warned.add(op)
        log.warning("kernel %s: no Triton implementation yet, using the torch reference", op)
    return reference


def gdn_steps(q, k, v, g, beta, state, step_states=None):
    return _pick("gdn_steps", _gdn_steps_ref, q)(q, k, v, g, beta, state, step_states)


def kv_append(cache, rows, positions, scale=None):
    return _pick("kv_append", _kv_append_ref, rows)(cache, rows, positions, scale)


def kv_read(cache, length, scale, dtype):
    return _pick("kv_read", _kv_read_ref, cache)(cache, length, scale, dtype)


def checkpoint_select(state, step_states, conv_state, conv_rows, step, num_steps):
    return _pick("checkpoint_select", _checkpoint_select_ref, state)(
        state, step_states, conv_state, conv_rows, step, num_steps)
