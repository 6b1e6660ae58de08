"""The vision tower's cost per image: preprocessing and tower time at the published widths.

A Qwen3.5/3.6 tower (`engine/models/qwen/vision.py`) with random weights (std 0.02) at the
27B's and the 35B-A3B's dimensions: depth 27, width 1152, MLP 4304, 16 heads, 16-pixel
patches merged 2 x 2 (transformers' `Qwen3_5VisionConfig` defaults, which third-party
copies of both checkpoints' configs repeat; not checked against the published files),
the merger projecting to the language model's width (5120 / 2048). For each square image
size: the patches (`engine/inputs/images.py`: resize, normalise, patchify; the pixel budget wide
enough to keep the size), the tower's time (median of `--repeats`), and the image tokens
the prompt gets, which the target then prefills like any other rows.

With `--ttft`, bench-gpu's `vision` part on this CPU instead (fp32): the tower, then the
prefill of the image's tokens and a 32-token task through a 4-layer slice of each model (its
vocabulary cut to 4,096 and the 35B-A3B's experts to 32, 8 per token as published: the same
work per token in less memory), and the TTFT estimate that scales the slice to the depth.

    python bench/vision.py [--sizes 224,448,896] [--repeats 3] [--threads 0] [--json]
    python bench/vision.py --ttft [--sizes 224,448] [--json]
    python bench/vision.py --small --json     (tests: a 2-block narrow tower, small images)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch
from weight_bytes import TARGETS, TOWER

from flash_planner.engine.inputs.images import ImageConfig, to_patches
from flash_planner.engine.models.qwen.vision import VisionConfig, VisionTower
from flash_planner.engine.threads import apply_threads

SMALL = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=4, patch_size=16,
             num_position_embeddings=64, hidden_act="gelu_pytorch_tanh")


def tower(dims: dict, out: int, seed: int = 0, device: str = "cpu",
          dtype: torch.dtype = torch.float32) -> VisionTower:
    cfg = VisionConfig.from_hf_dict({**dims, "out_hidden_size": out}, "bench")
    model = VisionTower(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02 + (p.dim() == 1))
    return model.to(device, dtype)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(model: VisionTower, size: int, repeats: int) -> dict:
    cfg = ImageConfig(patch_size=model.cfg.patch_size, merge_size=model.cfg.spatial_merge_size,
                      min_pixels=16 * 16, max_pixels=max(size * size, 16 * 16))
    image = np.random.default_rng(size).integers(0, 256, (size, size, 3), dtype=np.uint8)
    t0 = time.perf_counter()
    patches = to_patches(image, cfg)
    prep_ms = (time.perf_counter() - t0) * 1e3
    weight = next(model.parameters())
    pixels = patches.patches.to(weight.device, weight.dtype)
    device = str(weight.device)
    times = []
    with torch.inference_mode():
        for _ in range(repeats):
            _sync(device)
            t0 = time.perf_counter()
            out = model(pixels, [patches.grid])
            _sync(device)
            times.append((time.perf_counter() - t0) * 1e3)
    return {"size": size, "patches": int(patches.patches.shape[0]), "tokens": patches.tokens,
            "out": list(out.shape), "preprocess_ms": prep_ms,
            "tower_ms": statistics.median(times), "repeats": repeats}


def prefill_ms(raw: dict, rows: int, dtype: torch.dtype, device: str, repeats: int) -> float:
    """ms of one eager prefill of `rows` rows (a fresh state each time) through the target
    of `raw` (random weights, bf16 Linears: slice_model)."""
    from slices import slice_model

    from flash_planner.engine.state.cache import InferenceState
    from flash_planner.kernels.gemm.tune import time_ms as timed_ms

    cfg, model = slice_model(raw, "bf16", dtype, device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, rows), generator=gen).to(device)

    def run() -> None:
        state = InferenceState(cfg, capacity=rows + 16, max_steps=16, kv_dtype=dtype,
                               compute_dtype=dtype, device=torch.device(device))
        with torch.inference_mode():
            model(ids, state)

    return timed_ms(run, repeats)


def vision_rows(device: str, small: bool, sizes: tuple[int, ...] | None = None,
                repeats: int | None = None) -> list[dict]:
    """The tower's ms per image, and the prefill of its tokens and a 32-token task through
    a 4-layer slice of the model (`prefill_ms`): a TTFT with one image is about the tower
    plus the prefill scaled to the model's depth (`ttft_ms_est`, an estimate, not
    measured)."""
    from slices import TINY
    from weight_bytes import QWEN3_6_27B, QWEN3_6_35B_A3B

    from flash_planner.kernels import dispatch

    if small:   # the torch references: interpreted kernels would take seconds a forward
        dispatch.set_backend("auto")
    dims = SMALL if small else TOWER
    sizes = sizes or ((32, 64) if small else (224, 448, 896))
    repeats = repeats or (2 if small else 10)
    dtype = torch.float32 if small or device == "cpu" else torch.bfloat16
    out = []
    for (name, width), raw in zip(TARGETS.items(), (QWEN3_6_27B, QWEN3_6_35B_A3B)):
        model = tower(dims, width, device=device, dtype=dtype)
        measure(model, min(sizes), 1)                  # first calls, untimed
        rows = [{"model": name, **measure(model, size, repeats)} for size in sizes]
        del model
        # On a CPU the vocabulary is cut to 4,096 and the 35B-A3B's experts to 32 (of 256;
        # still 8 per token): a prefill's work is the same (one lm_head row; each token's 8
        # experts), its memory fits beside the rest (fp32: 13 GB of experts otherwise)
        cut = {"vocab_size": 4096, **({"num_experts": 32} if "num_experts" in raw else {})}
        four = {**raw, "num_hidden_layers": 4, **(TINY if small else {}),
                **(cut if device == "cpu" and not small else {})}
        for r in rows:
            r["prefill_rows"] = r["tokens"] + 32
            r["slice_prefill_ms"] = prefill_ms(four, r["prefill_rows"], dtype, device,
                                               max(1, repeats // 5))
            r["ttft_ms_est"] = r["tower_ms"] + r["slice_prefill_ms"] * raw[
                "num_hidden_layers"] / 4
        out += rows
    return out


def print_vision(rows: list[dict]) -> None:
    print("one image: the vision tower, then its tokens + 32 prefilled through a 4-layer "
          "slice; TTFT est. = tower + slice x layers / 4 (random weights)\n"
          f"{'model':<18}{'image':>10}{'tokens':>8}{'tower ms':>10}{'slice ms':>10}"
          f"{'TTFT est. ms':>14}")
    for r in rows:
        print(f"{r['model']:<18}{r['size']:>6} px{r['tokens']:>8}{r['tower_ms']:>10.1f}"
              f"{r['slice_prefill_ms']:>10.1f}{r['ttft_ms_est']:>14.1f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default=None, help="square image sides in pixels "
                        "(default 224,448,896)")
    parser.add_argument("--repeats", type=int, default=None, help="tower runs per size "
                        "(median; default 3)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: the "
                        "engine's auto)")
    parser.add_argument("--small", action="store_true", help="a quick run (tests)")
    parser.add_argument("--ttft", action="store_true", help="also prefill the image's tokens "
                        "through a 4-layer slice of each model: a TTFT estimate")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        sizes = [int(s) for s in (args.sizes or ("32,64" if args.small else "224,448,896"))
                 .split(",") if s.strip()]
    except ValueError:
        parser.error(f"--sizes takes comma-separated integers, got {args.sizes!r}")
    if not sizes or any(s < 16 for s in sizes):
        parser.error("--sizes must name sides of at least 16 pixels")
    repeats = args.repeats or (1 if args.small else 3)
    if repeats < 1 or args.threads < 0:
        parser.error("--repeats must be >= 1 and --threads >= 0")
    threads = apply_threads(args.threads, torch.device("cpu"))
    if args.ttft:
        rows = vision_rows("cpu", args.small, tuple(sizes), repeats)
        if args.json:
            print(json.dumps({"small": args.small, "threads": threads.intra_op,
                              "rows": rows}))
        else:
            print(f"{threads.intra_op} torch thread(s), fp32 CPU")
            print_vision(rows)
        return 0
    rows = []
    for name, out in TARGETS.items():
        model = tower(SMALL if args.small else TOWER, out)
        measure(model, min(sizes), 1)                     # first calls, untimed
        for size in sizes:
            print(f"{name}: {size} x {size}", file=sys.stderr, flush=True)
            rows.append({"model": name, **measure(model, size, repeats)})
    report = {"small": args.small, "threads": threads.intra_op, "rows": rows}
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"vision tower, random weights, {threads.intra_op} torch thread(s), fp32 CPU")
    print(f"{'model':<18}{'image':>10}{'patches':>9}{'tokens':>8}{'prep ms':>9}"
          f"{'tower ms':>10}{'ms/token':>10}")
    for r in rows:
        print(f"{r['model']:<18}{r['size']:>6} px{r['patches']:>9}{r['tokens']:>8}"
              f"{r['preprocess_ms']:>9.1f}{r['tower_ms']:>10.1f}"
              f"{r['tower_ms'] / r['tokens']:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
