"""bench/serve_load.py --scaling runs on `flash-planner serve` as it is: one client alone, N
closed-loop clients and bursts of N on the same tasks, every answer's raw text equal to the
task's alone. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "serve_load.py"


def test_the_serve_scaling_bench_runs_small_and_concurrency_changes_no_text():
    proc = subprocess.run([sys.executable, str(BENCH), "--scaling", "--n", "4", "--clients",
                           "2", "--rounds", "1", "--json"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert report["mode"] == "scaling" and report["n_clients"] == 2 and report["tasks"] == 4
    for name in ("alone", "clients", "burst"):
        row = report[name]
        assert row["tokens"] > 0 and row["wall_s"] > 0
        assert row["mismatches"] == 0, name
    for name in ("clients", "burst"):
        row = report[name]
        assert abs(row["vs_alone"] - row["tok_s"] / report["alone"]["tok_s"]) < 1e-9
