"""Dense-segment backends compared on whole target forwards: decode (1 row) and verify (16 rows).

What is measured. A random-weight ~60M-parameter hybrid checkpoint (`write_tiny_checkpoint(
kind="hybrid", size="bench")` of flash_planner.train.tiny) is loaded once by our `Engine`
(fp32, max_context 512). For each dense backend (torch, onnxruntime, and tensorrt where it is
importable and the model is on CUDA; otherwise the row says why it was skipped) the target's
dense segments are switched with `model.set_dense(make_dense(...))`; the token mixers
(attention, Gated DeltaNet) are the same torch code for every backend. Two forwards are timed
at position 64, after a 64-token prompt: `decode` = 1 row (all logits, as plain decoding
runs it) and `verify-16` = 16 rows with per-step checkpoints (as a speculative verify runs
it).

How. Before every timed forward the state is reset and the same prompt is prefilled with the
same backend (untimed), so every timed forward starts from an identical state and the logits
of different backends are comparable. Each backend gets one untimed warm-up of each shape;
the repeats then interleave the backends, and the median is reported. `dense` is the time
spent inside the dense runner's `run` calls, measured in separate forwards by a wrapper (on
CUDA the wrapper synchronizes, so it is not taken from the forwards timed for the total).
onnxruntime sessions are rebuilt with `--threads` intra-op threads so both sides use the same
number of cores. Correctness gate: the onnxruntime (and tensorrt) logits of the timed forwards
must equal torch's within 1e-4 (max abs diff, shown); a backend that fails it gets no ratios.
Speedup = torch ms / backend ms (> 1: faster than torch). Nothing here asserts on time.

    .venv/bin/python bench/segments.py [--threads 1] [--repeats 10] [--device cpu|cuda] [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from importlib.util import find_spec
from pathlib import Path

import torch

from flash_planner.engine.engine import Engine, EngineConfig
from flash_planner.engine.trt.backends import make_dense
from flash_planner.train.tiny import write_tiny_checkpoint

PROMPT_TOKENS = 64
SHAPES = {"decode": 1, "verify16": 16}
TOLERANCE = 1e-4
BACKENDS = ("torch", "onnxruntime", "tensorrt")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class DenseClock:
    """Wraps a dense runner and adds up the wall time spent in its `run` calls."""

    def __init__(self, inner, sync):
        self.inner, self.name, self.sync, self.seconds = inner, inner.name, sync, 0.0

    def run(self, index, *tensors):
        self.sync()
        t0 = time.perf_counter()
        out = self.inner.run(index, *tensors)
        self.sync()
        self.seconds += time.perf_counter() - t0
        return out


class Warnings(logging.Handler):
    """Keeps the fallback reasons make_dense logs."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def pin_ort_threads(dense, exported, threads: int) -> None:
    """Rebuild the onnxruntime sessions with `threads` intra-op threads (default: all cores)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    dense.sessions = [ort.InferenceSession(str(path), options,
                                           providers=session.get_providers())
                      for (_, path), session in zip(exported, dense.sessions)]


def build_dense(engine, backend: str, cache: Path, threads: int, catcher: Warnings):
    """(runner, None) or (None, why it was skipped)."""
    model = engine.model
    if backend == "tensorrt":
        if find_spec("tensorrt") is None:
            return None, "tensorrt is not installed"
        if engine.device.type != "cuda":
            return None, "needs the model on CUDA (--device cuda)"
    if backend == "onnxruntime" and find_spec("onnxruntime") is None:
        return None, "onnxruntime is not installed"
    catcher.messages.clear()
    t0 = time.perf_counter()
    dense = make_dense(model, backend, cache_dir=cache, max_tokens=PROMPT_TOKENS,
                       opt_tokens=SHAPES["verify16"], progress=lambda m: log(f"  {m}"))
    if dense.name != backend:
        return None, "; ".join(catcher.messages) or f"make_dense returned {dense.name}"
    if backend == "onnxruntime":
        from flash_planner.engine.trt.export import export_all

        pin_ort_threads(dense, export_all(model, cache / "onnx", PROMPT_TOKENS), threads)
    log(f"  {backend} ready in {time.perf_counter() - t0:.1f} s")
    return dense, None


def timed_forward(engine, prompt, rows, sync, clock: DenseClock | None = None):
    """Reset, prefill the prompt (untimed), then one timed forward of `rows` rows."""
    model, state = engine.model, engine.state
    state.reset()
    model(prompt, state)
    state.commit(prompt.shape[1])
    ids = prompt[:, :rows]
    if clock is not None:
        clock.seconds, previous = 0.0, model.dense
        model.set_dense(clock)
    try:
        sync()
        t0 = time.perf_counter()
        out = model(ids, state, record_steps=rows > 1, all_logits=True)
        sync()
        elapsed = time.perf_counter() - t0
    finally:
        if clock is not None:
            model.set_dense(previous)
    logits = out.logits.float().cpu().clone()
    state.commit(rows)
    return (clock.seconds if clock is not None else elapsed), logits


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    catcher = Warnings()
    logging.getLogger("flash_planner.engine.trt.backends").addHandler(catcher)
    t_start, load_start = time.perf_counter(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="flash-planner-segments-") as tmp:
        path = Path(tmp) / "bench-hybrid"
        log(f"writing the bench hybrid checkpoint to {path} ...")
        write_tiny_checkpoint(path, kind="hybrid", size="bench", seed=0)
        engine = Engine.load(EngineConfig(model_path=str(path), device=args.device,
                                          dtype="fp32", max_context=512))
        device = engine.device
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        params_m = sum(p.numel() for p in engine.model.parameters()) / 1e6
        gen = torch.Generator().manual_seed(0)
        vocab = engine.model.cfg.vocab_size
        prompt = torch.randint(0, vocab, (1, PROMPT_TOKENS), generator=gen).to(device)

        runners, skipped = {}, {}
        for backend in BACKENDS:
            log(f"preparing dense backend {backend} ...")
            dense, why = build_dense(engine, backend, Path(tmp) / "segments", args.threads,
                                     catcher)
            if dense is None:
                skipped[backend] = why
                log(f"  skipped: {why}")
            else:
                runners[backend] = dense

        times = {b: {s: [] for s in SHAPES} for b in runners}
        dense_times = {b: {s: [] for s in SHAPES} for b in runners}
        logits = {b: {} for b in runners}
        for r in range(args.repeats + 1):           # repeat 0 is the warm-up
            log(f"repeat {r}/{args.repeats}" + (" (warm-up)" if r == 0 else ""))
            for backend, dense in runners.items():
                engine.model.set_dense(dense)
                for shape, rows in SHAPES.items():
                    seconds, out = timed_forward(engine, prompt, rows, sync)
                    dense_s, _ = timed_forward(engine, prompt, rows, sync,
                                               DenseClock(dense, sync))
                    if r:
                        times[backend][shape].append(seconds * 1e3)
                        dense_times[backend][shape].append(dense_s * 1e3)
                        logits[backend][shape] = out
        engine.model.set_dense(runners["torch"])

    rows = []
    for backend in runners:
        row = {"backend": backend}
        for shape in SHAPES:
            row[f"{shape}_ms"] = statistics.median(times[backend][shape])
            row[f"{shape}_dense_ms"] = statistics.median(dense_times[backend][shape])
        row["max_abs_diff"] = max(float((logits[backend][s] - logits["torch"][s]).abs().max())
                                  for s in SHAPES)
        row["correct"] = row["max_abs_diff"] <= TOLERANCE
        base = row if backend == "torch" else rows[0]          # torch is always first
        for shape in SHAPES:
            row[f"{shape}_speedup"] = (base[f"{shape}_ms"] / row[f"{shape}_ms"]
                                       if row["correct"] else None)
        rows.append(row)
    ort_version = None
    if find_spec("onnxruntime") is not None:
        import onnxruntime

        ort_version = onnxruntime.__version__
    return {"params_m": params_m, "device": str(device), "dtype": "fp32",
            "threads": torch.get_num_threads(), "repeats": args.repeats,
            "prompt_tokens": PROMPT_TOKENS, "tolerance": TOLERANCE, "torch": torch.__version__,
            "onnxruntime": ort_version, "rows": rows, "skipped": skipped,
            "load_start": load_start, "load_end": os.getloadavg()[0],
            "wall_s": time.perf_counter() - t_start}


def fmt_speedup(value) -> str:
    return "    -" if value is None else f"{value:5.2f}x"


def print_table(report: dict) -> None:
    print(f"dense backends on the bench hybrid ({report['params_m']:.1f}M params), "
          f"{report['device']} {report['dtype']}, {report['threads']} thread(s), median of "
          f"{report['repeats']} after one warm-up")
    print(f"forward at position {report['prompt_tokens']}: decode = 1 row, verify16 = 16 rows "
          "(record_steps); dense = time inside the dense runner")
    print("speedup = torch ms / backend ms (>1 faster); logits checked against torch "
          f"(max abs diff <= {report['tolerance']:g})")
    print(f"torch {report['torch']}, onnxruntime {report['onnxruntime']}; load avg "
          f"{report['load_start']:.2f} -> {report['load_end']:.2f}")
    header = (f"{'backend':<12} {'decode ms':>9} {'speedup':>7} {'verify16 ms':>11} "
              f"{'speedup':>7} {'dense dec ms':>12} {'dense ver ms':>12} {'max|dlogit|':>11}")
    print(header)
    print("-" * len(header))
    for row in report["rows"]:
        dec_share = row["decode_dense_ms"] / row["decode_ms"] if row["decode_ms"] else 0.0
        ver_share = row["verify16_dense_ms"] / row["verify16_ms"] if row["verify16_ms"] else 0.0
        flag = "" if row["correct"] else "  MISMATCH: not compared"
        print(f"{row['backend']:<12} {row['decode_ms']:>9.2f} "
              f"{fmt_speedup(row['decode_speedup']):>7} {row['verify16_ms']:>11.2f} "
              f"{fmt_speedup(row['verify16_speedup']):>7} "
              f"{row['decode_dense_ms']:>6.2f} ({dec_share:>3.0%}) "
              f"{row['verify16_dense_ms']:>6.2f} ({ver_share:>3.0%}) "
              f"{row['max_abs_diff']:>11.2e}{flag}")
    for backend, why in report["skipped"].items():
        print(f"{backend:<12} skipped: {why}")
    print(f"wall time {report['wall_s']:.1f} s")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (tensorrt needs cuda)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = p.parse_args(argv)
    if args.threads < 1 or args.repeats < 1:
        p.error("--threads and --repeats must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)     # torchvision-op notices
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)
    return 0 if all(row["correct"] for row in report["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
