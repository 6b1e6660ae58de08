"""A bounded load on `flash-planner serve`: N concurrent clients x M requests, loopback only.

The server runs the demo model in a child process (fp32, CPU, `--threads` torch threads, 0 =
the server's default); each client sends its requests one after another. Every request must
come back answered (200) or refused with 429 (the queue is full), none lost; printed: the
counts, latency p50/p95 of the answered ones (request sent -> last byte), TTFT p50/p95 from
their telemetry (`/v1/plans`), and the server's own metrics afterwards.

`--scaling`: the same held-out tasks through `/v1/plans` (greedy, the server's grammar) by one
client alone, by N closed-loop clients (each sends its next task when its last returns) and
in bursts of N sent at once, the three in `--rounds` slices, the order turned per slice;
printed: aggregate tokens/s of each (tokens of the answers over the wall time) and N
clients' and the bursts' ratio to one client alone, latency and TTFT p50, and the answers
whose raw text differs from the same task alone.

`--vs-service`: one client instead, the same held-out tasks through `/v1/plans` and through
the planner service in a process of its own (what `flash-planner plan` runs, warm), each
task on both, alternating which goes first; printed: p50/p95 of both and of the per-task
ratio. `--neighbour` measures either mode beside a CPU-bound busy loop on every core.

    python bench/serve_load.py [--clients 8] [--requests 25] [--queue-depth 8]
                               [--endpoint plans|chat] [--threads 0] [--neighbour] [--json]
    python bench/serve_load.py --vs-service [--n 30] [--threads 0] [--neighbour] [--json]
    python bench/serve_load.py --scaling [--clients 8] [--n 48] [--rounds 2] [--threads 0]
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from pathlib import Path

import neighbour  # bench/neighbour.py

REPO = Path(__file__).resolve().parents[1]
TASKS = ["bring the red cup from the kitchen table to the sink", "open the fridge",
         "go to the charging dock", "pick up the blue box and put it on shelf 2",
         "say hello to the operator"]


def free_port() -> int:
    with closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> tuple[int, dict, float]:
    t0 = time.perf_counter()
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.status, json.loads(r.read()), time.perf_counter() - t0
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}"), time.perf_counter() - t0


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))] if values else 0.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=25)
    p.add_argument("--queue-depth", type=int, default=8)
    p.add_argument("--endpoint", choices=["plans", "chat"], default="plans")
    p.add_argument("--threads", type=int, default=0,
                   help="the server's --threads (0 = its default, auto)")
    p.add_argument("--neighbour", action="store_true",
                   help="measure beside a CPU-bound busy loop on every core")
    p.add_argument("--vs-service", action="store_true",
                   help="one client: /v1/plans against the planner service, task by task")
    p.add_argument("--scaling", action="store_true",
                   help="one client alone against N closed-loop clients and bursts of N")
    p.add_argument("--rounds", type=int, default=2, help="slices of --scaling")
    p.add_argument("--n", type=int, default=None,
                   help="held-out tasks of --vs-service (30) or --scaling (48)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "flash_planner.cli", "serve", "--port", str(port), "--device",
         "cpu", "--dtype", "fp32", "--queue-depth", str(args.queue_depth), "--threads",
         str(args.threads)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True)
    try:
        wait_ready(server, base)
        if args.vs_service:
            return versus_service(args, base)
        if args.scaling:
            with neighbour.neighbour(args.neighbour):
                return scaling(args, base)
        with neighbour.neighbour(args.neighbour):
            return load(args, base)
    finally:
        server.terminate()
        server.wait(30)


def wait_ready(server: subprocess.Popen, base: str) -> None:
    deadline = time.monotonic() + 300
    while True:
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the server did not start: " + server.stderr.read()) from None
            time.sleep(0.1)


def versus_service(args, base: str) -> int:
    """The same tasks through /v1/plans and through PlannerService in its own process."""
    from ros_overhead import ServiceProcess  # bench/ros_overhead.py; needs no rclpy

    from flash_planner.train.corpus import make_corpus

    def by_server(ex) -> dict:
        status, body, seconds = post(base + "/v1/plans", {
            "task": ex.task, "context": ex.context or "",
            "enable_thinking": ex.thinking is not None})
        return {"ms": seconds * 1e3, "ok": status == 200 and body.get("success", False)}

    examples = make_corpus(0, n_train=0)[1][:args.n or 30]
    service = ServiceProcess(args.threads)
    rows = []
    try:
        with neighbour.neighbour(args.neighbour):
            for ex in examples[:3]:         # first-call costs of both
                service.plan(ex), by_server(ex)
            for i, ex in enumerate(examples):
                first, second = (service.plan, by_server) if i % 2 else (by_server, service.plan)
                a, b = first(ex), second(ex)
                rows.append((a, b) if i % 2 else (b, a))
                print(f"\r{i + 1}/{len(examples)} tasks", end="", file=sys.stderr, flush=True)
            print(file=sys.stderr)
    finally:
        service.close()
    columns = {"service_ms": [s["ms"] for s, _ in rows], "server_ms": [h["ms"] for _, h in rows],
               "ratio": [h["ms"] / s["ms"] for s, h in rows]}
    report = {"tasks": len(rows), "threads": args.threads or "auto",
              "where": neighbour.label(args.neighbour),
              "valid": {"service": sum(s["ok"] for s, _ in rows),
                        "server": sum(h["ok"] for _, h in rows)},
              **{k: {"p50": percentile(v, 0.5), "p95": percentile(v, 0.95)}
                 for k, v in columns.items()}}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"/v1/plans vs the planner service: demo model, fp32 CPU, {len(rows)} held-out "
              f"tasks, threads {report['threads']}, {report['where']}; valid plans: service "
              f"{report['valid']['service']}, server {report['valid']['server']}")
        print(f"{'':28}{'p50':>9}{'p95':>9}")
        for key, name in (("service_ms", "planner service (ms)"),
                          ("server_ms", "/v1/plans (ms)"), ("ratio", "server / service (x)")):
            print(f"{name:28}{report[key]['p50']:>9.2f}{report[key]['p95']:>9.2f}")
    return 0


def scaling(args, base: str) -> int:
    """One client alone, N closed-loop clients, bursts of N: the same tasks, the same server."""
    from flash_planner.train.corpus import heldout_sets

    n_tasks, clients, rounds = args.n or 48, args.clients, args.rounds
    if n_tasks < 1 or clients < 1 or not 1 <= rounds <= n_tasks:
        raise SystemExit("--scaling wants --n >= 1, --clients >= 1, 1 <= --rounds <= --n")
    sets = heldout_sets(0, -(-n_tasks // 3))
    tasks = [ex for trio in zip(*sets.values()) for ex in trio][:n_tasks]

    def ask(index: int) -> tuple[int, dict]:
        ex = tasks[index]
        t0 = time.perf_counter()
        status, body, _ = post(base + "/v1/plans", {
            "task": ex.task, "context": ex.context or "",
            "enable_thinking": ex.thinking is not None})
        if status != 200:
            raise SystemExit(f"task {index}: HTTP {status}: {body}")
        return index, {**body, "latency_ms": (time.perf_counter() - t0) * 1e3}

    def closed_loop(part: list[int], n: int) -> list[tuple[int, dict]]:
        pending = iter(part)

        def client() -> list[tuple[int, dict]]:
            return [ask(i) for i in iter(lambda: next(pending, None), None)]

        with ThreadPoolExecutor(n) as pool:
            return [r for run in pool.map(lambda _: client(), range(n)) for r in run]

    def bursts(part: list[int]) -> list[tuple[int, dict]]:
        out = []
        with ThreadPoolExecutor(clients) as pool:
            for lo in range(0, len(part), clients):
                out += list(pool.map(ask, part[lo:lo + clients]))
        return out

    modes = {"alone": lambda part: closed_loop(part, 1),
             "clients": lambda part: closed_loop(part, clients), "burst": bursts}
    for i in range(min(clients, n_tasks)):          # first calls, untimed
        ask(i)
    answers = {name: {} for name in modes}
    walls = dict.fromkeys(modes, 0.0)
    size = -(-n_tasks // rounds)
    for r in range(rounds):
        part = list(range(r * size, min((r + 1) * size, n_tasks)))
        order = list(modes) if r % 2 == 0 else list(modes)[::-1]
        for name in order:
            print(f"\rround {r + 1}/{rounds}: {name:<8}", end="", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            answers[name].update(modes[name](part))
            walls[name] += time.perf_counter() - t0
    print(file=sys.stderr)
    report = {"mode": "scaling", "n_clients": clients, "tasks": n_tasks, "rounds": rounds,
              "threads": args.threads or "auto", "where": neighbour.label(args.neighbour)}
    alone = answers["alone"]
    for name in modes:
        got = answers[name].values()
        tokens = sum(int(a["telemetry"].get("new_tokens", 0)) for a in got)
        report[name] = {
            "tokens": tokens, "wall_s": walls[name], "tok_s": tokens / walls[name],
            "latency_ms_p50": percentile([a["latency_ms"] for a in got], 0.5),
            "ttft_ms_p50": percentile([float(a["telemetry"].get("ttft_ms", 0.0))
                                       for a in got], 0.5),
            "plans": sum(bool(a.get("success")) for a in got),
            "mismatches": sum(a.get("raw_text") != alone[i].get("raw_text")
                              for i, a in answers[name].items())}
    for name in ("clients", "burst"):
        report[name]["vs_alone"] = report[name]["tok_s"] / report["alone"]["tok_s"]
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"/v1/plans, demo model, fp32 CPU, threads {report['threads']}, {report['where']}: "
          f"{n_tasks} held-out tasks per mode in {rounds} slice(s), greedy under the grammar")
    print(f"{'':26}{'tok/s':>8}{'vs alone':>10}{'p50 ms':>9}{'TTFT p50':>10}{'plans':>7}"
          f"{'mismatch':>10}")
    names = {"alone": "one client alone", "clients": f"{clients} closed-loop clients",
             "burst": f"bursts of {clients} at once"}
    for name, label in names.items():
        row = report[name]
        ratio = f"{row['vs_alone']:.2f}x" if "vs_alone" in row else "-"
        print(f"{label:26}{row['tok_s']:>8.0f}{ratio:>10}{row['latency_ms_p50']:>9.0f}"
              f"{row['ttft_ms_p50']:>10.1f}{row['plans']:>7}{row['mismatches']:>10}")
    return 0


def load(args, base: str) -> int:
    """N concurrent clients x M requests."""
    url = base + ("/v1/plans" if args.endpoint == "plans" else "/v1/chat/completions")

    def body(i: int) -> dict:
        task = TASKS[i % len(TASKS)]
        if args.endpoint == "plans":
            return {"task": task}
        return {"model": "demo", "max_tokens": 64, "temperature": 0,
                "messages": [{"role": "user", "content": task}]}

    def client(c: int) -> list[tuple[int, dict, float]]:
        return [post(url, body(c * args.requests + i)) for i in range(args.requests)]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.clients) as pool:
        results = [r for run in pool.map(client, range(args.clients)) for r in run]
    wall = time.perf_counter() - t0
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        metrics = {line.split(" ")[0]: float(line.rsplit(" ", 1)[1])
                   for line in r.read().decode().splitlines()
                   if line and not line.startswith("#")}
    answered = [r for r in results if r[0] == 200]
    codes = {}
    for status, _, _ in results:
        codes[status] = codes.get(status, 0) + 1
    latency = [r[2] * 1000 for r in answered]
    ttft = [r[1].get("telemetry", {}).get("ttft_ms", 0) for r in answered
            if args.endpoint == "plans"]
    valid = sum(1 for r in answered if r[1].get("success")) if args.endpoint == "plans" \
        else len(answered)
    report = {"clients": args.clients, "requests": args.requests, "sent": len(results),
              "status_counts": codes, "lost": len(results) - sum(codes.values()),
              "valid_plans": valid, "wall_s": wall,
              "latency_ms_p50": percentile(latency, 0.5),
              "latency_ms_p95": percentile(latency, 0.95),
              "ttft_ms_p50": percentile(ttft, 0.5), "ttft_ms_p95": percentile(ttft, 0.95),
              "throughput_rps": len(answered) / wall,
              "server_queue_depth_after": metrics.get("flash_planner_queue_depth", -1)}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{args.clients} clients x {args.requests} requests to /v1/{args.endpoint} "
              f"(queue depth {args.queue_depth}), demo model, fp32 CPU, loopback, threads "
              f"{args.threads or 'auto'}, {neighbour.label(args.neighbour)}")
        print(f"status counts {codes}; lost {report['lost']}; valid plans "
              f"{valid}/{len(answered)}; {report['throughput_rps']:.1f} answered/s over "
              f"{wall:.1f} s")
        print(f"latency p50 {report['latency_ms_p50']:.0f} ms, p95 "
              f"{report['latency_ms_p95']:.0f} ms (queueing included); TTFT p50 "
              f"{report['ttft_ms_p50']:.1f} ms, p95 {report['ttft_ms_p95']:.1f} ms")
    bad = set(codes) - {200, 429}
    return 1 if bad or report["lost"] else 0


if __name__ == "__main__":
    sys.exit(main())
