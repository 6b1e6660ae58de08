"""The one dispatch point between Triton kernels and their torch references.

The engine calls the functions exported here. Each picks the Triton kernel for CUDA tensors
and the plain-torch reference otherwise; `FLASH_PLANNER_KERNELS=torch|triton` (or
`set_backend`) forces one side ("triton" on CPU tensors needs TRITON_INTERPRET=1). Where
Triton cannot be imported the references serve, and the reason is logged once.
"""

from __future__ import annotations

import logging
import os

import torch

from .accept.reference import accept_rows as _accept_rows_ref
from .gdn_commit.chunked import gdn_commit as _gdn_commit_chunked
from .gdn_steps.chunked import gdn_steps as _gdn_steps_chunked
from .gdn_steps.reference import gdn_steps as _gdn_steps_ref
from .gemm import reference as _gemm_ref
from .gemm.context import tracing
from .gemm.reference import dequantize_fp8, dequantize_int4, dequantize_nvfp4
from .kv_append.reference import kv_append as _kv_append_ref
from .kv_append.reference import kv_read
from .toolchain import guarded

log = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "triton")
_backend = os.environ.get("FLASH_PLANNER_KERNELS", "auto")
_warned: set[str] = set()


GEMMS = ("fp8_gemm", "fp8_gate_up", "nvfp4_gemm", "nvfp4_gate_up", "int4_gemm", "int4_gate_up",
         "moe_gemm", "moe_fp8_gemm", "moe_nvfp4_gemm", "moe_int4_gemm")


def _triton_ops() -> tuple[dict[str, object], str]:
    try:
        from .accept.kernel import accept_rows
        from .gdn_commit.kernel import gdn_commit
        from .gdn_steps.kernel import gdn_steps
        from .gemm import ops as gemm
        from .kv_append.kernel import kv_append
    except ImportError as exc:  # triton is optional at run time (CPU-only installs)
        return {}, f"Triton is not importable ({exc})"
    ops = {"accept_rows": accept_rows, "gdn_commit": gdn_commit, "gdn_steps": gdn_steps,
           "kv_append": kv_append,
           **{name: getattr(gemm, name) for name in GEMMS}}
    # A launch compiles on first use, where a ptxas that does not know the GPU fails: each op
    # is guarded until it has run once, then called directly (no wrapper per launch).
    return {name: guarded(fn, lambda name=name, fn=fn: TRITON_OPS.__setitem__(name, fn))
            for name, fn in ops.items()}, ""


TRITON_OPS, TRITON_MISSING = _triton_ops()
# The launchers themselves, never replaced: what a torch.compile trace calls. The trace must
# not read TRITON_OPS, whose entries change when a kernel first succeeds: dynamo guards on
# what it read, so the swap made by the first run of a compiled forward failed the guards of
# its second run, which recompiled inside the CUDA-graph capture and broke it (seen on an
# H200: every compiled engine on CUDA failed to load). A toolchain failure while compiling
# is made clear by the compiled forwards' warm-up instead (models/graphs/warm_up_report.py).
LAUNCHERS = {name: fn.__wrapped__ for name, fn in TRITON_OPS.items()}


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
    if choice == "torch" or (choice == "auto" and not tensor.is_cuda):
        return reference
    impl = (LAUNCHERS if tracing() else TRITON_OPS).get(op)
    if impl is None:
        if op not in _warned:
            _warned.add(op)
            log.warning("kernel %s: %s; using the torch reference", op, TRITON_MISSING)
        return reference
    return impl


def _gdn_steps_torch(q, k, v, g, beta, state, rows=None):
    # one decode step is cheapest as the plain recurrence; blocks and prefills in chunked form
    impl = _gdn_steps_ref if q.shape[1] == 1 else _gdn_steps_chunked
    return impl(q, k, v, g, beta, state, rows)


def gdn_steps(q, k, v, g, beta, state, rows=None):
    return _pick("gdn_steps", _gdn_steps_torch, q)(q, k, v, g, beta, state, rows)


