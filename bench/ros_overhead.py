"""What the ROS layer costs: the same tasks through the planner service and the Plan action.

One process, the embedded demo planner (fp32, CPU), held-out tasks of the demo corpus. Each
task is planned twice, alternating which path goes first:
  service  `PlannerService.plan` on a service of our own (no ROS), timed around the call
  action   a Plan goal to the real lifecycle node on rclpy (Fast DDS, loopback), timed in the
           client from `send_goal_async` to the result; the node has its own engine, loaded
           from the same preset, so both paths decode with the same weights and settings
Prints p50/p95 of both, the difference (ms and % of the service's plan time) and the time
from goal acceptance (client side) to the first feedback message. Run by `make bench-ros`,
which provides rclpy first (tools/ros_env.sh).

    python bench/ros_overhead.py [--n 50] [--threads 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time

import torch

from flash_planner.engine.engine import Engine
from flash_planner.planning.presets import ModelPreset, default_skills_path
from flash_planner.planning.request import PlanRequest
from flash_planner.planning.service import PlannerConfig, PlannerService
from flash_planner.planning.skills import SkillCatalog
from flash_planner.ros.diagnostics import percentile
from flash_planner.train.corpus import make_corpus

NODE = "flash_planner"


def _action_side(context):
    """The planner node (demo preset, CPU) and a client node, spun by one executor."""
    import rclpy
    from rclpy.action import ActionClient
    from rclpy.executors import MultiThreadedExecutor
    from rclpy.parameter import Parameter

    from flash_planner.ros.node import planner_node_class
    from flash_planner_interfaces.action import Plan

    overrides = {"model.device": "cpu", "model.dtype": "fp32", "autostart": False}
    node = planner_node_class()(context=context, parameter_overrides=[
        Parameter(k, value=v) for k, v in overrides.items()])
    client_node = rclpy.create_node("ros_overhead_client", context=context)
    client = ActionClient(client_node, Plan, f"/{NODE}/plan")
    executor = MultiThreadedExecutor(num_threads=4, context=context)
    executor.add_node(node)
    executor.add_node(client_node)
    threading.Thread(target=executor.spin, daemon=True).start()
    node.trigger_configure()
    node.trigger_activate()
    if not client.wait_for_server(timeout_sec=30):
        sys.exit("the Plan action server did not come up")
    return node, client, executor, Plan


def _wait(future, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while not future.done():
        if time.monotonic() > deadline:
            raise TimeoutError("no answer from the node")
        time.sleep(0.0005)
    return future.result()


def plan_by_action(client, plan_type, ex) -> dict:
    """One goal: wall ms to the result, ms from acceptance to the first feedback."""
    first: list[float] = []
    goal = plan_type.Goal(task=ex.task, context=ex.context or "", max_new_tokens=0,
                          enable_thinking=ex.thinking is not None)
    t0 = time.perf_counter()
    handle = _wait(client.send_goal_async(
        goal, feedback_callback=lambda _: first or first.append(time.perf_counter())))
    accepted = time.perf_counter()
    response = _wait(handle.get_result_async())
    done = time.perf_counter()
    return {"ms": (done - t0) * 1e3, "ok": response.result.success,
            "first_feedback_ms": (first[0] - accepted) * 1e3 if first else float("nan")}


def plan_by_service(service, ex) -> dict:
    request = PlanRequest(ex.task, context=ex.context or "",
                          enable_thinking=ex.thinking is not None)
    t0 = time.perf_counter()
    result = service.plan(request)
    return {"ms": (time.perf_counter() - t0) * 1e3, "ok": result.success}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=50, help="held-out tasks (of 500)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--json", action="store_true", help="print the report as JSON too")
    args = parser.parse_args()
    try:
        import rclpy
        from rclpy.context import Context
    except ImportError:
        sys.exit("rclpy is not importable: run `make bench-ros`, or source a ROS 2 Jazzy")
    torch.set_num_threads(args.threads)
    os.environ.setdefault("ROS_DOMAIN_ID", str(random.Random().randrange(1, 101)))
    os.environ.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")

    examples = make_corpus(0, n_train=0)[1][:args.n]
    preset = ModelPreset.load("demo")
    service = PlannerService(Engine.load(preset.engine_config(device="cpu", dtype="fp32")),
                             SkillCatalog.from_yaml(default_skills_path()), PlannerConfig())
    service.start()
    context = Context()
    rclpy.init(context=context)
    node, client, executor, plan_type = _action_side(context)
    for ex in examples[:3]:  # warm both paths (first-call costs, DDS discovery)
        plan_by_service(service, ex)
        plan_by_action(client, plan_type, ex)

    rows = []
    for i, ex in enumerate(examples):
        if i % 2:
            rows.append((plan_by_service(service, ex), plan_by_action(client, plan_type, ex)))
        else:
            action = plan_by_action(client, plan_type, ex)
            rows.append((plan_by_service(service, ex), action))
        print(f"\r{i + 1}/{len(examples)} tasks", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    service.stop()
    node.stop_planner()
    executor.shutdown()
    report = summarise(rows, args.threads)
    print_report(report)
    if args.json:
        print(json.dumps(report, indent=1))
    rclpy.shutdown(context=context)


def summarise(rows, threads: int) -> dict:
    svc = [s["ms"] for s, _ in rows]
    act = [a["ms"] for _, a in rows]
    diff = [a - s for s, a in zip(svc, act)]
    first = [a["first_feedback_ms"] for _, a in rows]
    out = {"tasks": len(rows), "threads": threads,
           "valid": {"service": sum(s["ok"] for s, _ in rows),
                     "action": sum(a["ok"] for _, a in rows)}}
    for name, values in (("service_ms", svc), ("action_ms", act), ("diff_ms", diff),
                         ("first_feedback_ms", first)):
        out[name] = {"p50": percentile(values, 50), "p95": percentile(values, 95)}
    out["diff_pct"] = {q: 100.0 * (out["action_ms"][q] - out["service_ms"][q])
                       / out["service_ms"][q] for q in ("p50", "p95")}
    return out


def print_report(r: dict) -> None:
    print(f"ROS layer overhead: demo planner, {r['tasks']} held-out tasks, fp32 CPU, "
          f"{r['threads']} thread(s); valid plans service {r['valid']['service']}, "
          f"action {r['valid']['action']}")
    print(f"{'':28}{'p50':>10}{'p95':>10}")
    for key, label in (("service_ms", "planner service (ms)"), ("action_ms", "Plan action (ms)"),
                       ("diff_ms", "per-task difference (ms)")):
        print(f"{label:28}{r[key]['p50']:>10.2f}{r[key]['p95']:>10.2f}")
    print(f"{'action - service (ms)':28}{r['action_ms']['p50'] - r['service_ms']['p50']:>10.2f}"
          f"{r['action_ms']['p95'] - r['service_ms']['p95']:>10.2f}")
    print(f"{'action - service (% plan)':28}{r['diff_pct']['p50']:>9.2f}%"
          f"{r['diff_pct']['p95']:>9.2f}%")
    print(f"{'accept -> first feedback (ms)':28}{r['first_feedback_ms']['p50']:>9.2f}"
          f"{r['first_feedback_ms']['p95']:>10.2f}")


if __name__ == "__main__":
    main()
