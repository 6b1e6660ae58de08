"""bench/batch.py runs on the planner service as it is (`--small`: 1 and 2 clients, one
method, a few tasks), its JSON holds every cell of both services, and every request's text
under batching equals the same task alone. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "batch.py"

SUMMARY_KEYS = {"requests", "failed", "tokens", "wall_s", "tok_s", "latency_ms_p50",
                "latency_ms_p95", "ttft_ms_p50", "ttft_ms_p95", "tokens_per_cycle",
                "tokens_per_verify", "most_at_once", "mismatches", "state_mb_per_cycle"}


def test_the_batch_bench_runs_small_and_batching_changes_no_text():
    proc = subprocess.run([sys.executable, str(BENCH), "--small", "--json"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert report["small"] and report["clients"] == [1, 2]
    assert len(report["methods"]) == 1
    method = report["methods"][0]
    rows = report["rows"]
    assert [(r["method"], r["clients"]) for r in rows] == [(method, 1), (method, 2)]
    for row in rows:
        assert row["tasks"] == report["tasks"] > 0
        assert "tok_s_ratio" in row
        # the headline: batched at n clients over single at one client, from the same run
        alone = rows[0]["single"]["tok_s"]
        assert abs(row["tok_s_vs_alone"] - row["batched"]["tok_s"] / alone) < 1e-9
        for name in ("batched", "single"):
            cell = row[name]
            assert set(cell) >= SUMMARY_KEYS
            assert cell["requests"] == report["tasks"]
            assert cell["failed"] == 0
            assert cell["tokens"] > 0
            assert cell["state_mb_per_cycle"] > 0      # KV rows and GDN state, every cycle
            # batched or not, every request's raw text is the task's text alone
            assert cell["mismatches"] == 0, (row["clients"], name)
        # the one-at-a-time service never decodes two requests together
        assert row["single"]["most_at_once"] == 1
    growth = report["latency_growth"][method]
    assert growth["clients"] == 2 and set(growth) == {"clients", "batched", "single"}