def kv_append(cache, rows, positions, scale=None):
    return _pick("kv_append", _kv_append_ref, rows)(cache, rows, positions, scale)


def gdn_commit(state, k_rows, delta_rows, g_rows, conv_state, conv_rows, count):
    # the torch side in closed form (one batched product), as gdn_steps' blocks
    return _pick("gdn_commit", _gdn_commit_chunked, state)(
        state, k_rows, delta_rows, g_rows, conv_state, conv_rows, count)


def accept_rows(drafts, logits, relaxed, topk, delta):
    return _pick("accept_rows", _accept_rows_ref, logits)(drafts, logits, relaxed, topk, delta)


# Weight-only GEMMs (W8A16, W4A16): y [..., N] = x [..., K] @ W.T in x's dtype, fp32 sums.
# The dequantize_* helpers (the references', exported above) give the float32 W [N, K].

def fp8_gemm(x, weight, scale, block_n, block_k):
    return _pick("fp8_gemm", _gemm_ref.fp8_gemm, x)(x, weight, scale, block_n, block_k)


def nvfp4_gemm(x, packed, scale, global_scale):
    return _pick("nvfp4_gemm", _gemm_ref.nvfp4_gemm, x)(x, packed, scale, global_scale)


def int4_gemm(x, packed, scale, zero, group):
    return _pick("int4_gemm", _gemm_ref.int4_gemm, x)(x, packed, scale, zero, group)


# The MLP's gate and up projections stacked [2I, K] (gate rows first) in one GEMM with SwiGLU's
# activation in its epilogue: y [..., I] = silu(x @ gate.T) * (x @ up.T) (kernels/gemm).

def fp8_gate_up(x, weight, scale, block_n, block_k):
    return _pick("fp8_gate_up", _gemm_ref.fp8_gate_up, x)(x, weight, scale, block_n, block_k)


def nvfp4_gate_up(x, packed, scale, global_scale):
    return _pick("nvfp4_gate_up", _gemm_ref.nvfp4_gate_up, x)(x, packed, scale, global_scale)


def int4_gate_up(x, packed, scale, zero, group):
    return _pick("int4_gate_up", _gemm_ref.int4_gate_up, x)(x, packed, scale, zero, group)


# Mixture-of-experts grouped GEMMs over the same formats, experts stacked E first:
# y [M, k, N] with y[m, j] = x[m, j if S == k else 0] @ W[topk_ids[m, j]].T, x [M, S, K];
# gated: each expert's gate rows then its up rows, y = silu(gate) * up [M, k, N / 2].

def moe_gemm(x, topk_ids, weight, gated=False):
    return _pick("moe_gemm", _gemm_ref.moe_gemm, x)(x, topk_ids, weight, gated)


def moe_fp8_gemm(x, topk_ids, weight, scale, block_n, block_k, gated=False):
    return _pick("moe_fp8_gemm", _gemm_ref.moe_fp8_gemm, x)(x, topk_ids, weight, scale,
                                                            block_n, block_k, gated)


def moe_nvfp4_gemm(x, topk_ids, packed, scale, global_scale, gated=False):
    return _pick("moe_nvfp4_gemm", _gemm_ref.moe_nvfp4_gemm, x)(x, topk_ids, packed, scale,
                                                                global_scale, gated)


def moe_int4_gemm(x, topk_ids, packed, scale, zero, group, gated=False):
    return _pick("moe_int4_gemm", _gemm_ref.moe_int4_gemm, x)(x, topk_ids, packed, scale,
                                                              zero, group, gated)


__all__ = ["accept_rows", "backend", "dequantize_fp8", "dequantize_int4", "gdn_commit",
           "dequantize_nvfp4", "fp8_gate_up", "fp8_gemm", "gdn_steps", "int4_gate_up",
           "int4_gemm", "kv_append", "kv_read", "moe_fp8_gemm", "moe_gemm", "moe_int4_gemm",
           "moe_nvfp4_gemm", "nvfp4_gate_up", "nvfp4_gemm", "set_backend"]
