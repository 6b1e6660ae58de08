"""The remote backend (planning/remote.py) through the planner service: plans made by an
OpenAI-compatible server (our own `flash-planner serve`, over real HTTP), and the local
fallback when the remote is unreachable, errors, stalls, is cut off, is too slow for the
deadline, or answers a plan the catalog rejects. Every request gets exactly one answer."""

from __future__ import annotations

import time

import pytest
from stub_remote import VALID_PLAN, StubRemote
from test_serve import KEY, Server

from flash_planner.engine.engine import Engine
from flash_planner.planning.presets import ModelPreset, default_skills_path
from flash_planner.planning.remote import RemoteConfig
from flash_planner.planning.request import PlanRequest
from flash_planner.planning.service import PlannerConfig, PlannerService
from flash_planner.planning.skills import SkillCatalog

TASK = "bring the red cup from the kitchen table to the sink"
TIMEOUT = 300


@pytest.fixture(scope="module")
def demo():
    return Engine.load(ModelPreset.load("demo").engine_config(device="cpu", dtype="fp32"))


@pytest.fixture
def planner(demo):
    services = []

    def make(url: str, backend: str = "remote_or_local", reserve_s: float = 1.0, **remote):
        service = PlannerService(demo, SkillCatalog.from_yaml(default_skills_path()),
                                 PlannerConfig(backend=backend, remote=RemoteConfig(
                                     url, "demo", **remote), remote_reserve_s=reserve_s))
        service.start()
        services.append(service)
        return service

    yield make
    for service in services:
        service.stop()


def _plan(service, **request):
    feedback = []
    result = service.plan(PlanRequest(TASK, **request), on_feedback=feedback.append,
                          timeout=TIMEOUT)
    return result, [s for f in feedback for s in f.steps]


def test_a_served_instance_plans_and_its_steps_stream_back(planner, monkeypatch):
    monkeypatch.setenv("FLASH_PLANNER_API_KEY", KEY)     # the key comes from the environment
    server = Server().wait_ready()
    try:
        service = planner(server.url + "/v1", key_env="FLASH_PLANNER_API_KEY")
        result, steps = _plan(service)
        assert result.success, result.error
        assert result.telemetry["backend"] == "remote"
        assert result.telemetry["remote_latency_ms"] > 0
        assert [step for _, step in steps] == result.plan
        assert result.thinking          # the served model's thought came back
        assert service.remote.health.ok and service.remote.health.answered == 1
        server.stop()
        # the server is gone: the next request falls back, answered once
        result, _ = _plan(service)
        assert result.success and result.telemetry["backend"] == "local"
        assert "unreachable" in result.telemetry["remote_error"]
        assert service.remote.health.ok is False
    finally:
        if server.proc.poll() is None:
            server.stop()


@pytest.mark.parametrize("mode,why", [
    ("error", "answered HTTP 500"),
    ("stall", "stalled for 0.5 s"),
    ("cut", "closed its stream before [DONE]"),
    ("invalid", "the remote answered an invalid plan: step 1: unknown skill 'fly'"),
])
def test_each_remote_failure_falls_back_to_the_local_engine(planner, mode, why):
    stub = StubRemote(mode)
    try:
        service = planner(stub.url, read_timeout_s=0.5)
        result, _ = _plan(service)
        assert result.success, result.error
        assert result.telemetry["backend"] == "local"
        assert why in result.telemetry["remote_error"], result.telemetry["remote_error"]
        assert len(stub.requests) == 1
        body = stub.requests[0]
        assert body["response_format"]["type"] == "json_schema" and body["stream"] is True
        assert body["messages"][-1]["content"].endswith(TASK)
        # remote only: the same failure is the answer, with the reason
        only = planner(stub.url, backend="remote", read_timeout_s=0.5)
        failed, _ = _plan(only)
        assert not failed.success and failed.error.startswith("remote backend: ")
        assert why in failed.error
    finally:
        stub.close()


def test_a_remote_too_slow_for_the_deadline_leaves_time_to_plan_locally(planner):
    # the reserve is ten local plans of this run, so a loaded machine still plans in it
    local = time.monotonic()
    assert _plan(planner("http://127.0.0.1:9/v1", backend="local"))[0].success
    reserve = round(max(1.0, 10 * (time.monotonic() - local)), 3)
    stub = StubRemote("slow", period=0.1)          # keeps talking, never finishes
    try:
        service = planner(stub.url, reserve_s=reserve, read_timeout_s=5.0)
        result, _ = _plan(service, deadline_s=reserve + 2.0)
        assert result.success, result.error
        assert result.telemetry["backend"] == "local"
        assert "deadline" in result.telemetry["remote_error"]
    finally:
        stub.close()


