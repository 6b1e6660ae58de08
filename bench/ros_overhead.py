"""What the ROS layer costs: the same tasks through the planner service and the Plan action.

The embedded demo planner (fp32, CPU), held-out tasks of the demo corpus, one run. Each task
is planned twice, alternating which path goes first; each path has its engine in a child
process of its own, built from the node's parameters by the node's own code, with the same
torch threads (`--threads`; 0 = the engine's default, auto), alone or `--neighbour`
(beside one busy loop per core, as a robot's other processes keep its CPU busy):
  service  `PlannerService.plan` (no ROS), timed around the call in its process
  action   a Plan goal to the real `planner_node` (rclpy, Fast DDS on loopback), timed in
           this process from `send_goal_async` to the result
Prints p50/p95 of both paths and of the per-task difference (ms and % of the service's plan
time), split into the protocol's part (client-side time minus the node's own measure of the
request) and the decode-time difference; the round trip of a goal the node refuses at once
(the rclpy action protocol alone: send_goal and get_result, nothing decoded); and the time
from goal acceptance (client side) to the first feedback message. Then what execution adds
per step (`bench/ros_execute.py`: `--execute-rounds`, 0 to skip).
Run by `make bench-ros`, which provides rclpy first (tools/ros_env.sh).

    python bench/ros_overhead.py [--n 50] [--threads 0] [--neighbour] [--execute-rounds 30]
                                 [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import neighbour  # bench/neighbour.py
import ros_execute  # bench/ros_execute.py

from flash_planner.planning.request import PlanRequest
from flash_planner.planning.service import PlannerService
from flash_planner.planning.skills import SkillCatalog
from flash_planner.ros import params
from flash_planner.ros.diagnostics import percentile
from flash_planner.train.corpus import make_corpus

NODE = "flash_planner"
NODE_PARAMS = {"model.device": "cpu", "model.dtype": "fp32"}  # and the demo preset (default)


def node_process(overrides: dict, threads: int = 0) -> subprocess.Popen:
    """The real `planner_node` (demo preset, CPU, fp32, plus `overrides`) in its own process,
    as users run it; `threads` is its engine.threads (0 = auto)."""
    overrides = {**overrides, "engine.threads": threads}
    args = [arg for k, v in {**NODE_PARAMS, **overrides}.items() for arg in ("-p", f"{k}:={v}")]
    return subprocess.Popen([sys.executable, "-m", "flash_planner.ros.node", "--ros-args",
                             *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def _client(context):
    """An action client node, spun in a thread of this process."""
    import rclpy
    from rclpy.action import ActionClient
    from rclpy.executors import SingleThreadedExecutor

    from flash_planner_interfaces.action import Plan

    client_node = rclpy.create_node("ros_overhead_client", context=context)
    client = ActionClient(client_node, Plan, f"/{NODE}/plan")
    executor = SingleThreadedExecutor(context=context)
    executor.add_node(client_node)
    threading.Thread(target=executor.spin, daemon=True).start()
    if not client.wait_for_server(timeout_sec=120):
        sys.exit("the Plan action server did not come up")
    return client, executor, Plan


def wait_future(future, timeout: float = 120.0):
    """The future's result; waits on an event (no polling that would compete for the GIL)."""
    done = threading.Event()
    future.add_done_callback(lambda _: done.set())
    if not done.wait(timeout):
        raise TimeoutError("no answer from the node")
    return future.result()


def plan_by_action(client, plan_type, ex, timeout: float = 120.0) -> dict:
    """One goal: wall ms to the result, ms from acceptance to the first feedback."""
    first: list[float] = []
    goal = plan_type.Goal(task=ex.task, context=ex.context or "", max_new_tokens=0,
                          enable_thinking=ex.thinking is not None)
    t0 = time.perf_counter()
    handle = wait_future(client.send_goal_async(
        goal, feedback_callback=lambda _: first or first.append(time.perf_counter())), timeout)
    accepted = time.perf_counter()
    response = wait_future(handle.get_result_async(), timeout)
    done = time.perf_counter()
    return {"ms": (done - t0) * 1e3, "ok": response.result.success,
            "inside_ms": response.result.telemetry.total_latency_ms,
            "decode_ms": response.result.telemetry.decode_ms,
            "first_feedback_ms": (first[0] - accepted) * 1e3 if first else float("nan")}


