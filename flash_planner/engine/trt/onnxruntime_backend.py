"""Run the exported dense segments with onnxruntime (CPU, or its CUDA provider).

This backend is the CI proof that the exported graphs are right: the engine runs every
dense segment through it and must produce what the torch segments produce.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .export import SegmentSpec

NUMPY_DTYPES = (torch.float32, torch.float16, torch.int64)


class OnnxRuntimeDense:
    name = "onnxruntime"

    def __init__(self, exported: list[tuple[SegmentSpec, Path]], device: torch.device):
        import onnxruntime as ort

        if any(t.dtype not in NUMPY_DTYPES for spec, _ in exported for t in spec.example):
            raise ValueError("the onnxruntime backend runs fp32/fp16 models (numpy has no "
                             "bf16); use dense_backend torch or tensorrt")
        providers = ["CPUExecutionProvider"]
        if device.type == "cuda" and "CUDAExecutionProvider" in ort.get_available_providers():
            providers.insert(0, "CUDAExecutionProvider")
        options = ort.SessionOptions()
        options.log_severity_level = 3
        self.device = device
        self.specs = [spec for spec, _ in exported]
        self.sessions = [ort.InferenceSession(str(path), options, providers=providers)
                         for _, path in exported]

    def run(self, index: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        spec = self.specs[index]
        feeds = {name: t.detach().cpu().contiguous().numpy()
                 for name, t in zip(spec.inputs, tensors)}
        outs = self.sessions[index].run(list(spec.outputs), feeds)
        return tuple(torch.from_numpy(np.ascontiguousarray(o)).to(self.device) for o in outs)
