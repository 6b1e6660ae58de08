"""A bounded load on `flash-planner serve`: N concurrent clients x M requests, loopback only.

The server runs the demo model in a child process (fp32, CPU, `--threads` torch threads);
each client sends its requests one after another. Every request must come back answered
(200) or refused with 429 (the queue is full), none lost; printed: the counts, latency
p50/p95 of the answered ones (request sent -> last byte), TTFT p50/p95 from their
telemetry (`/v1/plans`), and the server's own metrics afterwards.

    python bench/serve_load.py [--clients 8] [--requests 25] [--queue-depth 8]
                               [--endpoint plans|chat] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from pathlib import Path

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
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "flash_planner.cli", "serve", "--port", str(port), "--device",
         "cpu", "--dtype", "fp32", "--queue-depth", str(args.queue_depth)],
        env=dict(os.environ, OMP_NUM_THREADS=str(args.threads)), cwd=REPO,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("the server did not start: "
                                     + server.stderr.read()) from None
                time.sleep(0.1)
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
    finally:
        server.terminate()
        server.wait(30)
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
              f"(queue depth {args.queue_depth}), demo model, fp32 CPU, loopback")
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
