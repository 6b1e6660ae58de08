"""The rolling latency window and the OK/WARN/ERROR status it gives against the budgets."""

from __future__ import annotations

import numpy as np
import pytest

from flash_planner.planning.request import PlanResult
from flash_planner.ros.diagnostics import (
    ERROR,
    OK,
    WARN,
    BatchRate,
    Budgets,
    LatencyWindow,
    load_values,
    node_status,
    percentile,
    status,
)

BUDGETS = Budgets(ttft_ms=500.0, latency_ms=5000.0)


def _result(latency_ms: float, ttft_ms: float = 50.0, success: bool = False,
            finish_reason: str = "length", error: str = "no plan", tps: float = 100.0,
            accepted: float = 2.0, cycles: int = 5) -> PlanResult:
    telemetry = {"ttft_ms": ttft_ms, "total_latency_ms": latency_ms,
                 "decode_tokens_per_s": tps, "mean_accepted": accepted, "cycles": cycles}
    return PlanResult("r", "t", success, error="" if success else error,
                      finish_reason=finish_reason, telemetry=telemetry)


def _values(kv):
    return dict(kv)


@pytest.mark.parametrize("data", [[5.0], [1.0, 2.0], [3.0, 1.0, 2.0, 10.0, 7.0],
                                  list(np.linspace(0, 100, 37))])
@pytest.mark.parametrize("q", [0, 50, 95, 100])
def test_percentile_matches_numpy(data, q):
    assert percentile(data, q) == pytest.approx(float(np.percentile(data, q)))


def test_percentile_of_nothing_is_zero():
    assert percentile([], 95) == 0.0


def test_no_requests_yet_is_ok():
    level, message, kv = status(LatencyWindow(10), BUDGETS, queue_depth=0)
    assert (level, message) == (OK, "no requests yet")
    assert _values(kv)["requests ok"] == "0" and _values(kv)["queue depth"] == "0"


def test_window_is_bounded_and_counters_are_not():
    window = LatencyWindow(3)
    for latency in (9000.0, 9000.0, 9000.0, 100.0, 200.0, 300.0):
        window.add(_result(latency))
    s = window.summary()
    assert s.samples == 3 and s.failed == 6 and s.ok == 0 and s.requests == 6
    assert s.latency_p50 == 200.0 and s.latency_p95 == pytest.approx(290.0)


def test_summary_percentiles_means_and_last_error():
    window = LatencyWindow(50)
    window.add(_result(100.0, ttft_ms=10.0, success=True, finish_reason="eos", tps=100.0))
    window.add(_result(300.0, ttft_ms=30.0, error="first", tps=300.0, accepted=4.0))
    window.add(_result(200.0, ttft_ms=20.0, error="second", tps=0.0, cycles=0))
    window.add(_result(50.0, finish_reason="cancelled", error="cancelled"))
    s = window.summary()
    assert (s.ok, s.failed, s.cancelled, s.samples) == (1, 2, 1, 4)
    assert s.last_error == "second"
    assert s.ttft_p50 == pytest.approx(float(np.percentile([10, 30, 20, 50], 50)))
    assert s.latency_p95 == pytest.approx(float(np.percentile([100, 300, 200, 50], 95)))
    assert s.tokens_per_s == pytest.approx((100 + 300 + 100) / 3)  # zero rates left out
    assert s.mean_accepted == pytest.approx((2 + 4 + 2) / 3)       # no-cycle requests left out


def test_first_step_and_prefix_cache_percentiles():
    window = LatencyWindow(50)
    extra = [{"first_step_ms": 40.0, "prefix_hit": False, "prefix_restore_ms": 0.0},
             {"first_step_ms": 20.0, "prefix_hit": True, "prefix_restore_ms": 0.5},
             {"prefix_hit": True, "prefix_restore_ms": 1.5},       # no step closed
             {}]                                                  # no prefix
    for fields in extra:
        result = _result(100.0)
        result.telemetry.update(fields)
        window.add(result)
    s = window.summary()
    assert (s.first_step_p50, s.first_step_p95) == (30.0, pytest.approx(39.0))
    assert (s.prefix_hits, s.prefix_requests) == (2, 3)
    assert s.restore_p50 == 1.0 and s.restore_p95 == pytest.approx(1.45)
    values = _values(status(window, Budgets(1000.0, 1000.0), 0)[2])
    assert values["prefix cache hits"] == "2/3" and values["first step p95 ms"] == "39.0"


