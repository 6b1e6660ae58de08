"""Start-up of a compiled engine: cold (an empty compile cache) and warm (the cache the cold
start filled), each a new process, by phase, beside the compiled forward's per-token cost.

Models:
- standin: the 27B's depth with tiny width (bench/overhead.py's hybrid: 64 layers, 3 GDN :
  1 attention, hidden 64), one sequence, no proposer (`--depth`);
- demo: the demo planner as the node starts it (its preset, fp32 CPU, `--max-batch`
  requests at once, the MTP head and the DFlash drafter): PlannerService.load, then its
  warm-up requests, then a first plan;
- node: the real `planner_node` process (rclpy) with the demo and the demo's warm cache
  (`engine.compile` on, `engine.max_batch` 8), from its start to its "active" log line:
  configured, warmed up and serving (runs after the demo; warm only).

Phases per start: import (torch and flash_planner), load (weights, state, the rest of
Engine.load), graphs (compiled or read from the cache at warm-up: the count of each, and of
those seconds dynamo's tracing), warm-up (the planner's warm-up requests; demo only), ready
(serving: the sum so far), first request, and when the buckets deferred to the background
(`EngineConfig.compile_lazy`, on) are all compiled, from the process's start. The warm
stand-in process also loads the eager engine, checks that greedy decoding gives the same
tokens, and times a target forward eager and compiled (decode: 1 row; verify: 16 rows;
median of 5 x 20 forwards).

    python bench/startup.py [--models standin demo node] [--depth 64] [--max-batch 8] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

T0 = time.perf_counter()
HERE = Path(__file__).resolve().parent
TOKENS = 24


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _graph_seconds(report) -> dict:
    from torch._dynamo.utils import compilation_time_metrics

    return {"graphs": report.graphs, "read": report.read, "deferred": report.deferred,
            "compiled": report.graphs - report.read, "graphs_s": report.seconds,
            "trace_s": sum(compilation_time_metrics.get("bytecode_tracing", []))}


def start_standin(path: str, cache: str, warm: bool) -> dict:
    import torch

    from flash_planner.engine.engine import Engine, EngineConfig
    from flash_planner.engine.generate import GenerationSettings, generate

    torch.set_num_threads(1)
    imported = time.perf_counter() - T0

    def load(mode: str):
        return Engine.load(EngineConfig(model_path=path, device="cpu", dtype="fp32",
                                        max_context=512, method="none", compile=mode,
                                        compile_cache=cache, max_batch=1),
                           progress=lambda line: log("  " + line))

    t1 = time.perf_counter()
    engine = load("on")
    loaded = time.perf_counter() - t1
    out = {"import_s": imported, **_graph_seconds(engine.compile_report)}
    out["load_s"] = loaded - out["graphs_s"]
    t2 = time.perf_counter()
    settings = GenerationSettings(max_new_tokens=TOKENS, ignore_eos=True)
    tokens = generate(engine, list(range(3, 19)), settings).token_ids
    out["first_s"] = time.perf_counter() - t2
    out["ready_s"] = imported + loaded
    engine.wait_compiled()
    out["all_s"] = time.perf_counter() - T0
    if warm:
        sys.path.insert(0, str(HERE))
        from overhead import per_forward_ms

        eager = load("off")
        out["same_tokens"] = generate(eager, list(range(3, 19)), settings).token_ids == tokens
        for name, rows in (("decode", 1), ("verify16", 16)):
            for label, e in (("eager", eager), ("compiled", engine)):
                out[f"{name}_{label}_ms"] = per_forward_ms(e, rows, 20, 5)
    return out


def start_demo(cache: str, max_batch: int) -> dict:
    import torch

    from flash_planner.engine.engine import Engine
    from flash_planner.planning.presets import ModelPreset, default_skills_path
    from flash_planner.planning.request import PlanRequest
    from flash_planner.planning.service import PlannerConfig, PlannerService
    from flash_planner.planning.skills import SkillCatalog

    torch.set_num_threads(1)
    imported = time.perf_counter() - T0
    preset = ModelPreset.load("demo")
    catalog = SkillCatalog.from_yaml(default_skills_path())
    t1 = time.perf_counter()
    engine = Engine.load(preset.engine_config(device="cpu", compile="on", compile_cache=cache,
                                              max_batch=max_batch),
                         progress=lambda line: log("  " + line), hold_background=True)
    loaded = time.perf_counter() - t1
    service = PlannerService(engine, catalog, PlannerConfig(refusal_hint=preset.refusal_hint))
    out = {"import_s": imported, **_graph_seconds(engine.compile_report)}
    out["load_s"] = loaded - out["graphs_s"]
    t2 = time.perf_counter()
    service.warm_up()
    out["warm_up_s"] = time.perf_counter() - t2
    service.start()
    try:
        t3 = time.perf_counter()
        result = service.plan(PlanRequest("pick up the red cup and put it on the table", ""))
        out["first_s"] = time.perf_counter() - t3
        out["first_ok"] = result.plan is not None
    finally:
        service.stop()
    out["ready_s"] = imported + loaded + out["warm_up_s"]
    engine.wait_compiled()
    out["all_s"] = time.perf_counter() - T0
    return out


def child(args) -> int:
    if args.one == "standin":
        row = start_standin(args.path, args.cache, args.warm)
    else:
        row = start_demo(args.cache, args.max_batch)
    print(json.dumps(row))
    return 0


def start_node(cache: str, max_batch: int) -> dict:
    """Seconds from the node's process start to its "active" line (then stopped by SIGINT,
    as a Ctrl-C of ros2 launch would)."""
    import signal

    log("--- node (planner_node), the demo's warm cache ---")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    args = {"model.device": "cpu", "model.dtype": "fp32", "engine.compile": "'on'",
            "engine.max_batch": max_batch}
    t0 = time.perf_counter()
    node = subprocess.Popen([sys.executable, "-m", "flash_planner.ros.node", "--ros-args",
                             *[a for k, v in args.items() for a in ("-p", f"{k}:={v}")]],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    active, lines = None, []
    for line in node.stderr:
        lines.append(line.rstrip())
        if "flash_planner active" in line:
            active = time.perf_counter() - t0
            break
    node.send_signal(signal.SIGINT)
    node.communicate(timeout=60)
    if active is None:
        sys.exit("the node did not become active:\n" + "\n".join(lines[-20:]))
    compiled = next((x for x in lines if "compiled" in x and "graphs" in x), "")
    return {"active_s": active, "compiled_line": compiled.split("]: ", 1)[-1]}


def run_start(model: str, cache: str, warm: bool, args, path: str = "") -> dict:
    cmd = [sys.executable, __file__, "--one", model, "--cache", cache,
           "--max-batch", str(args.max_batch), "--path", path] + (["--warm"] if warm else [])
    log(f"--- {model}, {'warm' if warm else 'cold'} cache ---")
    t0 = time.perf_counter()
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    row = json.loads(out.strip().splitlines()[-1])
    row["process_s"] = time.perf_counter() - t0
    return row


def print_report(report: dict) -> None:
    head = (f"{'model':<24}{'cache':<6}{'import':>7}{'load':>6}{'graphs':>8}{'of them':>8}"
            f"{'compiled':>9}{'read':>5}{'later':>6}{'warm-up':>8}{'ready':>7}{'1st req':>8}"
            f"{'all':>7}")
    print("start-up by phase, seconds (each start a new process, 1 torch thread, fp32 CPU; "
          "'of them': tracing; 'later': buckets compiled in the background)")
    print(head + "\n" + "-" * len(head))
    for name, starts in report["models"].items():
        for label in ("cold", "warm"):
            r = starts[label]
            print(f"{name:<24}{label:<6}{r['import_s']:>7.1f}{r['load_s']:>6.1f}"
                  f"{r['graphs_s']:>8.1f}{r['trace_s']:>8.1f}{r['compiled']:>9}"
                  f"{r['read']:>5}{r['deferred']:>6}{r.get('warm_up_s', 0.0):>8.1f}"
                  f"{r['ready_s']:>7.1f}{r['first_s']:>8.2f}{r['all_s']:>7.1f}")
    node = report.get("node")
    if node:
        print(f"\nplanner_node (demo, max_batch {report['max_batch']}, the demo's warm cache): "
              f"active {node['active_s']:.1f} s after its process started")
    standin = report["models"].get(f"standin ({report['depth']} layers)")
    if standin:
        w = standin["warm"]
        print(f"\nstand-in per target forward (ms, median of 5 x 20): decode "
              f"{w['decode_eager_ms']:.2f} eager -> {w['decode_compiled_ms']:.2f} compiled "
              f"({w['decode_compiled_ms'] / w['decode_eager_ms']:.3f}x); verify16 "
              f"{w['verify16_eager_ms']:.2f} -> {w['verify16_compiled_ms']:.2f} "
              f"({w['verify16_compiled_ms'] / w['verify16_eager_ms']:.3f}x); same tokens as "
              f"eager: {w['same_tokens']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["standin", "demo", "node"],
                        choices=["standin", "demo", "node"])
    parser.add_argument("--depth", type=int, default=64, help="the stand-in's layers")
    parser.add_argument("--max-batch", type=int, default=8, help="the demo's max_batch")
    parser.add_argument("--json", action="store_true")
    # one start in this process (what the parent runs)
    parser.add_argument("--one", choices=["standin", "demo"], help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    parser.add_argument("--path", default="", help=argparse.SUPPRESS)
    parser.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        return child(args)
    report = {"depth": args.depth, "max_batch": args.max_batch, "models": {}}
    with tempfile.TemporaryDirectory(prefix="fp-startup-") as tmp:
        for model in (m for m in args.models if m != "node"):
            cache, path = os.path.join(tmp, f"cache-{model}"), ""
            if model == "standin":
                from flash_planner.train.tiny import write_tiny_checkpoint

                path = str(write_tiny_checkpoint(Path(tmp) / "standin", kind="hybrid",
                                                 layers=args.depth, attention_every=4,
                                                 init=0.25))
                name = f"standin ({args.depth} layers)"
            else:
                name = f"demo (max_batch {args.max_batch})"
            report["models"][name] = {label: run_start(model, cache, label == "warm", args,
                                                       path)
                                      for label in ("cold", "warm")}
        if "node" in args.models:
            if "demo" not in args.models:
                sys.exit("the node row reads the demo's cache: run it with --models demo node")
            report["node"] = start_node(os.path.join(tmp, "cache-demo"), args.max_batch)
    print(json.dumps(report) if args.json else "", end="")
    if not args.json:
        print_report(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
