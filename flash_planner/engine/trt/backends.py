"""Choose how the dense segments run: torch | onnxruntime | tensorrt | auto.

`auto` is TensorRT when it is importable and the model is on CUDA, else torch. A backend
that cannot serve (missing package, no GPU, failed export or build) falls back to torch with
one log line saying why; the eager torch path runs the same segment plan either way.
Quantized weights are refused by onnxruntime/tensorrt with a clear error (`auto` picks torch).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from importlib.util import find_spec
from pathlib import Path

from ..config import DENSE_BACKENDS, cache_home
from ..models.qwen.target import TargetModel, TorchDense
from ..weights.linear import QuantLinear

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    return cache_home() / "segments"


def make_dense(model: TargetModel, backend: str, cache_dir: str | Path | None = None,
               max_tokens: int = 4096, opt_tokens: int = 16,
               progress: Callable[[str], None] | None = None):
    """A dense runner for `model`; falls back to torch (logged) if the backend cannot serve."""
    if backend not in DENSE_BACKENDS:
        raise ValueError(f"dense_backend must be one of {DENSE_BACKENDS}, got {backend!r}")
    device = model.embed_tokens.weight.device
    quantized = sorted({m.family for m in model.modules() if isinstance(m, QuantLinear)})
    if backend == "auto":
        backend = ("tensorrt" if device.type == "cuda" and find_spec("tensorrt")
                   and not quantized and not model.moe_blocks else "torch")
    if quantized and backend != "torch":
        # Exporting would bake dequantized full-precision weights into the graph: the memory
        # and bandwidth the format saves would be lost, so refuse rather than do that.
        raise ValueError(
            f"dense_backend {backend!r} cannot run quantized weights ({', '.join(quantized)}): "
            "ONNX/TensorRT segments are exported with full-precision weights only; use "
            "dense_backend torch (the Triton weight-only GEMMs) or weights bf16")
    if model.moe_blocks and backend != "torch":
        raise ValueError(f"dense_backend {backend!r} cannot run mixture-of-experts layers "
                         f"({model.cfg.model_type}): the segments are exported as static "
                         "graphs and expert routing is data-dependent; use dense_backend torch")
    if backend == "torch":
        return TorchDense(model.segments)
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    try:
        from .export import export_all

        if backend == "onnxruntime":
            if find_spec("onnxruntime") is None:
                raise RuntimeError("onnxruntime is not installed")
            from .onnxruntime_backend import OnnxRuntimeDense

            return OnnxRuntimeDense(export_all(model, cache / "onnx", max_tokens, progress),
                                    device)
        if find_spec("tensorrt") is None:
            raise RuntimeError("TensorRT is not installed")
        if device.type != "cuda":
            raise RuntimeError("TensorRT needs the model on a CUDA GPU")
        from .tensorrt_backend import TensorRTDense

        exported = export_all(model, cache / "onnx", max_tokens, progress)
        return TensorRTDense(exported, cache / "tensorrt", (1, opt_tokens, max_tokens),
                             progress)
    except Exception as exc:  # any backend failure: serve with torch, say why once
        log.warning("dense backend %s unavailable (%s); running the dense segments with torch",
                    backend, exc)
        return TorchDense(model.segments)