def test_requests_refused_before_generation_add_no_sample():
    window = LatencyWindow(10)
    window.add(PlanResult("r", "t", False, error="queue full (4 requests waiting)",
                          telemetry={"request_id": "r", "total_latency_ms": 0.1}))
    s = window.summary()
    assert s.samples == 0 and s.failed == 1 and s.last_error.startswith("queue full")
    level, message, _ = status(window, BUDGETS, 0)
    assert level == OK and "1 failed" in message


@pytest.mark.parametrize("latency, ttft, level", [
    (4000.0, 100.0, OK), (5001.0, 100.0, WARN), (10001.0, 100.0, ERROR),
    (1000.0, 600.0, WARN), (1000.0, 1001.0, ERROR), (6000.0, 1200.0, ERROR)])
def test_status_levels_from_budgets(latency, ttft, level):
    window = LatencyWindow(5)
    for _ in range(5):
        window.add(_result(latency, ttft_ms=ttft))
    got, message, kv = status(window, BUDGETS, queue_depth=2)
    assert got == level, message
    if level == OK:
        assert message.startswith("ok:")
    else:
        assert "budget" in message
    values = _values(kv)
    assert values["latency p95 ms"] == f"{latency:.1f}" and values["queue depth"] == "2"
    assert values["last error"] == "no plan" and values["latency budget ms"] == "5000"
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in kv)


def test_p95_not_mean_decides():
    window = LatencyWindow(100)
    for _ in range(90):
        window.add(_result(100.0))
    for _ in range(10):
        window.add(_result(20000.0))
    assert status(window, BUDGETS, 0)[0] == ERROR


def test_status_accepts_a_summary():
    window = LatencyWindow(5)
    window.add(_result(100.0))
    assert status(window.summary(), BUDGETS, 0)[0] == OK


def test_node_status():
    level, message, kv = node_status("unconfigured", "no model: set model.preset", None,
                                     BUDGETS, 0)
    assert level == ERROR and message == "model failed to load: no model: set model.preset"
    assert node_status("inactive", "", LatencyWindow(3), BUDGETS, 0)[:2] == \
        (OK, "inactive: not serving requests")
    level, message, kv = node_status("active", "", LatencyWindow(3), BUDGETS, 1)
    assert (level, message) == (OK, "no requests yet") and kv[0] == ("state", "active")
    assert "compiled" not in dict(kv)     # before a model is loaded there is nothing to say
    kv = node_status("active", "", LatencyWindow(3), BUDGETS, 1, "demo",
                     "no (eager forwards)")[2]
    assert dict(kv)["compiled"] == "no (eager forwards)" and dict(kv)["model"] == "demo"
    assert "threads" not in dict(kv)
    kv = node_status("active", "", LatencyWindow(3), BUDGETS, 1, "demo", "",
                     threads="1 intra-op, 1 inter-op (engine.threads)")[2]
    assert dict(kv)["threads"] == "1 intra-op, 1 inter-op (engine.threads)"


def test_bad_inputs():
    with pytest.raises(ValueError, match="window size"):
        LatencyWindow(0)
    with pytest.raises(ValueError, match="ttft_ms"):
        Budgets(0.0, 1.0)


def test_batch_rate_is_tokens_per_second_between_calls():
    now = [10.0]
    rate = BatchRate(clock=lambda: now[0])
    assert rate.update(100) == 0.0            # the first call: nothing to measure from
    now[0] = 10.5
    assert rate.update(150) == pytest.approx(100.0)
    assert rate.update(150) == 0.0            # no time passed
    now[0] = 11.5
    assert rate.update(150) == 0.0            # idle
    now[0] = 12.0
    assert rate.update(20) == 0.0             # counted from zero again: another service
    now[0] = 13.0
    assert rate.update(60) == pytest.approx(40.0)
    from_start = BatchRate(500, clock=lambda: now[0])   # measured from its count at start
    now[0] = 15.0
    assert from_start.update(700) == pytest.approx(100.0)


def test_load_values_appear_in_every_state_once_a_model_is_loaded():
    report = {"running": 3, "queued": 2, "max_batch": 4, "cycles": 10, "tokens": 90}
    load = load_values(report, 123.456)
    assert dict(load) == {"requests running": "3", "requests queued": "2", "max batch": "4",
                          "batch tokens per s": "123.5"}
    for state, window in (("inactive", None), ("active", LatencyWindow(3))):
        kv = dict(node_status(state, "", window, BUDGETS, 2, "demo", load=load)[2])
        assert {k: kv[k] for k in dict(load)} == dict(load), state
    assert dict(node_status("active", "", LatencyWindow(3), BUDGETS, 2, load=load)[2])[
        "queue depth"] == "2"
    assert "requests running" not in dict(node_status("unconfigured", "", None, BUDGETS, 0)[2])
