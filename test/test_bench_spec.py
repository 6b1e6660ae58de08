"""bench/spec.py runs on the engine as it is (a bench that no longer runs is found by the
suite, not by the next `make bench`), and every mode it times is lossless."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "spec.py"


def test_the_speculative_loop_bench_runs_and_every_mode_is_lossless():
    proc = subprocess.run([sys.executable, str(BENCH), "--sizes", "tiny", "--new-tokens", "16",
                           "--repeats", "1", "--json"], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout[proc.stdout.index("{"):])
    rows = [r for config in report["results"] for r in config["rows"]]
    assert [r["mode"] for r in rows] == ["plain", "dflash", "replay@4", "replay@all"]
    assert all(r["lossless"] for r in rows)
    assert rows[-1]["tokens_per_cycle"] > rows[0]["tokens_per_cycle"] == 1.0
