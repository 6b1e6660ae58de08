"""Run the exported dense segments as TensorRT engines (one engine per segment).

Build (TensorRT 10.x and 11.x Python API): a strongly typed network (the flag is explicit in
10.x and implicit in 11.x, where it may be absent), parsed from the segment's ONNX file; one
optimization profile whose token dimension (dim 1 of every input) spans the shape buckets
(min, opt, max); a workspace pool limit; a timing cache shared by all segments and kept on
disk. No precision flags: the ONNX graph's dtypes decide precision. Built plans are cached as
`cache_dir/<onnx segment dir>/<key>.plan`, the key hashing (segment digest, buckets, TensorRT
version, GPU compute capability), since a plan only runs on the GPU kind and TensorRT version
that built it.

Run: inputs are bound by address (contiguous CUDA tensors, cast to the engine's dtype when
they differ); outputs live in buffers preallocated once per segment for `max_tokens` rows and
are handed out as views of the actual token count, enqueued with `execute_async_v3` on torch's
current stream. The views are reused by the next call of the same segment: the target's
forward consumes (or copies) them before that. Capturing a whole verify step per shape
bucket in one CUDA graph, to remove the per-segment launch overhead, is not done yet (a
later step).

`tensorrt` is imported only when a `TensorRTDense` is made, so this module imports anywhere.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from .export import SegmentSpec

_LOGGER = None          # TensorRT wants one logger per process


def _logger(trt):
    global _LOGGER
    if _LOGGER is None:
        _LOGGER = trt.Logger(trt.Logger.WARNING)
    return _LOGGER


def _torch_dtypes(trt) -> dict:
    pairs = (("float32", torch.float32), ("float16", torch.float16),
             ("bfloat16", torch.bfloat16), ("int32", torch.int32), ("int64", torch.int64),
             ("int8", torch.int8), ("uint8", torch.uint8), ("bool", torch.bool),
             ("fp8", torch.float8_e4m3fn))
    return {getattr(trt, name): dtype for name, dtype in pairs if hasattr(trt, name)}


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class _Segment:
    """One engine, its execution context and its preallocated output buffers."""

    def __init__(self, trt, spec: SegmentSpec, engine, device: torch.device, max_tokens: int):
        self.spec, self.engine, self.device = spec, engine, device
        self.context = engine.create_execution_context()
        if self.context is None:
            raise RuntimeError("could not create an execution context")
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        inputs = {n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT}
        dtypes = _torch_dtypes(trt)
        self.inputs = {n: dtypes[engine.get_tensor_dtype(n)] for n in inputs}
        missing = [n for n in spec.outputs if n not in names or n in inputs]
        if missing:
            raise RuntimeError(f"the engine lacks outputs {missing}")
        # Output shapes at the largest bucket size the buffers, once.
        for name, example in zip(spec.inputs, spec.example):
            if name in self.inputs:
                self._set_shape(name, (*example.shape[:1], max_tokens, *example.shape[2:]))
        self.outputs = []
        for name in spec.outputs:
            shape = tuple(self.context.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                raise RuntimeError(f"output {name} has unresolved shape {shape}")
            buf = torch.empty(math.prod(shape), dtype=dtypes[engine.get_tensor_dtype(name)],
                              device=device)
            if not self.context.set_tensor_address(name, buf.data_ptr()):
                raise RuntimeError(f"could not bind output {name}")
            self.outputs.append((name, buf))

    def _set_shape(self, name: str, shape: Sequence[int]) -> None:
        if not self.context.set_input_shape(name, tuple(shape)):
            raise RuntimeError(f"segment {self.spec.index}: input {name} shape {tuple(shape)} "
                               "is outside the engine's optimization profile")

    def run(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        keep = []                    # converted inputs must live until the enqueue
        for name, t in zip(self.spec.inputs, tensors):
            want = self.inputs.get(name)
            if want is None:         # an input TensorRT pruned as unused
                continue
            if t.dtype != want or t.device != self.device or not t.is_contiguous():
                t = t.to(device=self.device, dtype=want).contiguous()
            keep.append(t)
            self._set_shape(name, t.shape)
            self.context.set_tensor_address(name, t.data_ptr())
        outs = []
        for name, buf in self.outputs:
            shape = tuple(self.context.get_tensor_shape(name))
            outs.append(buf[:math.prod(shape)].view(shape))
        stream = torch.cuda.current_stream(self.device).cuda_stream
        if not self.context.execute_async_v3(stream):
            raise RuntimeError(f"TensorRT segment {self.spec.index}: execute_async_v3 failed")
        return tuple(outs)


class TensorRTDense:
    name = "tensorrt"

    def __init__(self, exported: list[tuple[SegmentSpec, Path]], cache_dir: str | Path,
                 shape_buckets: tuple[int, int, int],
                 progress: Callable[[str], None] | None = None,
                 workspace_bytes: int = 2 << 30):
        import tensorrt as trt

        lo, opt, hi = shape_buckets
        if not 1 <= lo <= opt <= hi:
            raise ValueError(f"shape buckets must satisfy 1 <= min <= opt <= max, got "
                             f"{shape_buckets}")
        if not exported:
            raise ValueError("no exported segments")
        self.device = exported[0][0].example[0].device
        if self.device.type != "cuda":
            raise RuntimeError("TensorRT needs the model on a CUDA GPU")
        self.buckets, self.workspace = (lo, opt, hi), workspace_bytes
        self.cache_dir = Path(cache_dir)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        cc = torch.cuda.get_device_capability(self.device)        # also initializes CUDA
        self.cc = f"sm{cc[0]}{cc[1]}"
        self.timing_path = self.cache_dir / f"timing-trt{trt.__version__}-{self.cc}.cache"
        self.runtime = runtime = trt.Runtime(_logger(trt))   # must outlive the engines
        self.segments: list[_Segment] = []
        with torch.cuda.device(self.device):
            for spec, onnx_path in exported:
                try:
                    plan, status = self._plan(trt, spec, Path(onnx_path))
                    engine = runtime.deserialize_cuda_engine(plan)
                    if engine is None:
                        raise RuntimeError("the plan did not deserialize")
                    self.segments.append(_Segment(trt, spec, engine, self.device, hi))
                except Exception as exc:
                    raise RuntimeError(f"TensorRT segment {spec.index} ({onnx_path}): "
                                       f"{exc}") from exc
                if progress is not None:
                    progress(f"[{spec.index + 1}/{len(exported)}] segment {spec.index}: "
                             f"TensorRT {status}")

    def _plan(self, trt, spec: SegmentSpec, onnx_path: Path) -> tuple[bytes, str]:
        key = json.dumps({"segment": onnx_path.parent.name, "buckets": self.buckets,
                          "tensorrt": trt.__version__, "cc": self.cc,
                          "workspace": self.workspace})
        path = (self.cache_dir / onnx_path.parent.name /
                f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.plan")
        if path.is_file():
            return path.read_bytes(), "cache hit"
        t0 = time.perf_counter()
        plan = self._build(trt, spec, onnx_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_atomic(path, plan)
        return plan, f"built in {time.perf_counter() - t0:.1f} s"

    def _build(self, trt, spec: SegmentSpec, onnx_path: Path) -> bytes:
        logger = _logger(trt)
        builder = trt.Builder(logger)
        strong = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
        network = builder.create_network(0 if strong is None else 1 << int(strong))
        parser = trt.OnnxParser(network, logger)
        if not parser.parse_from_file(str(onnx_path)):
            errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
            raise RuntimeError("the ONNX parser failed: " + ("; ".join(errors) or "no detail"))
        config = builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, self.workspace)
        examples = dict(zip(spec.inputs, spec.example))
        profile = builder.create_optimization_profile()
        for i in range(network.num_inputs):
            name = network.get_input(i).name
            if name not in examples:
                raise RuntimeError(f"the network input {name!r} is not one of {spec.inputs}")
            dims = tuple(examples[name].shape)
            profile.set_shape(name, *((*dims[:1], t, *dims[2:]) for t in self.buckets))
        config.add_optimization_profile(profile)
        stored = self.timing_path.read_bytes() if self.timing_path.is_file() else b""
        cache = config.create_timing_cache(stored)
        if not config.set_timing_cache(cache, False):
            # An unusable stored cache: start from an empty one rather than failing.
            config.set_timing_cache(config.create_timing_cache(b""), False)
        plan = builder.build_serialized_network(network, config)
        if plan is None:
            raise RuntimeError("build_serialized_network failed (see the TensorRT log above)")
        _write_atomic(self.timing_path, bytes(config.get_timing_cache().serialize()))
        return bytes(plan)

    def run(self, index: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        tokens = tensors[0].shape[1]
        if not self.buckets[0] <= tokens <= self.buckets[2]:
            raise ValueError(f"{tokens} tokens outside the engines' range {self.buckets[0]}.."
                             f"{self.buckets[2]}")
        return self.segments[index].run(tensors)
