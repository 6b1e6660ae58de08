"""The node with `planner.backend: remote_or_local` on real rclpy: plans come from a remote
OpenAI-compatible server, and the node keeps planning on its own engine when that remote
fails mid-stream, answers 500, stalls past a deadline or returns a plan the catalog rejects;
every goal is answered exactly once, and /diagnostics says which backend answers."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest
from live import MISSING, requires_ros, result_of, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from stub_remote import VALID_PLAN, StubRemote  # noqa: E402
from test_serve import KEY, Server  # noqa: E402

if MISSING is None:
    from action_msgs.msg import GoalStatus

pytestmark = requires_ros


def _remote(url: str, stall_s: float = 0.5) -> dict:
    return {"planner.backend": "remote_or_local", "planner.remote_url": url,
            "planner.remote_model": "demo", "planner.remote_timeout_s": stall_s,
            "planner.remote_reserve_s": 1.0}


def _plans_by_id(h) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for plan in h.plans:
        out.setdefault(plan["id"], []).append(plan)
    return out


def test_the_remote_plans_then_every_failure_falls_back_once_per_goal(harness):
    stub = StubRemote("valid")
    try:
        h = harness(**_remote(stub.url))
        h.bring_up()
        first = result_of(h.goal().get_result_async())
        assert first.status == GoalStatus.STATUS_SUCCEEDED
        assert json.loads(first.result.plan_json)["plan"] == VALID_PLAN["plan"]
        ids = [first.result.telemetry.request_id]
        # then the remote fails each way in turn: cut off mid-stream, 500, silent, wrong
        for mode in ("cut", "error", "stall", "invalid"):
            stub.mode = mode
            response = result_of(h.goal().get_result_async())
            assert response.status == GoalStatus.STATUS_SUCCEEDED, (mode,
                                                                    response.result.error)
            ids.append(response.result.telemetry.request_id)
    finally:
        stub.close()
    backends = {}
    assert wait_for(lambda: all(i in _plans_by_id(h) for i in ids))
    by_id = _plans_by_id(h)
    for request_id in ids:
        assert len(by_id[request_id]) == 1                # answered exactly once
        backends[request_id] = by_id[request_id][0]["telemetry"]["backend"]
    assert backends[ids[0]] == "remote"
    assert [backends[i] for i in ids[1:]] == ["local"] * 4
    errors = [by_id[i][0]["telemetry"]["remote_error"] for i in ids[1:]]
    assert "closed its stream" in errors[0] and "HTTP 500" in errors[1]
    assert "stalled" in errors[2] and "invalid plan" in errors[3]
    status = h.node._diagnose()
    values = dict(status[2])
    assert values["backend"] == "remote_or_local" and values["remote"] == "failed"
    assert values["remote answered"] == "1" and values["remote failed"] == "4"


def test_a_served_instance_plans_and_a_kill_mid_stream_falls_back(harness, monkeypatch):
    """Another robot's `flash-planner serve` plans for the node; killed while it streams a
    plan, the goal is finished by the node's own engine, and answered once."""
    monkeypatch.setenv("FLASH_PLANNER_REMOTE_KEY", KEY)
    server = Server("--method", "none").wait_ready()
    try:
        # a real model streams: on a loaded machine a gap between two of its chunks can pass
        # any fixed limit, and the fallback here must come from the kill, not a stall
        h = harness(**_remote(server.url + "/v1", stall_s=120.0))
        h.bring_up()
        first = result_of(h.goal().get_result_async())
        assert first.status == GoalStatus.STATUS_SUCCEEDED, first.result.error
        streamed = threading.Event()

        def kill_on_first_feedback(_msg):
            if not streamed.is_set():
                streamed.set()
                server.proc.kill()          # mid-stream: the remote's plan is not done

        second = result_of(h.goal(on_feedback=kill_on_first_feedback).get_result_async())
        assert streamed.is_set()
        assert second.status == GoalStatus.STATUS_SUCCEEDED, second.result.error
        ids = [first.result.telemetry.request_id, second.result.telemetry.request_id]
        assert wait_for(lambda: all(i in _plans_by_id(h) for i in ids))
        by_id = _plans_by_id(h)
        assert [len(by_id[i]) for i in ids] == [1, 1]
        assert by_id[ids[0]][0]["telemetry"]["backend"] == "remote"
        telemetry = by_id[ids[1]][0]["telemetry"]
        assert telemetry["backend"] == "local", telemetry
        assert "stream" in telemetry["remote_error"], telemetry["remote_error"]
    finally:
        if server.proc.poll() is None:
            server.stop()


@pytest.mark.parametrize("bad", [{"planner.backend": "remote"},
                                 {"planner.backend": "remote_or_local",
                                  "planner.remote_url": "ftp://x"}])
def test_a_remote_backend_without_a_usable_url_fails_configure_naming_it(harness, bad):
    h = harness(**bad)
    from rclpy.lifecycle import TransitionCallbackReturn

    assert h.node.trigger_configure() != TransitionCallbackReturn.SUCCESS
    assert "planner.remote_url" in h.node._load_error or "planner.backend" in \
        h.node._load_error
