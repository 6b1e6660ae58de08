"""What execution adds per step: the same goals sent to the same action servers by the
node's `~/execute` (one ExecutePlan goal of a plan given as is) and by a client calling the
servers directly, one goal after another, on real rclpy (Fast DDS on loopback).

The servers are the tests' (test/ros/skill_servers.py, types of the test-only
flash_planner_test_msgs that `make ros-env` builds), answering at once with one feedback
message each; the node serves the demo planner with a catalog binding its skills to them
(test_node_execute.py's). The plan: navigate_to, pick, navigate_to, place (four action
goals). Each round runs both paths, alternating which goes first; printed: p50/p95 ms per
plan of each path, and per step of the difference (the gate, the feedback relay, the
node's client and its waits), over `--rounds`.

    python bench/ros_execute.py [--rounds 30] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "test" / "ros"))

from flash_planner.planning.gate import gate  # noqa: E402
from flash_planner.planning.skills import SkillCatalog  # noqa: E402
from flash_planner.ros.diagnostics import percentile  # noqa: E402
from flash_planner.ros.messages import to_message  # noqa: E402

PLAN = [{"skill": "navigate_to", "args": {"target": "kitchen"}},
        {"skill": "pick", "args": {"object": "red cup"}},
        {"skill": "navigate_to", "args": {"target": "sink"}},
        {"skill": "place", "args": {"object": "red cup", "location": "sink"}}]


def wait(future, timeout: float = 60.0):
    done = threading.Event()
    future.add_done_callback(lambda _: done.set())
    if not done.wait(timeout):
        raise TimeoutError("no answer")
    return future.result()


def direct(clients, goals) -> float:
    """ms to run the goals one after another from a plain client."""
    t0 = time.perf_counter()
    for client, goal in zip(clients, goals):
        handle = wait(client.send_goal_async(goal, feedback_callback=lambda _: None))
        wait(handle.get_result_async())
    return (time.perf_counter() - t0) * 1e3


def execute(client, goal_type) -> float:
    """ms of one ExecutePlan goal of the plan, from send to result."""
    t0 = time.perf_counter()
    handle = wait(client.send_goal_async(goal_type(plan_json=json.dumps(PLAN), max_replans=0),
                                         feedback_callback=lambda _: None))
    result = wait(handle.get_result_async())
    assert result.result.success, result.result.error
    return (time.perf_counter() - t0) * 1e3


def measure(rounds: int) -> dict:
    """p50/p95 ms per plan of both paths over `rounds`, and what execution adds per step."""
    import rclpy
    from rclpy.action import ActionClient
    from rclpy.context import Context
    from rclpy.executors import MultiThreadedExecutor
    from rclpy.parameter import Parameter
    from skill_servers import SkillServers
    from test_node_execute import write_catalog

    from flash_planner.ros.binding_types import interface_class
    from flash_planner.ros.node import planner_node_class
    from flash_planner_interfaces.action import ExecutePlan

    context = Context()
    rclpy.init(context=context)
    catalog_path = write_catalog(Path(tempfile.mkdtemp()))
    servers = SkillServers(context, feedbacks=1, pace_s=0.0)
    node = planner_node_class()(context=context, parameter_overrides=[
        Parameter(k, value=v) for k, v in {
            "model.device": "cpu", "model.dtype": "fp32", "autostart": False,
            "planner.skills_file": catalog_path}.items()])
    client_node = rclpy.create_node("ros_execute_client", context=context)
    executor = MultiThreadedExecutor(num_threads=node.executor_threads() + 2, context=context)
    for n in (node, servers.node, client_node):
        executor.add_node(n)
    threading.Thread(target=executor.spin, daemon=True).start()
    try:
        node.trigger_configure()
        node.trigger_activate()
        catalog = SkillCatalog.from_yaml(catalog_path)
        fields = gate(PLAN, catalog.bindings, catalog.locations, catalog.workspace)
        clients, goals = [], []
        for step, goal in zip(PLAN, fields):
            binding = catalog.bindings[step["skill"]]
            kind = interface_class(binding)
            clients.append(ActionClient(client_node, kind, binding.server))
            goals.append(to_message(kind.Goal(), goal))
        exec_client = ActionClient(client_node, ExecutePlan, "/flash_planner/execute")
        for c in (*clients, exec_client):
            assert c.wait_for_server(timeout_sec=30)
        time.sleep(1.0)   # the node's own clients discover the servers (its graph check)
        execute(exec_client, ExecutePlan.Goal)                 # warm both paths once
        direct(clients, goals)
        rows = []
        for r in range(rounds):
            first, second = (("direct", "execute") if r % 2 else ("execute", "direct"))
            row = {}
            for path in (first, second):
                row[path] = (direct(clients, goals) if path == "direct"
                             else execute(exec_client, ExecutePlan.Goal))
            rows.append(row)
    finally:
        servers.close()
        executor.shutdown(timeout_sec=2)
        node.stop_planner()
        rclpy.shutdown(context=context)
    steps = len(PLAN)
    report = {"rounds": rounds, "steps": steps}
    for path in ("direct", "execute"):
        ms = [row[path] for row in rows]
        report[path] = {"p50_ms": percentile(ms, 50), "p95_ms": percentile(ms, 95)}
    per_step = [(row["execute"] - row["direct"]) / steps for row in rows]
    report["added_per_step"] = {"p50_ms": percentile(per_step, 50),
                                "p95_ms": percentile(per_step, 95)}
    return report


def print_report(report: dict) -> None:
    print(f"{report['steps']}-step plan, {report['rounds']} rounds (ms per plan, p50 / p95)")
    for path in ("direct", "execute"):
        print(f"  {path:8} {report[path]['p50_ms']:7.1f} / {report[path]['p95_ms']:7.1f}")
    print(f"  execution adds per step: {report['added_per_step']['p50_ms']:.1f} / "
          f"{report['added_per_step']['p95_ms']:.1f} ms "
          f"({report['execute']['p50_ms'] / report['direct']['p50_ms']:.2f}x the direct "
          "client's time)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    report = measure(args.rounds)
    print_report(report)
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