def test_a_valid_remote_plan_is_validated_like_a_local_one(planner):
    stub = StubRemote("valid")
    try:
        result, steps = _plan(planner(stub.url))
        assert result.success and result.plan == VALID_PLAN["plan"]
        assert result.telemetry["backend"] == "remote"
        assert result.thinking == "Go to the sink, then say so."
        assert [s for _, s in steps] == VALID_PLAN["plan"]
    finally:
        stub.close()


def test_every_cli_backend_plans_through_a_served_instance(monkeypatch, capsys):
    """`flash-planner plan --backend ...`: each value end to end through the command line."""
    import json

    from flash_planner.cli import main

    monkeypatch.setenv("FLASH_PLANNER_REMOTE_KEY", KEY)
    server = Server().wait_ready()

    def plan(backend: str) -> tuple[int, dict]:
        code = main(["plan", TASK, "--json", "--device", "cpu", "--backend", backend,
                     "--remote-url", server.url + "/v1", "--remote-model", "demo"])
        out = capsys.readouterr().out
        return code, json.loads(out.splitlines()[-1])

    try:
        for backend, made_by in (("local", "local"), ("remote", "remote"),
                                 ("remote_or_local", "remote")):
            code, result = plan(backend)
            assert code == 0 and result["success"], (backend, result["error"])
            assert result["telemetry"]["backend"] == made_by, backend
    finally:
        server.stop()
    code, result = plan("remote_or_local")          # the server is gone: planned on board
    assert code == 0 and result["telemetry"]["backend"] == "local"
    assert "unreachable" in result["telemetry"]["remote_error"]
    code, result = plan("remote")
    assert code == 1 and result["error"].startswith("remote backend: ")


def test_a_reasoning_effort_goes_to_the_remote_template(planner):
    """The demo's own template takes no effort; a remote-only planner passes it on as a
    template variable (vLLM's and SGLang's chat_template_kwargs) and leaves it to them."""
    stub = StubRemote("error")
    try:
        service = planner(stub.url, backend="remote", read_timeout_s=0.5)
        assert service.warm_up() == 0.0     # its engine never decodes a request: no warm-up
        result, _ = _plan(service, reasoning_effort="low")
        assert not result.success and result.error.startswith("remote backend: ")
        kwargs = stub.requests[0]["chat_template_kwargs"]
        assert kwargs == {"enable_thinking": True, "reasoning_effort": "low"}
        local = planner(stub.url, read_timeout_s=0.5)      # the fallback could not honour it
        refused, _ = _plan(local, reasoning_effort="low")
        assert refused.rejected and "does not take reasoning_effort" in refused.error
    finally:
        stub.close()


def _patterns(schema):
    if isinstance(schema, dict):
        return ([schema["pattern"]] if "pattern" in schema else []) + [
            p for v in schema.values() for p in _patterns(v)]
    return [p for v in schema for p in _patterns(v)] if isinstance(schema, list) else []


def test_the_schema_sent_holds_the_grounded_names_as_the_spec_reads_it(planner):
    """A server that follows JSON Schema (llama.cpp's llama-server) decodes by the schema it
    is sent, where a `pattern` matches anywhere in the string unless anchored: read that way,
    the request's schema must still admit the task's names and nothing around them."""
    from jsonschema import Draft202012Validator
    from jsonschema.validators import validator_for

    stub = StubRemote("valid")
    try:
        assert _plan(planner(stub.url))[0].success
    finally:
        stub.close()
    schema = stub.requests[0]["response_format"]["json_schema"]["schema"]
    validator = validator_for(schema, default=Draft202012Validator)
    validator.check_schema(schema)
    check = validator(schema)

    def plan(target):
        return {"plan": [{"skill": "navigate_to", "args": {"target": target}},
                         {"skill": "say", "args": {"text": f"at the {target}"}}]}

    assert check.is_valid(VALID_PLAN)
    for name in ("red cup", "cup", "kitchen table", "table", "sink", "bring the red cup"):
        assert check.is_valid(plan(name)), name
    for name in ("xx red cup yy", "the sink", "sink please", "red cup and the sink", "moon",
                 "kitchen", "", "cup|moon", "^cup$"):
        assert not check.is_valid(plan(name)), name
    # anchored once (xgrammar warns of, and ignores, an anchor inside a pattern)
    patterns = _patterns(schema)
    assert patterns and all(p.startswith("^(") and p.endswith(")$") and p[1] != "^"
                            and p[-2] != "$" for p in patterns), patterns
