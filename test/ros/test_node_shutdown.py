"""The real `planner_node` process: SIGINT with a goal in flight ends the goal, then exits;
SIGINT while the node still warms up (compiling its graphs into an empty cache) exits 0
without a traceback."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

from live import ENDLESS_TOKENS, MISSING, TIMEOUT, requires_ros, result_of, wait_for

if MISSING is None:
    from action_msgs.msg import GoalStatus
    from rclpy.action import ActionClient
    from rclpy.executors import SingleThreadedExecutor

    from flash_planner_interfaces.action import Plan

pytestmark = requires_ros
EXIT_S = 10.0  # "within a few seconds" of the signal


def _node_process(endless_dir, env: dict | None = None, **extra) -> subprocess.Popen:
    overrides = {"model.path": str(endless_dir), "model.device": "cpu",
                 "model.dtype": "fp32", "engine.max_context": 8192, **extra}
    args = [arg for k, v in overrides.items() for arg in ("-p", f"{k}:={v}")]
    return subprocess.Popen([sys.executable, "-m", "flash_planner.ros.node", "--ros-args",
                             *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)


def _warming_up(values: dict[str, str]) -> bool:
    return values.get("state") == "warming up" and values.get("startup phase") == "compiling"


def test_sigint_during_the_warm_up_exits_0_without_a_traceback(endless_dir, tmp_path):
    """While the node compiles, /diagnostics says it is warming up and how far; a cold
    compile cannot be interrupted inside a graph, so on SIGINT the node waits for its
    warm-up to stop (bounded), then exits 0 with one line instead of the lifecycle's
    RCLError."""
    import rclpy
    from diagnostic_msgs.msg import DiagnosticArray
    from rclpy.context import Context

    from flash_planner.ros.node import SHUTDOWN_GRACE_S

    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "empty_cache"))
    # quoted: ROS reads a bare on as a boolean
    proc = _node_process(endless_dir, env, **{"engine.compile": "'on'"})
    lines: list[str] = []
    compiling = threading.Event()

    def read() -> None:          # readline blocks: a thread, so the wait below is bounded
        for line in proc.stdout:
            lines.append(line)
            if "compiling the target's forwards" in line:
                compiling.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    context = Context()
    rclpy.init(context=context)
    watcher = rclpy.create_node("startup_watcher", context=context)
    seen: list[dict[str, str]] = []
    watcher.create_subscription(
        DiagnosticArray, "/diagnostics",
        lambda msg: seen.extend({kv.key: kv.value for kv in status.values}
                                for status in msg.status), 10)
    executor = SingleThreadedExecutor(context=context)
    executor.add_node(watcher)
    spinner = threading.Thread(target=executor.spin, daemon=True)
    spinner.start()
    try:
        assert compiling.wait(TIMEOUT), "".join(lines)
        assert wait_for(lambda: any(_warming_up(v) for v in seen), TIMEOUT), seen[-3:]
        status = next(v for v in seen if _warming_up(v))
        # the buckets compiled at warm-up (compile_lazy: plain decoding's, the rest later)
        done, total = map(int, re.fullmatch(r"(\d+) of (\d+)", status["startup steps"]).groups())
        assert 0 <= done < total, status
        assert float(status["startup seconds"]) >= 0
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=SHUTDOWN_GRACE_S + EXIT_S) == 0
        reader.join(EXIT_S)
        output = "".join(lines)
        assert "Traceback" not in output, output
        assert "RCLError" not in output
        assert ("exiting without it" in output
                or "configure stopped: the node is shutting down" in output), output
    finally:
        _stop(proc, executor, spinner, watcher, context)


def test_sigint_with_a_goal_in_flight_aborts_it_and_exits(endless_dir):
    import rclpy
    from rclpy.context import Context

    proc = _node_process(endless_dir)
    # A context of its own: the session's has seen in-process nodes of the same name, whose
    # stale graph entries could make wait_for_server succeed before this server matched.
    context = Context()
    rclpy.init(context=context)
    client_node = rclpy.create_node("shutdown_client", context=context)
    executor = SingleThreadedExecutor(context=context)
    executor.add_node(client_node)
    spinner = threading.Thread(target=executor.spin, daemon=True)
    spinner.start()
    try:
        client = ActionClient(client_node, Plan, "/flash_planner/plan")
        assert client.wait_for_server(timeout_sec=TIMEOUT)
        first = threading.Event()
        goal = Plan.Goal(task="pick up the cup", context="", max_new_tokens=ENDLESS_TOKENS,
                         enable_thinking=False)
        # Until autostart has configured and activated the node a goal is refused, and a
        # request sent before the service matched is lost: send again until one runs.
        deadline = time.monotonic() + TIMEOUT
        result = None
        while not first.is_set() and time.monotonic() < deadline:
            sent = client.send_goal_async(goal, lambda _: first.set())
            if wait_for(sent.done, 5.0) and sent.result().accepted:
                result = sent.result().get_result_async()
                first.wait(2.0)
        assert first.is_set(), "the node never started a goal: " + _output(proc)
        proc.send_signal(signal.SIGINT)
        signalled = time.monotonic()
        response = result_of(result, EXIT_S)
        assert response.status == GoalStatus.STATUS_ABORTED
        assert response.result.error == "the planner node is shutting down"
        assert proc.wait(timeout=EXIT_S) == 0
        assert time.monotonic() - signalled < EXIT_S
        output = proc.stdout.read()
        assert "shutting down: ending goals in flight" in output
        assert "Traceback" not in output, output
    finally:
        _stop(proc, executor, spinner, client_node, context)


def _stop(proc: subprocess.Popen, executor, spinner: threading.Thread, node, context) -> None:
    """The node process killed if it still runs; the test's own client torn down."""
    import rclpy

    if proc.poll() is None:
        proc.kill()
        proc.wait()
    executor.shutdown()
    spinner.join(5)
    node.destroy_node()
    rclpy.shutdown(context=context)


def _output(proc: subprocess.Popen) -> str:
    """What the node printed, after stopping it."""
    if proc.poll() is None:
        proc.kill()
    return proc.communicate(timeout=10)[0][-3000:]