def _retry_until_active(client, plan_type, ex) -> None:
    """Plan once the node has configured and activated itself (autostart). A goal sent
    before the server's request reader matched is lost, so an unanswered one is resent."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if plan_by_action(client, plan_type, ex, timeout=10.0)["ok"]:
                return
        except TimeoutError:
            continue
        time.sleep(0.5)
    sys.exit("the planner node did not become active")


def serve(threads: int) -> None:
    """The service side in a process of its own: tasks in as JSON lines, timings out."""
    engine_config, planner_config, skills = params.build_configs(
        {**NODE_PARAMS, "engine.threads": threads})
    service = PlannerService.load(engine_config, SkillCatalog.from_yaml(skills),
                                  planner_config)
    service.start()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        task = json.loads(line)
        request = PlanRequest(task["task"], context=task["context"],
                              enable_thinking=task["thinking"])
        t0 = time.perf_counter()
        result = service.plan(request)
        ms = (time.perf_counter() - t0) * 1e3
        print(json.dumps({"ms": ms, "ok": result.success,
                          "inside_ms": result.telemetry["total_latency_ms"],
                          "decode_ms": result.telemetry["decode_ms"]}), flush=True)
    service.stop()


class ServiceProcess:
    """The planner service without ROS, in a child process like the node's (same threads)."""

    def __init__(self, threads: int):
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", "--threads",
                                      str(threads)], text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert json.loads(self.proc.stdout.readline())["ready"]

    def plan(self, ex) -> dict:
        task = {"task": ex.task, "context": ex.context or "",
                "thinking": ex.thinking is not None}
        self.proc.stdin.write(json.dumps(task) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=50, help="held-out tasks (of 500)")
    parser.add_argument("--threads", type=int, default=0,
                        help="engine.threads of both paths (0 = auto, the default)")
    parser.add_argument("--neighbour", action="store_true",
                        help="measure beside a CPU-bound busy loop on every core")
    parser.add_argument("--feedback-period-ms", type=float, default=50.0,
                        help="the node's planner.feedback_period_ms (0: every cycle)")
    parser.add_argument("--execute-rounds", type=int, default=30,
                        help="rounds of bench/ros_execute.py after the plan figures (what "
                             "~/execute adds per step; 0 = skip it)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON too")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve(args.threads)
    try:
        import rclpy  # noqa: F401
    except ImportError:
        sys.exit("rclpy is not importable: run `make bench-ros`, or source a ROS 2 Jazzy")
    os.environ.setdefault("ROS_DOMAIN_ID", str(random.Random().randrange(1, 101)))
    os.environ.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")

    examples = make_corpus(0, n_train=0)[1][:args.n]
    service = ServiceProcess(args.threads)
    node = node_process({"planner.feedback_period_ms": float(args.feedback_period_ms)},
                        args.threads)
    try:
        with neighbour.neighbour(args.neighbour):
            rows, floor = _measure(examples, service)
    finally:
        service.close()
        node.send_signal(signal.SIGINT)
        try:
            node.wait(30)
        except subprocess.TimeoutExpired:
            node.kill()
    report = summarise(rows, floor, args.threads, neighbour.label(args.neighbour))
    print_report(report)
    if args.execute_rounds > 0:
        print("\nWhat execution adds per step (bench/ros_execute.py):")
        report["execution"] = ros_execute.measure(args.execute_rounds)
        ros_execute.print_report(report["execution"])
    if args.json:
        print(json.dumps(report, indent=1))


def _measure(examples, service):
    """(per-task (service, action) rows, refused-goal round trips) against the running node."""
    import rclpy
    from rclpy.context import Context

    context = Context()
    rclpy.init(context=context)
    client, executor, plan_type = _client(context)
    try:
        for ex in examples[:3]:  # warm both paths (first-call costs, DDS discovery)
            service.plan(ex)
            _retry_until_active(client, plan_type, ex)
        rows = []
        for i, ex in enumerate(examples):  # alternate which path goes first
            if i % 2:
                rows.append((service.plan(ex),
                             plan_by_action(client, plan_type, ex)))
            else:
                action = plan_by_action(client, plan_type, ex)
                rows.append((service.plan(ex), action))
            print(f"\r{i + 1}/{len(examples)} tasks", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
        return rows, refused_goal_round_trips(client, plan_type)
    finally:
        executor.shutdown()
        rclpy.shutdown(context=context)


def summarise(rows, floor: list[float], threads: int, where: str) -> dict:
    """Percentiles of each path, of the per-task difference and of its parts."""
    per_task = {
        "service_ms": [s["ms"] for s, _ in rows],
        "action_ms": [a["ms"] for _, a in rows],
        "diff_ms": [a["ms"] - s["ms"] for s, a in rows],
        "diff_pct": [100.0 * (a["ms"] - s["ms"]) / s["ms"] for s, a in rows],
        # client-side time minus the node's own measure of the request: the protocol's part
        "transport_ms": [a["ms"] - a["inside_ms"] for _, a in rows],
        "decode_diff_ms": [a["decode_ms"] - s["decode_ms"] for s, a in rows],
        "first_feedback_ms": [a["first_feedback_ms"] for _, a in rows],
        "refused_goal_ms": floor,
    }
    out = {"tasks": len(rows), "threads": threads or "auto", "where": where,
           "valid": {"service": sum(s["ok"] for s, _ in rows),
                     "action": sum(a["ok"] for _, a in rows)}}
    for name, values in per_task.items():
        out[name] = {"p50": percentile(values, 50), "p95": percentile(values, 95)}
    return out


LABELS = {
    "service_ms": "planner service (ms)",
    "action_ms": "Plan action (ms)",
    "diff_ms": "action - service (ms)",
    "diff_pct": "action - service (% plan)",
    "transport_ms": "  protocol: client - node",
    "decode_diff_ms": "  decode: action - service",
    "refused_goal_ms": "refused goal round trip",
    "first_feedback_ms": "accept -> first feedback",
}


def print_report(r: dict) -> None:
    print(f"ROS layer overhead: demo planner, {r['tasks']} held-out tasks, fp32 CPU, "
          f"engine.threads {r['threads']}, {r['where']}; valid plans: service "
          f"{r['valid']['service']}, action {r['valid']['action']}")
    print("differences are per task (same task, both paths), then percentiles; ms unless %")
    print(f"{'':30}{'p50':>9}{'p95':>9}")
    for key, label in LABELS.items():
        print(f"{label:30}{r[key]['p50']:>9.2f}{r[key]['p95']:>9.2f}")


def refused_goal_round_trips(client, plan_type, n: int = 50) -> list[float]:
    """The action protocol alone: goals the node refuses at once (empty task), in ms."""
    goal = plan_type.Goal(task="", context="", max_new_tokens=0, enable_thinking=False)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        handle = wait_future(client.send_goal_async(goal))
        wait_future(handle.get_result_async())
        times.append((time.perf_counter() - t0) * 1e3)
    return times


if __name__ == "__main__":
    main()
