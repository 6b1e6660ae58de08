"""Host cost per forward, eager against compiled, and what it does to the demo planner.

Part 1: hybrid targets of tiny width (hidden 64, so the arithmetic is negligible and what is
left is the host's dispatch) at depths 4, 40 and 64 with the Qwen3.5/3.6 layout (3 Gated
DeltaNet layers, then 1 attention layer). For each, an eager and a compiled engine
(`EngineConfig.compile`) are loaded in one process; greedy decode must give the same tokens
on both before any timing is printed. Then, per engine: milliseconds per target forward for
plain decode (1 row) and for a 16-row verify block (with per-step checkpoints), each forward
followed by its commit, median of `--reps` runs of `--forwards` forwards.

Part 2: the demo planner (its preset, fp32 CPU) through the planner service with the prefix
snapshot on, eager against compiled: TTFT with a prefix hit and decode tokens/s over
`--tasks` held-out tasks.

Compile time is printed as it happened in this run: cold when the on-disk cache
(`~/.cache/flash_planner/torch_compile`, or $TORCHINDUCTOR_CACHE_DIR) was empty, warm
otherwise; `--cold` points the cache at a fresh temporary directory first, and
`--cold-and-warm` measures both (a second process start reads the cache).

    python bench/overhead.py [--threads 1] [--depths 4 40 64] [--tasks 20] [--cold] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def per_forward_ms(engine, rows: int, forwards: int, reps: int) -> float:
    """Median over reps of the mean ms of one forward + commit of `rows` rows."""
    state, model = engine.state, engine.model
    ids = torch.full((1, rows), 7, dtype=torch.long)
    times = []
    for _ in range(reps):
        state.reset()
        model(torch.arange(3, 19)[None], state)
        state.commit(16)
        t0 = time.perf_counter()
        for _ in range(forwards):
            model(ids, state, record_steps=rows > 1, all_logits=rows > 1)
            state.commit(1 if rows == 1 else rows - 1)
        times.append((time.perf_counter() - t0) * 1000 / forwards)
    state.reset()
    return statistics.median(times)


def greedy(engine, n: int = 24) -> list[int]:
    from flash_planner.engine.generate import GenerationSettings, generate

    return generate(engine, list(range(3, 19)),
                    GenerationSettings(max_new_tokens=n, ignore_eos=True)).token_ids


def bench_depth(depth: int, workdir: Path, args) -> dict:
    from flash_planner.engine.engine import Engine, EngineConfig
    from flash_planner.train.tiny import write_tiny_checkpoint

    path = write_tiny_checkpoint(workdir / f"hybrid{depth}", kind="hybrid", layers=depth,
                                 attention_every=4, init=0.25)
    engines = {}
    for mode in ("off", "on"):
        log(f"depth {depth}: loading the {'compiled' if mode == 'on' else 'eager'} engine")
        engines[mode] = Engine.load(EngineConfig(
            model_path=str(path), device="cpu", dtype="fp32", max_context=512, method="none",
            compile=mode, max_batch=1), progress=lambda line: log("  " + line))
    eager, compiled = greedy(engines["off"]), greedy(engines["on"])
    if eager != compiled:
        at = next(i for i, (a, b) in enumerate(zip(eager, compiled)) if a != b)
        raise SystemExit(f"depth {depth}: compiled tokens differ from eager at token {at}")
    row = {"depth": depth, "compile": engines["on"].compile_report.as_dict()}
    for name, rows in (("decode", 1), ("verify16", 16)):
        for mode, engine in engines.items():
            row[f"{name}_{mode}_ms"] = per_forward_ms(engine, rows, args.forwards, args.reps)
    log(f"depth {depth}: {json.dumps(row)}")
    return row


def bench_demo(args) -> dict:
    from flash_planner.engine.engine import Engine
    from flash_planner.planning.presets import ModelPreset, default_skills_path
    from flash_planner.planning.request import PlanRequest
    from flash_planner.planning.service import PlannerConfig, PlannerService
    from flash_planner.planning.skills import SkillCatalog
    from flash_planner.train.corpus import make_corpus

    catalog = SkillCatalog.from_yaml(default_skills_path())
    preset = ModelPreset.load("demo")
    tasks = make_corpus(0, n_train=0, n_heldout=args.tasks)[1]
    out = {}
    for mode in ("off", "on"):
        log(f"demo: loading the {'compiled' if mode == 'on' else 'eager'} planner")
        # one plan at a time: the single-request forwards (no batch buckets compiled)
        engine = Engine.load(preset.engine_config(device="cpu", dtype="fp32", compile=mode,
                                                  max_batch=1),
                             progress=lambda line: log("  " + line))
        service = PlannerService(engine, catalog, PlannerConfig(
            refusal_hint=preset.refusal_hint))
        service.warm_up()
        service.start()
        ttft, tps, plans = [], [], []
        try:
            for ex in tasks:
                r = service.plan(PlanRequest(ex.task, ex.context,
                                             enable_thinking=ex.thinking is not None))
                ttft.append(r.telemetry["ttft_ms"])
                tps.append(r.telemetry["decode_tokens_per_s"])
                plans.append(r.raw_text)
        finally:
            service.stop()
        out[mode] = {"ttft_ms": statistics.median(ttft), "decode_tps": statistics.median(tps),
                     "plans": plans, "compile": (engine.compile_report.as_dict()
                                                 if engine.compile_report else None)}
    out["same_text"] = out["off"].pop("plans") == out["on"].pop("plans")
    return out


def print_report(report: dict) -> None:
    print(f"host cost per target forward, {report['threads']} thread(s), fp32 CPU, hybrid "
          f"3 GDN : 1 attention, hidden 64 (ms; median of {report['reps']} x "
          f"{report['forwards']} forwards)")
    head = (f"{'depth':>5}{'decode eager':>14}{'compiled':>10}{'ratio':>8}"
            f"{'verify16 eager':>16}{'compiled':>10}{'ratio':>8}{'compile s':>11}{'graphs':>8}")
    print(head + "\n" + "-" * len(head))
    for r in report["depths"]:
        cells = ""
        for name in ("decode", "verify16"):
            e, c = r[f"{name}_off_ms"], r[f"{name}_on_ms"]
            cells += f"{e:>{14 if name == 'decode' else 16}.2f}{c:>10.2f}{c / e:>7.3f}x"
        print(f"{r['depth']:>5}{cells}{r['compile']['seconds']:>11.1f}"
              f"{r['compile']['graphs']:>8}")
    demo = report.get("demo")
    if demo:
        on, off = demo["on"], demo["off"]
        print(f"\ndemo planner, {report['tasks']} held-out tasks, prefix snapshot on "
              f"(medians): TTFT {off['ttft_ms']:.1f} ms eager -> {on['ttft_ms']:.1f} ms "
              f"compiled ({on['ttft_ms'] / off['ttft_ms']:.2f}x); decode "
              f"{off['decode_tps']:.0f} -> {on['decode_tps']:.0f} tok/s "
              f"({on['decode_tps'] / off['decode_tps']:.2f}x); same text: "
              f"{demo['same_text']}; compile {on['compile']['seconds']:.1f} s, "
              f"{on['compile']['graphs']} graphs")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--depths", type=int, nargs="+", default=[4, 40, 64])
    parser.add_argument("--forwards", type=int, default=20)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tasks", type=int, default=20, help="demo tasks (0: skip the demo)")
    parser.add_argument("--cold", action="store_true",
                        help="compile into a fresh, empty cache directory")
    parser.add_argument("--cold-and-warm", action="store_true",
                        help="run twice in new processes sharing one fresh cache: cold, warm")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.cold_and_warm:
        return cold_and_warm(argv or [])
    if args.cold:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="fp-compile-")
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [bench_depth(d, Path(tmp), args) for d in args.depths]
    report = {"threads": torch.get_num_threads(), "reps": args.reps,
              "forwards": args.forwards, "tasks": args.tasks, "depths": rows,
              "demo": bench_demo(args) if args.tasks else None,
              "wall_s": time.perf_counter() - t0}
    print(json.dumps(report) if args.json else "", end="")
    if not args.json:
        print_report(report)
        print(f"wall time {report['wall_s']:.0f} s")
    return 0


def cold_and_warm(argv: list[str]) -> int:
    """The same run twice, each a new process, on one fresh cache: the second start of a
    node reads the graphs the first compiled."""
    rest = [a for a in argv if a not in ("--cold-and-warm", "--cold", "--json")]
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="fp-compile-"))
    seconds = {}
    for label in ("cold", "warm"):
        log(f"--- {label} cache ---")
        out = subprocess.run([sys.executable, __file__, *rest, "--json"], env=env, check=True,
                             stdout=subprocess.PIPE, text=True).stdout
        report = json.loads(out)
        seconds[label] = [(r["depth"], r["compile"]["seconds"]) for r in report["depths"]]
        if label == "warm":
            print_report(report)
    print("\ncompile time per depth, cold cache -> warm cache (a second start): "
          + ", ".join(f"{d}: {c:.1f} s -> {w:.1f} s"
                      for (d, c), (_, w) in zip(seconds["cold"], seconds["warm"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
