"""Export the target's dense segments to ONNX, cached on disk by a digest of their weights.

Each segment exports with `torch.onnx.export(..., dynamo=True)` in the model's dtype, with
named inputs/outputs, the token dimension dynamic (1 .. max_tokens) and the weights as
external data. Example inputs are the tensors a real forward hands each segment, so shapes
and dtypes are exactly the engine's. The cache directory of a segment is named by a digest
of (segment index, its parameters' bytes, dtype, I/O names, max_tokens, torch version):
changed weights give a new directory, never a stale graph.
"""

from __future__ import annotations

import hashlib
import logging
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..models.qwen.target import TargetModel, TorchDense
from ..state.cache import InferenceState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SegmentSpec:
    index: int
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    example: tuple[torch.Tensor, ...]


class _Recorder(TorchDense):
    """Runs the segments eagerly and keeps the arguments each one received."""

    def __init__(self, segments):
        super().__init__(segments)
        self.calls: dict[int, tuple[torch.Tensor, ...]] = {}

    def run(self, index, *tensors):
        self.calls[index] = tuple(t.clone() for t in tensors)
        return super().run(index, *tensors)


def segment_specs(model: TargetModel, tokens: int = 2) -> list[SegmentSpec]:
    """I/O names and example inputs of every segment, from one forward over `tokens` rows."""
    device = model.embed_tokens.weight.device
    dtype = model.embed_tokens.weight.dtype
    state = InferenceState(model.cfg, capacity=tokens, max_steps=tokens, kv_dtype=dtype,
                           compute_dtype=dtype, device=device)
    recorder, previous = _Recorder(model.segments), model.dense
    model.set_dense(recorder)
    try:
        model(torch.zeros(1, tokens, dtype=torch.long, device=device), state, all_logits=True)
    finally:
        model.set_dense(previous)
    specs, last = [], len(model.segments) - 1
    for i in range(len(model.segments)):
        example = recorder.calls[i]
        inputs = ("ids",) if i == 0 else ("x", "core") + tuple(
            f"post{j}" for j in range(len(example) - 2))
        if i == last:
            outputs = ("x_out", "logits")
        else:
            n_mix, n_post = model.arity[i]
            outputs = ("x_out",) + tuple(f"mix{j}" for j in range(n_mix)) + tuple(
                f"post_out{j}" for j in range(n_post))
        specs.append(SegmentSpec(i, inputs, outputs, example))
    return specs


def segment_digest(model: TargetModel, spec: SegmentSpec, max_tokens: int) -> str:
    h = hashlib.sha256()
    h.update(f"{spec.index}|{spec.inputs}|{spec.outputs}|{max_tokens}|{torch.__version__}"
             .encode())
    for name, p in sorted(model.segments[spec.index].named_parameters()):
        h.update(name.encode())
        h.update(str(p.dtype).encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:20]


def export_segment(model: TargetModel, spec: SegmentSpec, path: Path, max_tokens: int) -> None:
    tokens = torch.export.Dim("tokens", min=1, max=max_tokens)
    shapes = {name: {1: tokens} for name in spec.inputs}
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        # The segment's forward takes *post; give torch.export the flat positional form.
        module = _Flat(model.segments[spec.index], len(spec.inputs))
        torch.onnx.export(module, tuple(t.clone() for t in spec.example), f=str(path),
                          dynamo=True, input_names=list(spec.inputs),
                          output_names=list(spec.outputs),
                          # one entry, for the single *tensors argument of _Flat.forward
                          dynamic_shapes=(tuple(shapes[n] for n in spec.inputs),),
                          external_data=True, verbose=False)


class _Flat(torch.nn.Module):
    """One varargs entry point for every segment kind (torch.export sees one tuple)."""

    def __init__(self, segment: torch.nn.Module, arity: int):
        super().__init__()
        self.segment, self.arity = segment, arity

    def forward(self, *tensors):
        return self.segment(*tensors)


def export_all(model: TargetModel, cache_dir: str | Path, max_tokens: int = 4096,
               progress: Callable[[str], None] | None = None) -> list[tuple[SegmentSpec, Path]]:
    """Export every segment not already cached; returns (spec, onnx path) per segment."""
    out = []
    specs = segment_specs(model)
    for spec in specs:
        digest = segment_digest(model, spec, max_tokens)
        path = Path(cache_dir) / f"segment{spec.index:03d}-{digest}" / "segment.onnx"
        if path.is_file():
            status = "cached"
        else:
            t0 = time.perf_counter()
            export_segment(model, spec, path, max_tokens)
            status = f"exported in {time.perf_counter() - t0:.1f} s"
        if progress is not None:
            progress(f"[{spec.index + 1}/{len(specs)}] segment {spec.index}: {status}")
        out.append((spec, path))
    return out
