"""/diagnostics and runtime parameters of the node on real rclpy."""

from __future__ import annotations

import socket

from live import MISSING, requires_ros, values_of, wait_for

from flash_planner.ros import params

if MISSING is None:
    from action_msgs.msg import GoalStatus
    from diagnostic_msgs.msg import DiagnosticStatus
    from rclpy.parameter import Parameter

pytestmark = requires_ros
KEYS = ("state", "model", "requests ok", "requests failed", "requests cancelled",
        "ttft p50 ms", "ttft p95 ms", "latency p50 ms", "latency p95 ms", "tokens per s",
        "mean accepted length", "tokens per cycle", "queue depth", "last error",
        "ttft budget ms", "latency budget ms", "requests running", "requests queued",
        "max batch", "batch tokens per s", "state read per cycle MB",
        "state written per cycle MB")


def _level_after(h, since: int, level) -> bool:
    return wait_for(lambda: any(s.level == level for s in h.statuses()[since:]), 30)


def test_diagnostics_carry_the_keys_and_follow_the_budget(harness):
    h = harness(**{"diagnostics.hardware_id": "thor-01", "engine.threads": 1,
                   "engine.max_batch": 2})
    h.bring_up()
    assert h.plan()[0] == GoalStatus.STATUS_SUCCEEDED
    assert wait_for(lambda: any(values_of(s).get("requests ok") == "1" for s in h.statuses()))
    status = h.statuses()[-1]
    values = values_of(status)
    assert set(KEYS) <= set(values), sorted(set(KEYS) - set(values))
    assert status.hardware_id == "thor-01" and values["model"] == "demo"
    # the load: nothing in flight now, two slots (engine.max_batch); the plan's tokens were
    # counted by a status between configure and now
    assert (values["requests running"], values["requests queued"]) == ("0", "0")
    assert values["max batch"] == "2" and values["queue depth"] == "0"
    assert any(float(values_of(s).get("batch tokens per s", 0)) > 0 for s in h.statuses())
    assert values["threads"].startswith("1 intra-op, ") and "(engine.threads)" in values["threads"]
    assert float(values["latency p95 ms"]) > 0 and float(values["tokens per cycle"]) > 1
    # the demo's KV rows and GDN state, moved by every cycle (engine/state/traffic.py)
    read, written = (float(values[f"state {x} per cycle MB"]) for x in ("read", "written"))
    assert read > written > 0
    assert status.level == DiagnosticStatus.OK and status.message.startswith("ok: p95 latency")

    # Budgets are live parameters: a budget far below the measured latency is an ERROR.
    n = len(h.statuses())
    h.node.set_parameters([Parameter("diagnostics.latency_budget_ms", value=1.0)])
    assert _level_after(h, n, DiagnosticStatus.ERROR)
    assert "over twice the 1 ms budget" in h.statuses()[-1].message
    latency = float(values_of(h.statuses()[-1])["latency p95 ms"])
    n = len(h.statuses())
    h.node.set_parameters([Parameter("diagnostics.latency_budget_ms", value=latency / 1.5)])
    assert _level_after(h, n, DiagnosticStatus.WARN)
    n = len(h.statuses())
    h.node.set_parameters([Parameter("diagnostics.latency_budget_ms", value=1e6)])
    assert _level_after(h, n, DiagnosticStatus.OK)


def test_hardware_id_defaults_to_the_host_name(harness):
    h = harness()
    assert wait_for(lambda: h.statuses())
    status = h.statuses()[-1]
    assert status.hardware_id == socket.gethostname()
    assert status.message == "unconfigured: not serving requests"


def test_runtime_parameter_changes_are_checked_and_the_node_keeps_serving(harness):
    h = harness()
    h.bring_up()
    node = h.node
    refused = {
        "wrong type": Parameter("diagnostics.ttft_budget_ms", value="fast"),
        "out of range": Parameter("diagnostics.ttft_budget_ms", value=-5.0),
        "read-only": Parameter("model.path", value="/elsewhere"),
    }
    for why, param in refused.items():
        (result,) = node.set_parameters([param])
        assert not result.successful and result.reason, why
    assert node.get_parameter("diagnostics.ttft_budget_ms").value == 500.0
    assert node.get_parameter("model.path").value == ""
    (result,) = node.set_parameters([Parameter("diagnostics.ttft_budget_ms", value=800.0)])
    assert result.successful
    assert h.plan()[0] == GoalStatus.STATUS_SUCCEEDED


def test_declare_reports_a_rejected_override_and_keeps_the_default(ros_context):
    import rclpy

    node = rclpy.create_node("declare_probe", context=ros_context, parameter_overrides=[
        Parameter("planner.deadline_s", value=0),          # int for a float parameter
        Parameter("planner.queue_depth", value=5000),      # out of range
        Parameter("model.path", value="/m")])
    try:
        errors = params.declare(node)
        assert [e.split(":")[0] for e in errors] == ["planner.queue_depth", "planner.deadline_s"]
        values = params.read(node)
        assert values["planner.deadline_s"] == 0.0 and values["planner.queue_depth"] == 4
        assert values["model.path"] == "/m" and set(values) == {p.name for p in params.PARAMS}
        descriptor = node.describe_parameter("engine.max_context")
        assert descriptor.read_only and descriptor.integer_range[0].to_value == 1 << 20
        budget = node.describe_parameter("diagnostics.latency_budget_ms")
        assert not budget.read_only and budget.floating_point_range[0].from_value == 1.0
        policy = node.describe_parameter("planner.queue_policy")
        assert "queue, preempt, reject" in policy.additional_constraints
    finally:
        node.destroy_node()
