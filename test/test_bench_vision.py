"""bench/vision.py runs (`--small`: a narrow two-block tower, small images) and reports
every model and size with the tokens the tower makes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "vision.py"


def test_the_vision_bench_runs_small_and_reports_every_size():
    proc = subprocess.run([sys.executable, str(BENCH), "--small", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    rows = report["rows"]
    assert {(r["model"], r["size"]) for r in rows} == {
        (m, s) for m in ("Qwen3.6-27B", "Qwen3.6-35B-A3B") for s in (32, 64)}
    for r in rows:
        # 16-pixel patches, merged 2 x 2: one token per 32 x 32 pixels
        assert r["patches"] == (r["size"] // 16) ** 2 and r["tokens"] == r["patches"] // 4
        assert r["out"] == [r["tokens"], {"Qwen3.6-27B": 5120, "Qwen3.6-35B-A3B": 2048}[
            r["model"]]]
        assert r["tower_ms"] > 0 and r["preprocess_ms"] > 0


def test_bad_sizes_are_refused_naming_the_flag():
    proc = subprocess.run([sys.executable, str(BENCH), "--sizes", "8"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "--sizes" in proc.stderr


def test_the_ttft_estimate_runs_small_and_adds_the_slices_prefill():
    proc = subprocess.run([sys.executable, str(BENCH), "--small", "--ttft", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout)["rows"]
    assert {(r["model"], r["size"]) for r in rows} == {
        (m, s) for m in ("Qwen3.6-27B", "Qwen3.6-35B-A3B") for s in (32, 64)}
    for r in rows:
        assert r["prefill_rows"] == r["tokens"] + 32 and r["slice_prefill_ms"] > 0
        depth = {"Qwen3.6-27B": 64, "Qwen3.6-35B-A3B": 40}[r["model"]]
        assert abs(r["ttft_ms_est"] - (r["tower_ms"] + r["slice_prefill_ms"] * depth / 4)) \
            < 1e-6 * r["ttft_ms_est"]
