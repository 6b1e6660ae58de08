"""bench/gpu.py runs (`--small`: tiny shapes, the Triton kernels interpreted on a CPU), so the
GPU yardstick cannot rot between the sessions that have a GPU; its JSON holds every part."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "gpu.py"


def test_the_gpu_bench_runs_small_and_reports_every_part(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--small", "--json-out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["small"] and report["ceilings"]["copy_gbps"] > 0
    gemm = report["gemm"]
    assert {r["format"] for r in gemm} == {"bf16", "fp8", "nvfp4", "int4"}
    assert all(r["ms"] > 0 and r["graph_ms"] > 0 and r["weight_bytes"] > 0 for r in gemm)
    # the quantized layouts read fewer bytes than bf16 weights of the same shape
    by = {(r["shape"], r["format"]): r["weight_bytes"] for r in gemm}
    assert all(by[(s, f)] < by[(s, "bf16")] for s, f in by if f != "bf16")
    # each quantized row has the tiled kernel and the counted configuration beside it
    assert all(r["tiled_ms"] > 0 and r["counted_ms"] > 0 and r["over_bf16"] > 0
               for r in gemm if r["format"] != "bf16")
    # and the vendor candidates (kernels/gemm/vendor.py), run on the same rows: tinygemm
    # computes our int4 weights (W4A16), cuBLASLt's e4m3 GEMM rounds the rows too (W8A8);
    # block-scaled FP4 says why it is absent
    vendor = {(r["format"], v["name"]): v for r in gemm for v in r.get("vendor", ())}
    assert {f for f, _ in vendor} == {"fp8", "nvfp4", "int4"}
    int4 = vendor["int4", "tinygemm int4"]
    assert int4["numerics"] == "W4A16" and int4["graph_ms"] > 0 and int4["rel_diff"] < 1e-4
    fp8 = vendor["fp8", "scaled_mm e4m3"]
    assert fp8["numerics"] == "W8A8" and fp8["graph_ms"] > 0 and 0 < fp8["rel_diff"] < 0.2
    assert "compute capability 10" in vendor["nvfp4", "scaled_mm e2m1"]["unavailable"]
    assert {(r["format"], r["rows"]) for r in report["gate_up"]} == {
        (f, m) for f in ("fp8", "nvfp4", "int4") for m in (1, 16)}
    assert all(r["fused_ms"] > 0 and r["apart_ms"] > 0 for r in report["gate_up"])
    assert [r["model"] for r in report["thor"]] == ["Qwen3.6-27B", "Qwen3.6-35B-A3B"]
    assert "Thor line" in proc.stdout
    slices = report["slices"]
    assert {(r["slice"], r["weights"], r["rows"]) for r in slices} == {
        (n, w, rows) for n in ("27B", "35B-A3B") for w in ("bf16", "nvfp4")
        for rows in (1, 16)}
    assert all(r["ms"] > 0 and r["gb_per_forward"] > 0 for r in slices)
    # the NVFP4 slice reads fewer bytes than the bf16 one; a verify reads more experts
    gb = {(r["slice"], r["weights"], r["rows"]): r["gb_per_forward"] for r in slices}
    assert gb["27B", "nvfp4", 1] < gb["27B", "bf16", 1] == gb["27B", "bf16", 16]
    assert gb["35B-A3B", "bf16", 16] > gb["35B-A3B", "bf16", 1]
    assert gb["35B-A3B", "nvfp4", 1] < gb["35B-A3B", "bf16", 1]      # NVFP4 experts too
    moe = report["moe"]
    assert {(r["format"], r["rows"]) for r in moe} == {
        (f, m) for f in ("bf16", "fp8", "nvfp4", "int4") for m in (1, 4)}
    assert all(r["ms"] > 0 and r["graph_ms"] > 0 and r["tiled_ms"] > 0 and r["weight_bytes"] > 0
               for r in moe)
    demo = report["demo"]
    assert {(r["dtype"], r["method"]) for r in demo} == {
        (d, m) for d in ("fp32", "bf16") for m in ("auto", "none")}
    assert all(r["ttft_ms"] > 0 and r["tok_s"] > 0 and r["tokens_per_cycle"] >= 1
               for r in demo)
    # fp32 eager is the reference of plans equal; each engine's first request is reported
    assert all(r["plans_equal"] == r["tasks"] for r in demo if r["dtype"] == "fp32")
    assert sum(r["first_ttft_ms"] is not None for r in demo) == 2
    # where a plan's time goes, per dtype: the profiler saw the engine's ops
    profiled = {r["dtype"]: r for r in report["profile"]}
    assert set(profiled) == {"fp32", "bf16"}
    assert all(any(op["op"] == "aten::mm" for op in r["ops"]) for r in profiled.values())
    sdpa = {(r["dtype"], r["backend"]): r for r in report["sdpa"]}
    assert all(sdpa[d, b]["ms"] > 0 for d in ("float32", "bfloat16") for b in ("math",
                                                                              "engine"))
    # the vision tower per image at both models' widths
    vision = report["vision"]
    assert {(r["model"], r["size"]) for r in vision} == {
        (m, s) for m in ("Qwen3.6-27B", "Qwen3.6-35B-A3B") for s in (32, 64)}
    assert all(r["tower_ms"] > 0 and r["tokens"] > 0 and r["slice_prefill_ms"] > 0
               and r["ttft_ms_est"] > r["tower_ms"] for r in vision)
    assert "one image: the vision tower" in proc.stdout


def test_the_full_run_needs_a_gpu_and_says_so_without_one():
    import torch

    args = ["--help"] if torch.cuda.is_available() else []   # with one: only its usage
    proc = subprocess.run([sys.executable, str(BENCH), *args], capture_output=True,
                          text=True, timeout=120)
    if args:
        assert proc.returncode == 0 and "--small" in proc.stdout
    else:
        assert proc.returncode == 2 and "needs a CUDA GPU (use --small" in proc.stderr


def test_the_batch_part_runs_small_when_asked_for(tmp_path):
    """`batch` (not in the default parts: it compiles 10 more graphs on a GPU) times 8
    requests at once against one over slots of one batch state."""
    out = tmp_path / "batch.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--small", "--parts", "batch",
                           "--json-out", str(out)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["batch"]
    assert {(r["forward"], r["rows"], r["batch"]) for r in rows} == {
        ("eager", 1, 8), ("eager", 16, 8)}
    assert all(r["ms_one"] > 0 and r["ms_batch"] > 0 and r["aggregate"] > 0 for r in rows)
    assert "8 requests at once against one" in proc.stdout
