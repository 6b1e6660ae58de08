"""Latency a robot feels: TTFT with and without the prefix snapshot, first step vs whole plan.

On the demo planner, through the planner service (the node's path), the same held-out tasks
run in turn on two engines in one process: one keeps the system prompt's state (warmed up
at start, as the node does at configure) and restores it per request; the other prefills
it for every request. Printed: TTFT (request start -> first token), time to the first
validated plan step (streamed) and to the whole plan, p50/p95 and the ratios:

- TTFT with the snapshot / without it (goal <= 0.2x);
- first step streamed / whole plan, what a robot waits for its first action with streaming
  and without it (goal <= 0.5x).

Then an analytic line for Qwen3.6-27B on Thor (nothing measured there): the snapshot's
bytes from the architecture (FACTS.md: FP8 KV 32 KiB per token, GDN state ~144 MiB, conv
windows, the proposers' taps) copied at 273 GB/s (read and write), against prefilling the
prefix at `--thor-prefill-tps` tokens/s (default 300: "a few hundred", no measured figure
exists here), for the shipped catalog's prefix and for a 1,500-token catalog.

    python bench/latency.py [--n 100] [--threads 1] [--thor-prefill-tps 300] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from flash_planner.engine.engine import Engine
from flash_planner.planning.presets import ModelPreset, default_skills_path
from flash_planner.planning.request import PlanRequest
from flash_planner.planning.service import PlannerConfig, PlannerService
from flash_planner.planning.skills import SkillCatalog
from flash_planner.ros.diagnostics import percentile
from flash_planner.train.corpus import make_corpus

THOR_GBPS = 273.0
# Qwen3.6-27B (FACTS.md section 2): 16 full-attention layers x 4 KV heads x 256 dims, K and
# V, FP8; 48 GDN layers of 48 value heads x 128 x 128 fp32 states; conv windows of 3 rows of
# 2*16*128 + 48*128 channels; taps: the MTP head's last layer (hidden 5120, bf16) for every
# prefix row and the DFlash drafter's 5 layers for its 128-row window.
KV_BYTES_PER_TOKEN = 16 * 4 * 256 * 2
GDN_BYTES = 48 * 48 * 128 * 128 * 4 + 48 * 3 * (2 * 16 * 128 + 48 * 128) * 4
TAP_BYTES_PER_TOKEN = 5120 * 2
DFLASH_TAP_BYTES = 5 * 5120 * 2 * 128


def snapshot_bytes_27b(prefix_tokens: int) -> int:
    return (prefix_tokens * (KV_BYTES_PER_TOKEN + TAP_BYTES_PER_TOKEN) + GDN_BYTES
            + DFLASH_TAP_BYTES)


def run(services: dict[str, PlannerService], tasks) -> dict[str, dict[str, list[float]]]:
    got = {name: {"ttft": [], "first_step": [], "total": [], "restore": [], "hit": [],
                  "thinking": []} for name in services}
    for ex in tasks:
        for name, service in services.items():
            r = service.plan(PlanRequest(ex.task, ex.context,
                                         enable_thinking=ex.thinking is not None))
            t = r.telemetry
            got[name]["ttft"].append(t["ttft_ms"])
            got[name]["total"].append(t["total_ms"])
            got[name]["first_step"].append(t.get("first_step_ms", t["total_ms"]))
            got[name]["restore"].append(t["prefix_restore_ms"])
            got[name]["hit"].append(bool(t["prefix_hit"]))
            got[name]["thinking"].append(ex.thinking is not None)
    return got


def stats(values: list[float]) -> dict[str, float]:
    return {"mean": sum(values) / len(values), "p50": percentile(values, 50),
            "p95": percentile(values, 95)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=100, help="held-out tasks")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--thor-prefill-tps", type=float, default=300.0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--png-dir", type=Path, default=None,
                        help="write the chart there (make bench: docs/img)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    catalog = SkillCatalog.from_yaml(default_skills_path())
    preset = ModelPreset.load("demo")
    services = {}
    for name, cache in (("snapshot", True), ("no snapshot", False)):
        engine = Engine.load(preset.engine_config(device="cpu", dtype="fp32",
                                                  prefix_cache=cache))
        services[name] = PlannerService(engine, catalog, PlannerConfig(
            refusal_hint=preset.refusal_hint))
        services[name].warm_up()
        services[name].start()
    t0 = time.perf_counter()
    try:
        got = run(services, make_corpus(0, n_train=0, n_heldout=args.n)[1])
    finally:
        for service in services.values():
            service.stop()
    prefix = len(services["snapshot"].prompt("x", "", True)[1])
    snap_bytes = services["snapshot"].engine.prefix_cache.nbytes
    rows = {name: {k: stats(v) for k, v in g.items() if k not in ("hit", "thinking")} | {
        "hits": sum(g["hit"])} for name, g in got.items()}
    on, off = rows["snapshot"], rows["no snapshot"]
    ratios = {"ttft": on["ttft"]["mean"] / off["ttft"]["mean"],
              "first_step_vs_plan": on["first_step"]["mean"] / on["total"]["mean"]}
    g = got["snapshot"]
    for think in (True, False):
        picked = [i for i, t in enumerate(g["thinking"]) if t is think]
        ratios[f"first_step_vs_plan_thinking_{'on' if think else 'off'}"] = (
            sum(g["first_step"][i] for i in picked) / sum(g["total"][i] for i in picked))
    thor = []
    for tokens in (prefix, 1500):
        restore_ms = 2 * snapshot_bytes_27b(tokens) / (THOR_GBPS * 1e9) * 1000
        thor.append({"prefix_tokens": tokens, "snapshot_mb": snapshot_bytes_27b(tokens) / 2**20,
                     "restore_ms": restore_ms,
                     "prefill_ms": tokens / args.thor_prefill_tps * 1000})
    if args.png_dir is not None:
        from charts import grouped_bars

        parts = {"TTFT": "ttft", "first step": "first_step", "whole plan": "total"}
        print(grouped_bars(args.png_dir / "prefix_cache_latency.png",
                           f"prefix snapshot on and off: mean ms ({args.n} held-out tasks)",
                           list(parts),
                           {name: [rows[name][key]["mean"] for key in parts.values()]
                            for name in rows}, "ms", "bench/latency.py; first step = the "
                           "first plan step streamed", "{:.1f}"))
    if args.json:
        print(json.dumps({"n": args.n, "rows": rows, "ratios": ratios, "prefix_tokens": prefix,
                          "snapshot_bytes": snap_bytes, "thor": thor}))
        return 0
    print(f"demo planner, {args.n} held-out tasks through the planner service, "
          f"{torch.get_num_threads()} thread(s), fp32 CPU; system prompt prefix {prefix} "
          f"tokens, snapshot {snap_bytes / 2**10:.0f} KiB")
    head = f"{'':<14}{'TTFT ms':>22}{'first step ms':>22}{'whole plan ms':>22}{'hits':>7}"
    print(head + "\n" + "-" * len(head))
    for name, r in rows.items():
        cells = "".join(f"{r[k]['p50']:>9.1f} / {r[k]['p95']:<8.1f}".rjust(22)
                        for k in ("ttft", "first_step", "total"))
        print(f"{name:<14}{cells}{r['hits']:>7}")
    print("(p50 / p95)")
    print(f"TTFT with the snapshot / without: {ratios['ttft']:.2f}x (means; restore p50 "
          f"{on['restore']['p50']:.3f} ms)")
    print(f"first step streamed / whole plan: {ratios['first_step_vs_plan']:.2f}x (means; "
          f"thinking on {ratios['first_step_vs_plan_thinking_on']:.2f}x, off "
          f"{ratios['first_step_vs_plan_thinking_off']:.2f}x)")
    print(f"\nQwen3.6-27B on Thor, analytic (prefill at {args.thor_prefill_tps:.0f} tokens/s "
          f"assumed; restore = snapshot read + write at {THOR_GBPS:.0f} GB/s):")
    for t in thor:
        print(f"  prefix {t['prefix_tokens']:>5} tokens: snapshot {t['snapshot_mb']:.0f} MiB, "
              f"restore {t['restore_ms']:.1f} ms vs prefill {t['prefill_ms']:.0f} ms")
    print(f"wall time {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
