"""The planner service batched against one at a time: N closed-loop clients, the same tasks.

Two planner services on the demo (fp32, CPU), each on an engine of its own loaded from the
same preset config at the same torch threads (`--threads`; 0 = the engine's auto): batched
(engine.max_batch = `--max-batch`: its worker decodes up to that many requests together,
engine/batch.py) and single (max_batch 1: one request at a time, today's service). Clients
run a closed loop: each sends its next task as soon as its previous one returns, until the
cell's `--tasks` held-out tasks (the three sets of `train/corpus.heldout_sets` interleaved;
the same tasks in every cell) are done. Every request is greedy under its own grammar (the
service's defaults) with the method of its row (`PlanRequest.method`). The two services are
measured alternately: each cell's tasks in `--rounds` slices, each slice on both services
one after the other, the order flipped per slice and per cell, so drift in the machine's
speed (both cores are shared) hits both alike. Before each method's cells, both services run
the first tasks once at the most clients, untimed (first calls, auto's measurements).

Columns per method and client count: aggregate tokens/s (tokens the cell's requests
generated over its wall time) of batched and single; "vs alone": batched over single at one
client (the service one client gets, measured in the same run: the headline), "vs queued":
batched over single at the same client count; per-request latency
p50/p95 (submit -> result, queueing included) and TTFT p50/p95 (submit -> the first token's
feedback, as the client sees it), both services; tokens per cycle (tokens after each
request's first over the cycles it took part in), both services; tok/verify: tokens the
batched service's cycles published per cycle, one target verify each, from its load report
("-" where it has none); at once: the most requests the batched service was seen decoding
together (first to last token fed back); mismatches: requests whose raw_text differs from
the same task alone (one client, single service), both services. After the table, per
method: p50 latency at the most clients over p50 latency at one client, batched and single.
A slice ends with its last requests decoding with fewer beside them, which the batched
service pays and the single one does not: the tokens/s ratios understate a steady load.

    python bench/batch.py [--clients 1,2,4,8] [--methods none,dflash,mtp,auto] [--tasks 48]
                          [--rounds 2] [--threads 0] [--max-batch 8] [--compile] [--json]
    python bench/batch.py --small --json   (a quick run: 1 and 2 clients, auto, 4 tasks)
    python bench/batch.py --draft-caps 0,2,4,none [--clients 2,4,8] [--methods auto]

`--compile`: both engines compile their forwards, and a third service batches on eager
forwards (max_batch as the batched one), measured in the same slices: printed after the
table, compiled batched over eager batched aggregate tokens/s per cell, with the eager
service's mismatches.

`--draft-caps`: how many drafts per cycle an `auto` request should make in a batch. For each
client count n, 3n tasks go to a batch of n at once (engine/batch.py `Batch.run`, the
requests' own grammars; no service), once per cap (`none`: each request's own routing);
printed: aggregate tokens/s and tokens per cycle per cap.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from dataclasses import dataclass

import torch

from flash_planner.engine.engine import Engine
from flash_planner.engine.methods import METHODS
from flash_planner.planning.planner_config import PlannerConfig
from flash_planner.planning.presets import ModelPreset, default_skills_path
from flash_planner.planning.request import PlanRequest
from flash_planner.planning.service import PlannerService
from flash_planner.planning.skills import SkillCatalog
from flash_planner.train.corpus import heldout_sets

SERVICES = ("batched", "single")
EAGER = "eager"         # with --compile: a third service, batched on eager forwards
RESULT_TIMEOUT_S = 600.0
# where a request ended without running (queue full, an engine error, stopped)
NOT_RUN = ("", "error", "cancelled", "deadline")


@dataclass
class Sample:
    """One request as its client saw it."""
    index: int                  # the task's position in the cell's list
    text: str
    ran: bool
    tokens: int
    cycles: int
    latency_ms: float           # submit -> result
    ttft_ms: float              # submit -> first token's feedback
    first: float | None         # perf_counter of the first and last token's feedback
    last: float | None
    state_bytes: int = 0        # the state its cycles read and wrote besides the weights


def quantile(values: list[float], q: float) -> float:
    """Linear interpolation between the order statistics around q (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    at = q * (len(ordered) - 1)
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def one_request(service: PlannerService, index: int, example, method: str) -> Sample:
    seen: list[float] = []

    def on_feedback(_feedback) -> None:
        now = time.perf_counter()
        if not seen:
            seen.append(now)
        seen[1:] = [now]

    request = PlanRequest(task=example.task, context=example.context,
                          enable_thinking=example.thinking is not None, method=method)
    t0 = time.perf_counter()
    result = service.submit(request, on_feedback).result(RESULT_TIMEOUT_S)
    t1 = time.perf_counter()
    tel = result.telemetry
    ran = "new_tokens" in tel and result.finish_reason not in NOT_RUN
    if seen:
        ttft = (seen[0] - t0) * 1e3
    else:        # no token was fed back: the service's own account
        ttft = float(tel.get("queue_wait_ms", 0.0)) + float(tel.get("ttft_ms", 0.0))
    cycles = int(tel.get("cycles", 0))
    per_cycle = tel.get("state_bytes_per_cycle") or {}
    return Sample(index, result.raw_text, ran, int(tel.get("new_tokens", 0)), cycles,
                  (t1 - t0) * 1e3, ttft, seen[0] if seen else None, seen[-1] if seen else None,
                  cycles * (int(per_cycle.get("read", 0)) + int(per_cycle.get("written", 0))))


def closed_loop(service: PlannerService, tasks: list[tuple[int, object]], clients: int,
                method: str) -> tuple[list[Sample], float]:
    """`clients` threads, each taking the next task as soon as its last one returned; the
    samples and the wall time from the first submit to the last result."""
    pending = iter(tasks)
    lock = threading.Lock()
    samples: list[Sample] = []
    errors: list[BaseException] = []

    def client() -> None:
        while True:
            with lock:
                item = next(pending, None)
            if item is None:
                return
            try:
                sample = one_request(service, item[0], item[1], method)
            except BaseException as exc:       # re-raised on the main thread
                errors.append(exc)
                return
            with lock:
                samples.append(sample)

    threads = [threading.Thread(target=client, name=f"client-{i}") for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return sorted(samples, key=lambda s: s.index), wall


def most_at_once(samples: list[Sample]) -> int:
    """The most requests decoding together: overlaps of [first token, last token]."""
    events = sorted([(s.first, 1) for s in samples if s.first is not None]
                    + [(s.last, -1) for s in samples if s.last is not None])
    now = peak = 0
    for _, step in events:      # at equal times an end (-1) sorts before a start
        now += step
        peak = max(peak, now)
    return peak


def summarise(cell: Cell, reference: dict[int, str]) -> dict:
    samples, wall = cell.samples, cell.wall
    ran = [s for s in samples if s.ran]
    tokens = sum(s.tokens for s in ran)
    cycles = sum(s.cycles for s in ran)
    return {"requests": len(samples), "failed": len(samples) - len(ran), "tokens": tokens,
            "wall_s": wall, "tok_s": tokens / wall if wall > 0 else 0.0,
            "latency_ms_p50": quantile([s.latency_ms for s in samples], 0.5),
            "latency_ms_p95": quantile([s.latency_ms for s in samples], 0.95),
            "ttft_ms_p50": quantile([s.ttft_ms for s in ran], 0.5),
            "ttft_ms_p95": quantile([s.ttft_ms for s in ran], 0.95),
            "tokens_per_cycle": (sum(max(s.tokens - 1, 0) for s in ran) / cycles
                                 if cycles else 0.0),
            "tokens_per_verify": (cell.verify_tokens / cell.verifies
                                  if cell.verifies else None),
            "most_at_once": cell.peak,
            # engine/state/traffic.py: KV, GDN state, kept rows, conv, per request and cycle
            "state_mb_per_cycle": (sum(s.state_bytes for s in ran) / cycles / 1e6
                                   if cycles else 0.0),
            "mismatches": sum(reference.get(s.index) != s.text for s in samples)}


def verify_counts(service: PlannerService) -> tuple[int, int] | None:
    """The service's batch cycles (one target verify each) and the tokens they published so
    far, where its load report has them (a batching service); else None."""
    report = getattr(service, "load_report", None)
    if report is None:
        return None
    counts = report()
    if "cycles" not in counts or "tokens" not in counts:
        return None
    return int(counts["cycles"]), int(counts["tokens"])


@dataclass
class Cell:
    """One service's part of a cell, over its rounds."""
    samples: list[Sample]
    wall: float = 0.0
    peak: int = 0
    verifies: int | None = 0        # batch cycles and their tokens (None: not reported)
    verify_tokens: int = 0


def measure(services: dict[str, PlannerService], tasks: list[tuple[int, object]],
            clients: int, method: str, rounds: int, flip: bool) -> dict[str, Cell]:
    """The cell's tasks in `rounds` slices, each on both services in turn (ABBA...)."""
    size = -(-len(tasks) // rounds)
    out = {name: Cell([]) for name in services}
    names = tuple(services)
    for r in range(rounds):
        part = tasks[r * size:(r + 1) * size]
        if not part:
            break
        order = names if (r % 2 == 0) != flip else names[::-1]
        for name in order:
            before = verify_counts(services[name])
            samples, wall = closed_loop(services[name], part, clients, method)
            after = verify_counts(services[name])
            cell = out[name]
            cell.samples += samples
            cell.wall += wall
            cell.peak = max(cell.peak, most_at_once(samples))
            if before is None or after is None or after[0] < before[0] \
                    or cell.verifies is None:
                cell.verifies = None
            else:
                cell.verifies += after[0] - before[0]
                cell.verify_tokens += after[1] - before[1]
    return out


def progress(text: str) -> None:
    print(f"\r{text:<60}", end="", file=sys.stderr, flush=True)


def run(services: dict[str, PlannerService], tasks: list[tuple[int, object]],
        clients: list[int], methods: list[str], rounds: int) -> tuple[list[dict], dict]:
    rows, growth, flip = [], {}, False
    for method in methods:
        alone = 0.0                    # single's tokens/s at one client, once measured
        warm = tasks[:max(clients)]
        for name in services:
            progress(f"{method}: warming {name}")
            closed_loop(services[name], warm, max(clients), method)
        reference: dict[int, str] = {}
        if 1 not in clients:           # the same tasks alone, untimed
            progress(f"{method}: each task alone")
            alone, _ = closed_loop(services["single"], tasks, 1, method)
            reference = {s.index: s.text for s in alone}
        by_clients = {}
        for n in sorted(clients):
            progress(f"{method}: {n} client(s)")
            cell = measure(services, tasks, n, method, rounds, flip)
            flip = not flip
            if n == 1:
                reference = {s.index: s.text for s in cell["single"].samples}
            row = {"method": method, "clients": n, "tasks": len(tasks),
                   **{name: summarise(cell[name], reference) for name in services}}
            single = row["single"]["tok_s"]
            row["tok_s_ratio"] = row["batched"]["tok_s"] / single if single else 0.0
            if EAGER in services:      # compiled batched over eager batched, same slices
                eager = row[EAGER]["tok_s"]
                row["compiled_vs_eager"] = row["batched"]["tok_s"] / eager if eager else 0.0
            if n == 1:
                alone = single
            row["tok_s_vs_alone"] = (row["batched"]["tok_s"] / alone
                                     if 1 in clients and alone else None)
            rows.append(row)
            by_clients[n] = row
        most = max(clients)
        if 1 in by_clients and most != 1:
            growth[method] = {"clients": most, **{
                name: (by_clients[most][name]["latency_ms_p50"]
                       / by_clients[1][name]["latency_ms_p50"])
                if by_clients[1][name]["latency_ms_p50"] else 0.0 for name in SERVICES}}
    print(file=sys.stderr)
    return rows, growth


def print_table(report: dict) -> None:
    forwards = "compiled" if report["compiled"] else "eager"
    print(f"the demo (fp32 CPU, {report['threads']} torch thread(s), {forwards} forwards) "
          f"through the planner service: batched (max_batch {report['max_batch']}) against "
          "single (one at a time, max_batch 1)")
    print(f"closed-loop clients, {report['tasks']} held-out tasks per cell in "
          f"{report['rounds']} round(s), greedy under the request's grammar; mismatches: "
          "raw_text against the task alone (1 client, single); state MB/cyc: what a request's "
          "cycle reads and writes besides the weights (KV, GDN state, conv; batched)")
    print(f"{'':15}{'aggregate tok/s, batched vs':^31}  {'latency p50/p95 ms':^23}  "
          f"{'TTFT p50/p95 ms':^23}  {'tok/cycle':^12}{'tok/':>7}{'at':>5}  "
          f"{'mismatches':^12}{'state':>7}")
    head = (f"{'method':<7}{'clients':>8}{'batched':>9}{'single':>8}{'alone':>7}"
            f"{'queued':>7}  "
            f"{'batched':>11}{'single':>12}  {'batched':>11}{'single':>12}  "
            f"{'batch':>5}{'single':>7}{'verify':>7}{'once':>5}  {'batch':>5}{'single':>7}"
            f"{'MB/cyc':>7}")
    print(head + "\n" + "-" * len(head))
    for r in report["rows"]:
        b, s = r["batched"], r["single"]
        per_verify = "-" if b["tokens_per_verify"] is None else f"{b['tokens_per_verify']:.2f}"

        def pair(d: dict, key: str) -> str:
            return f"{d[key + '_p50']:.0f}/{d[key + '_p95']:.0f}"

        vs_alone = "-" if r["tok_s_vs_alone"] is None else f"{r['tok_s_vs_alone']:.2f}x"
        print(f"{r['method']:<7}{r['clients']:>8}{b['tok_s']:>9.0f}{s['tok_s']:>8.0f}"
              f"{vs_alone:>7}{r['tok_s_ratio']:>6.2f}x  {pair(b, 'latency_ms'):>11}"
              f"{pair(s, 'latency_ms'):>12}  {pair(b, 'ttft_ms'):>11}{pair(s, 'ttft_ms'):>12}"
              f"  {b['tokens_per_cycle']:>5.2f}{s['tokens_per_cycle']:>7.2f}"
              f"{per_verify:>7}{b['most_at_once']:>5}  {b['mismatches']:>5}{s['mismatches']:>7}"
              f"{b['state_mb_per_cycle']:>7.3f}")
    eager = [r for r in report["rows"] if "compiled_vs_eager" in r]
    if eager:
        print("compiled batched against eager batched (a third service, max_batch "
              f"{report['max_batch']}, the same slices): aggregate tok/s")
        for r in eager:
            print(f"{r['method']:<7}{r['clients']:>8}{r['batched']['tok_s']:>9.0f}"
                  f"{r[EAGER]['tok_s']:>8.0f}{r['compiled_vs_eager']:>7.2f}x  "
                  f"mismatches {r[EAGER]['mismatches']}")
    for method, g in report["latency_growth"].items():
        print(f"{method}: p50 latency at {g['clients']} clients / p50 latency alone: batched "
              f"{g['batched']:.2f}x, single {g['single']:.2f}x")
    failed = [(r["method"], r["clients"], name, r[name]["failed"]) for r in report["rows"]
              for name in (*SERVICES, EAGER) if name in r and r[name]["failed"]]
    for method, n, name, count in failed:
        print(f"{method}, {n} client(s), {name}: {count} request(s) did not run")
    peak = max((r["batched"]["most_at_once"] for r in report["rows"]), default=0)
    if peak <= 1 and max(report["clients"]) > 1:
        print("the batched service never decoded two requests at once here: its worker "
              "runs one request at a time (both columns measure the same service)")
    print(f"wall time {report['wall_s']:.1f} s")


def parse_list(text: str, kind, name: str, parser: argparse.ArgumentParser) -> list:
    try:
        values = [kind(v.strip()) for v in text.split(",") if v.strip()]
    except ValueError:
        parser.error(f"--{name} takes a comma-separated list, got {text!r}")
    if not values:
        parser.error(f"--{name} is empty")
    return values


def cap_sweep(engine: Engine, service: PlannerService, examples: list, sizes: list[int],
              caps: list[int | None], method: str) -> list[dict]:
    """Tokens/s of a batch of n under each draft cap, 3n tasks submitted at once."""
    from flash_planner.engine.batch import Batch
    from flash_planner.planning.local_job import plan_job
    from flash_planner.planning.ticket import PlanTicket

    def works(n: int) -> list:
        out = []
        for i, ex in enumerate(examples[:3 * n]):
            request = PlanRequest(task=ex.task, context=ex.context, id=f"s{i}",
                                  enable_thinking=ex.thinking is not None, method=method)
            ticket = PlanTicket(request, None)
            ticket.request = ticket.request.checked(4000, 4000)
            job = plan_job(service, ticket, service._words(ticket.request), {}, None)
            out.append(job.work)
        return out

    rows = []
    for n in sizes:
        for cap in caps:
            batch = Batch(engine, n, draft_cap=cap)
            batch.run(works(n)[:n])                         # first calls, untimed
            cycles = batch.stats.cycles
            t0 = time.perf_counter()
            results = batch.run(works(n))
            wall = time.perf_counter() - t0
            tokens = sum(len(r.token_ids) for r in results)
            rows.append({"batch": n, "cap": cap, "tok_s": tokens / wall,
                         "tok_per_cycle": tokens / max(batch.stats.cycles - cycles, 1)})
            progress(f"draft caps: batch {n}, cap {cap}")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", default=None,
                        help="concurrent clients per cell, comma-separated (default 1,2,4,8)")
    parser.add_argument("--methods", default=None,
                        help=f"comma-separated, of {', '.join(METHODS)} (default all four)")
    parser.add_argument("--tasks", type=int, default=None,
                        help="held-out tasks per cell (default 48)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="slices per cell, the services alternating (default 2)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads of both engines (0 = the engine's auto)")
    parser.add_argument("--max-batch", type=int, default=8,
                        help="the batched service's engine.max_batch")
    parser.add_argument("--small", action="store_true",
                        help="a quick run (tests): 1 and 2 clients, auto, 4 tasks, 1 round")
    parser.add_argument("--draft-caps", default=None,
                        help="instead: tokens/s of a batch per auto draft cap, e.g. "
                        "0,2,4,none")
    parser.add_argument("--compile", action="store_true",
                        help="both engines' forwards compiled (engine.compile on; the "
                        "batched one's per batch bucket too), and a third service batched "
                        "on eager forwards to compare with: compiled at load, minutes "
                        "on a CPU the first time, then read from the on-disk cache")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    small = args.small
    clients = parse_list(args.clients or ("1,2" if small else "1,2,4,8"), int, "clients",
                         parser)
    methods = parse_list(args.methods or ("auto" if small else ",".join(
        ("none", "dflash", "mtp", "auto"))), str, "methods", parser)
    tasks_n = args.tasks or (4 if small else 48)
    rounds = args.rounds or (1 if small else 2)
    if any(n < 1 for n in clients) or len(set(clients)) != len(clients):
        parser.error(f"--clients must be distinct positive integers, got {args.clients!r}")
    if any(m not in METHODS for m in methods):
        parser.error(f"--methods takes a comma-separated list of {', '.join(METHODS)}")
    if tasks_n < 1 or rounds < 1 or rounds > tasks_n:
        parser.error("--tasks must be >= 1 and --rounds between 1 and --tasks")
    if args.threads < 0 or args.max_batch < 1:
        parser.error("--threads must be >= 0 and --max-batch >= 1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    preset = ModelPreset.load("demo")
    catalog = SkillCatalog.from_yaml(default_skills_path())
    planner = PlannerConfig(queue_depth=2 * max(clients) + args.max_batch,
                            refusal_hint=preset.refusal_hint,
                            reasoning_effort=preset.reasoning_effort)
    services: dict[str, PlannerService] = {}
    kinds = [("batched", args.max_batch, args.compile), ("single", 1, args.compile)]
    if args.compile:
        kinds.append((EAGER, args.max_batch, False))
    for name, max_batch, compiled in kinds:
        engine = Engine.load(preset.engine_config(
            device="cpu", dtype="fp32", threads=args.threads, max_batch=max_batch,
            compile="on" if compiled else None), progress=progress)
        services[name] = PlannerService(engine, catalog, planner)
    sets = heldout_sets(0, -(-max(tasks_n, 3 * max(clients)) // 3))
    examples = [ex for trio in zip(*sets.values()) for ex in trio]
    if args.draft_caps is not None:
        caps = [None if c.strip() == "none" else int(c) for c in args.draft_caps.split(",")]
        with torch.inference_mode():
            rows = cap_sweep(services["batched"].engine, services["batched"], examples,
                             clients, caps, methods[0])
        if args.json:
            print(json.dumps({"draft_caps": rows}))
        for row in rows if not args.json else ():
            print(f"batch {row['batch']}  cap {str(row['cap']):>4}  "
                  f"{row['tok_s']:7.0f} tok/s  {row['tok_per_cycle']:6.2f} tok/cycle")
        return 0
    examples = examples[:tasks_n]
    tasks = list(enumerate(examples))
    t0 = time.perf_counter()
    try:
        for service in services.values():
            service.start()
            service.warm_up()
        rows, growth = run(services, tasks, clients, methods, rounds)
    finally:
        for service in services.values():
            service.stop()
    batched = services["batched"].engine
    report = {"small": small, "threads": torch.get_num_threads(), "compiled": args.compile,
              "max_batch": batched.config.resolve_max_batch(batched.device),
              "tasks": len(tasks), "rounds": rounds, "clients": sorted(clients),
              "methods": methods, "reference": "single service, 1 client",
              "rows": rows, "latency_growth": growth, "wall_s": time.perf_counter() - t0}
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report)
    failed = sum(r[name]["failed"] for r in rows for name in services)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
