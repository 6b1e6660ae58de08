"""The GPU figures from one command: ceilings, weight-only GEMMs, and the Thor line.

Parts (each one table, all of them in one JSON file):
  ceilings  device-to-device copy bandwidth (bytes read + written) and a bf16 matmul's
            TFLOP/s, measured in this run;
  gemm      weight-only GEMMs at Qwen3.6-27B and 35B-A3B shapes, rows 1, 2, 4, 8, 16: bf16
            (torch) and the engine's fp8, nvfp4 and int4 layouts (dispatch: the Triton kernels
            on CUDA), as time and as the fraction of the copy bandwidth their weight bytes
            reach; beside each quantized row the tiled kernel (the M > 16 one, which decode
            ran before the skinny kernels) and the skinny kernel at its counted configuration
            (kernels/gemm/configs.py; the launch itself uses the measured table where it has
            the shape: `--tune` measures it first), and the speed against bf16; below each
            quantized row torch's own GEMMs on the same operands (kernels/gemm/vendor.py:
            tinygemm int4, W4A16; cuBLASLt e4m3, W8A8; FP4 block-scaled: why absent) with
            their device time and difference from ours (`--tune` also records which one
            serves each shape and bucket: the engine's Linears call it there); then the
            27B's MLP gate and up projections fused (one GEMM with SwiGLU) against the two
            GEMMs and the activation apart;
  thor      the full 27B's and 35B-A3B's bytes per forward (bench/weight_bytes.py) over Thor's
            273 GB/s at the NVFP4 GEMMs' measured fraction: ms and tok/s per token;
  demo      the demo planner through the planner service, warmed up, greedy: dtype (fp32,
            bf16) x forward (eager, compiled: CUDA graphs) x method (auto, dflash, mtp,
            none) on 12 held-out tasks: TTFT and decode tok/s (medians), tokens per cycle,
            plans equal to fp32 eager's, and the engine's first request's TTFT against the
            median of the next ones (load and warm-up times beside; for the compiled engines
            also a second start's load, in a new process reading the on-disk caches). Needs
            our planning
            dependencies too (docs/thor.md lists the wheels).
  slices    engine slices at the 27B's width (4 layers: 3 GDN + 1 attention, its vocabulary)
            and the 35B-A3B's, bf16 and NVFP4 (quantized at load, experts included; gate and
            up fused as the loader fuses them), random weights: a
            1-row decode and a 16-row verify (with its rollback), eager and through the
            compiled graphs, as ms, bytes per forward and the fraction of the copy bandwidth.
            --small: tiny widths, eager only (a cold compile on a CPU takes minutes). On
            a GPU each slice compiles its graphs (75-105 s cold at these widths; the
            on-disk cache makes a second run quick): `--parts` splits a first run.
  moe       (with gemm) the 35B-A3B's grouped expert GEMMs in each format, a decode row and
            4- and 16-row verify blocks with random routing: time beside the tiled kernel's,
            and the fraction of the copy bandwidth the distinct chosen experts' bytes reach.
  profile   where a plan's time goes in fp32 and in bf16 (the demo, eager, auto, under
            torch.profiler): the ops with the most host time and their device time, per dtype.
  vision    one image's TTFT parts at the 27B's and the 35B-A3B's dimensions (random
            weights, bf16): the vision tower per image (224, 448, 896 px; bench/vision.py's
            tower) and the prefill of its tokens and a 32-token task through a 4-layer
            slice; the TTFT estimate scales the slice to the model's depth.
            --small: a 2-block narrow tower on 32 and 64 px, tiny slices, fp32.
  batch     (by name only) 8 requests at once against one at the 27B's width slice (bf16):
            a decode step (1 row each) and a verify (16 rows each, with its rollbacks) over
            the slots of one batch state, every slot 64 tokens in, capacity 4,112 rows;
            eager and through the batch's compiled graphs (CUDA graphs, batch buckets 1
            and 8): ms of each, and the aggregate (8 x ms of one / ms of eight).
            --small: tiny widths, eager only.
bench/kernel_times.py has the hot-path kernels' table.

    python bench/gpu.py [--parts ceilings gemm thor] [--json-out FILE]   # a CUDA GPU
    python bench/gpu.py --small     # tiny shapes on a CPU, kernels interpreted: a smoke run

The GPU's Python needs torch, triton and transformers; our other dependencies are not used.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

SMALL = "--small" in sys.argv
if SMALL:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from gpu_common import DEFAULT_PARTS, DEMO_METHODS, PARTS, SLICES  # noqa: E402
from gpu_gemm import ceilings, gate_up_rows, gemm_rows, moe_rows  # noqa: E402
from gpu_model import batch_rows, demo_rows, profile_rows, sdpa_rows, slice_rows, thor_rows  # noqa: E402
from gpu_tables import print_tables  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true",
                        help="tiny shapes on a CPU, kernels interpreted (default: off)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(DEFAULT_PARTS),
                        help="which tables (default: all but batch)")
    parser.add_argument("--tune", action="store_true",
                        help="measure the skinny GEMMs' configurations for the gemm part's "
                             "shapes first and use them (cached; CUDA only; default: off)")
    parser.add_argument("--json-out", type=Path, default=None,
                        help="write the report there as JSON, again after every part, so a "
                             "run stopped by a time limit keeps the parts it finished "
                             "(default: print only)")
    parser.add_argument("--slices", nargs="+", choices=SLICES, default=list(SLICES),
                        help="which engine slices the slices part times (default: all)")
    parser.add_argument("--demo-methods", nargs="+", choices=DEMO_METHODS,
                        default=list(DEMO_METHODS),
                        help="the demo part's decoding methods (default: all)")
    parser.add_argument("--demo-forwards", nargs="+", choices=("eager", "compiled"),
                        default=["eager", "compiled"],
                        help="the demo part's forwards (default: both)")
    parser.add_argument("--demo-tasks", type=int, default=12,
                        help="held-out tasks per demo row (default: 12)")
    args = parser.parse_args(argv)
    if args.demo_tasks < 2:
        parser.error("--demo-tasks must be at least 2 (the first request against the next)")
    if args.tune and args.small:
        parser.error("--tune measures on a CUDA GPU; --small runs interpreted on a CPU")
    if not args.small and not torch.cuda.is_available():
        print("bench/gpu.py needs a CUDA GPU (use --small for a CPU smoke run)",
              file=sys.stderr)
        return 2
    device = "cpu" if args.small else "cuda"
    if args.small:   # the kernels themselves, interpreted (auto would pick the references)
        from flash_planner.kernels import dispatch

        dispatch.set_backend("triton")
    t0 = time.perf_counter()
    report: dict = {"device": torch.cuda.get_device_name() if device == "cuda"
                    else "CPU (Triton interpreter)", "small": args.small}
    # interpreted on a CPU a time says nothing: one timed call after the warm-up
    repeats = 1 if args.small else 50

    def part(key: str, rows) -> None:
        report[key] = rows
        report["wall_s"] = time.perf_counter() - t0
        if args.json_out is not None:
            args.json_out.write_text(json.dumps(report, indent=1))

    ceil = ceilings(device, args.small)
    if "ceilings" in args.parts:
        part("ceilings", ceil)
    bw = ceil["copy_gbps"] * 1e9
    if "gemm" in args.parts or "thor" in args.parts:
        part("gemm", gemm_rows(device, args.small, bw, repeats, args.tune))
    if "gemm" in args.parts:
        part("gate_up", gate_up_rows(device, args.small, repeats))
        part("moe", moe_rows(device, args.small, bw, repeats))
    if "thor" in args.parts:
        one = [r["of_copy_bw"] for r in report["gemm"] if r["format"] == "nvfp4"
               and r["rows"] == 1]
        part("thor", thor_rows(max(one) if one else 0.0))
    if "slices" in args.parts:
        part("slices", slice_rows(device, args.small, bw, 3 if args.small else 20,
                                  tuple(args.slices)))
    if "demo" in args.parts:
        part("demo", demo_rows(device, args.small, tuple(args.demo_methods),
                               tuple(args.demo_forwards), args.demo_tasks))
    if "profile" in args.parts:
        part("profile", profile_rows(device, args.small))
        part("sdpa", sdpa_rows(device))
    if "vision" in args.parts:
        import vision

        part("vision", vision.vision_rows(device, args.small))
    if "batch" in args.parts:
        part("batch", batch_rows(device, args.small, 3 if args.small else 20))
    print(f"{report['device']}; wall {time.perf_counter() - t0:.0f} s")
    print_tables(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
