"""`flash-planner mcp` (server/mcp_server.py) with the MCP SDK's own client, over stdio and over
streamable HTTP: with `--url`, on the demo planner served in this process; with `--model
demo`, the planner loaded in its own process and nothing else started. The tools are listed,
`plan` returns a valid plan for a task the demo plans, `skills` the catalog as OpenAI tools,
the resources read with their MIME types; a bad request (or a plan that failed) is the
tool's error naming it, and the session goes on. A `--url` nothing answers exits 2 with one
line; SIGINT and SIGTERM end the server with exit 0 and no traceback.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import closing

import pytest
from mcp_stop import Server, assert_clean_exit, stop_with_a_session_open
from served import InProcess, free_port

from flash_planner.planning.parse import validate_plan
from flash_planner.planning.presets import default_skills_path
from flash_planner.planning.skills import SkillCatalog

TASK = "bring the red cup from the kitchen table to the sink"
TIMEOUT = 300


@pytest.fixture(scope="module")
def planner():
    served = InProcess("flash_planner/assets/demo/target", "flash_planner/assets/demo/drafter",
                       "demo")
    yield served
    served.stop()


async def _exchange(session) -> dict:
    """What a host sees: the tools, a plan, the skills, the health, a bad call, a good one."""
    await session.initialize()
    tools = {t.name for t in (await session.list_tools()).tools}
    planned = await session.call_tool("plan", {"task": TASK})
    skills = await session.call_tool("skills", {})
    health = await session.read_resource("flash-planner://health")
    metrics = await session.read_resource("flash-planner://metrics")
    bad = await session.call_tool("plan", {"task": "   "})
    again = await session.call_tool("plan", {"task": TASK})
    return {"tools": tools, "plan": planned, "skills": skills, "health": health, "bad": bad,
            "again": again, "metrics": metrics}


def _json(result) -> dict:
    assert not result.is_error, result
    return json.loads(result.content[0].text)


def _check(seen: dict, metrics_mime: str = "text/plain") -> None:
    assert seen["tools"] == {"plan", "skills"}          # no execute without --execute-node
    plan = _json(seen["plan"])
    assert plan["success"], plan
    catalog = SkillCatalog.from_yaml(default_skills_path())
    validate_plan({"plan": plan["plan"]}, catalog)
    assert plan["telemetry"]["new_tokens"] > 0
    tools = _json(seen["skills"])["tools"]
    assert {t["function"]["name"] for t in tools} == set(catalog.names)
    health, metrics = seen["health"].contents[0], seen["metrics"].contents[0]
    assert (health.mime_type, json.loads(health.text)["status"]) == ("application/json", "ok")
    assert metrics.mime_type == metrics_mime and metrics.text
    if metrics_mime == "application/json":
        assert json.loads(metrics.text)["requests"]["ok"] >= 1, metrics.text
    assert seen["bad"].is_error, seen["bad"]
    assert "invalid request: task is empty" in seen["bad"].content[0].text, seen["bad"]
    assert _json(seen["again"])["plan"] == plan["plan"]


def test_a_host_over_stdio_lists_the_tools_and_gets_a_valid_plan(planner):
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    params = StdioServerParameters(command=sys.executable,
                                   args=["-m", "flash_planner.cli", "mcp", "--url", planner.url],
                                   env=dict(os.environ))

    async def run() -> dict:
        async with stdio_client(params) as (read, write):
            async with ClientSession(read, write) as session:
                return await _exchange(session)

    _check(asyncio.run(asyncio.wait_for(run(), TIMEOUT)))


def test_with_a_model_it_plans_in_its_own_process_with_nothing_else_started():
    """What a host's configuration starts: `flash-planner mcp --model demo` over stdio, no
    server beside it; the host's first calls wait for the model to load."""
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    params = StdioServerParameters(command=sys.executable,
                                   args=["-m", "flash_planner.cli", "mcp", "--model", "demo"],
                                   env=dict(os.environ))

    async def run() -> dict:
        async with stdio_client(params) as (read, write):
            async with ClientSession(read, write) as session:
                return await _exchange(session)

    _check(asyncio.run(asyncio.wait_for(run(), TIMEOUT)), "application/json")


def test_a_url_nothing_answers_exits_2_with_one_line_naming_it():
    url = f"http://127.0.0.1:{free_port()}"
    for args in (["--url", url], ["--url", url, "--transport", "http"]):
        done = subprocess.run([sys.executable, "-m", "flash_planner.cli", "mcp", *args],
                              capture_output=True, text=True, timeout=TIMEOUT,
                              stdin=subprocess.DEVNULL)
        assert (done.returncode, done.stdout) == (2, ""), done
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and url in lines[0] and "cannot be reached" in lines[0], lines


def test_model_and_url_are_one_or_the_other(capsys):
    from flash_planner.cli import EXIT_USAGE, main

    assert main(["mcp", "--model", "demo", "--url", "http://127.0.0.1:1"]) == EXIT_USAGE
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize("transport", ["stdio", "http"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_ends_it_with_exit_0_and_no_traceback(transport, sig):
    """With a session open and the model loaded (a plan made): SIGINT twice, as Ctrl-C
    under `ros2 launch` delivers it, or SIGTERM."""
    server = Server("flash_planner.cli", ["mcp", "--model", "demo"], transport, free_port())
    reply, code = stop_with_a_session_open(server, "plan", {"task": TASK}, sig)
    assert_clean_exit(server, code)
    planned = (json.loads(reply["result"]["content"][0]["text"]) if transport == "stdio"
               else _json(reply))
    assert planned["success"], planned


def test_format_bt_adds_the_plan_as_a_tree_that_reads_back_to_it_through_each_door(planner):
    """`format: "bt"`, described in the tool's schema, through the planner in this process
    and through `serve`: `bt_xml` beside the plan, which bt.py reads back to that plan; a
    format of neither kind is the tool's error naming it, and nothing is planned."""
    from mcp import Client

    from flash_planner.planning.bt import from_bt_xml
    from flash_planner.server.mcp_server import HttpDoor, ServiceDoor, build_server

    catalog = SkillCatalog.from_yaml(default_skills_path())

    async def run(door):
        async with Client(build_server(door), mode="legacy") as client:
            tool = next(t for t in (await client.list_tools()).tools if t.name == "plan")
            tree = await client.call_tool("plan", {"task": TASK, "format": "bt"})
            bad = await client.call_tool("plan", {"task": TASK, "format": "xml"})
            return tool, tree, bad

    in_process = ServiceDoor(lambda: planner.service, "demo")
    for door in (in_process, HttpDoor(planner.url, timeout=TIMEOUT)):
        tool, tree, bad = asyncio.run(asyncio.wait_for(run(door), TIMEOUT))
        assert tool.input_schema["properties"]["format"]["default"] == "json", tool
        assert '"bt"' in tool.description, tool.description
        answer = _json(tree)
        assert answer["success"] and answer["plan"], answer
        validate_plan({"plan": answer["plan"]}, catalog)
        assert answer["bt_xml"].startswith("<?xml"), answer
        assert from_bt_xml(answer["bt_xml"], catalog) == answer["plan"], answer
        assert bad.is_error, bad
        assert "format must be json or bt" in bad.content[0].text, bad
        assert "got 'xml'" in bad.content[0].text, bad
    # the bad format was refused before the planner saw it: one plan made, nothing refused
    assert json.loads(in_process.metrics())["requests"] == {"ok": 1, "failed": 0,
                                                            "rejected": 0}


class _Failing:
    """A door whose planner answers with a failed plan, as /v1/plans and ~/plan can."""

    METRICS_MIME = "text/plain"

    def plan(self, request):
        return {"success": False, "error": "the planner refused the task: no skill flies",
                "telemetry": {"new_tokens": 9}}


def test_a_plan_that_failed_is_the_tools_error_never_a_result():
    from mcp import Client

    from flash_planner.server.mcp_server import build_server

    async def run():
        async with Client(build_server(_Failing()), mode="legacy") as client:
            return await client.call_tool("plan", {"task": "fly to the moon"})

    result = asyncio.run(asyncio.wait_for(run(), TIMEOUT))
    assert result.is_error, result
    assert "the planner refused the task: no skill flies" in result.content[0].text


def test_health_is_json_when_the_planner_cannot_be_reached():
    from flash_planner.server.mcp_server import HttpDoor

    url = f"http://127.0.0.1:{free_port()}"
    health = json.loads(HttpDoor(url, timeout=5).health())
    assert health["status"] == "error" and health["url"] == url, health
    assert "cannot be reached" in health["error"], health


def test_a_host_over_streamable_http_gets_the_same(planner):
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "flash_planner.cli", "mcp", "--url",
                             planner.url, "--transport", "http", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + TIMEOUT
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                with closing(socket.create_connection(("127.0.0.1", port), 0.2)):
                    break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.05)

        async def run() -> dict:
            async with streamable_http_client(f"http://127.0.0.1:{port}/mcp") as streams:
                async with ClientSession(streams[0], streams[1]) as session:
                    return await _exchange(session)

        _check(asyncio.run(asyncio.wait_for(run(), TIMEOUT)))
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_planner_that_is_not_running_is_a_clear_tool_error():
    from flash_planner.server.mcp_server import HttpDoor, build_server

    app = build_server(HttpDoor(f"http://127.0.0.1:{free_port()}", timeout=5))

    async def run():
        return await app.call_tool("plan", {"task": TASK})

    with pytest.raises(Exception) as caught:
        asyncio.run(run())
    assert "cannot be reached" in str(caught.value)


class _Executor:
    """A stand-in for ros/mcp_door.RosDoor's execute: refuses a task, hangs on a plan until
    cancelled (and records that it was)."""

    def __init__(self):
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def execute(self, task, plan, dry_run):
        from flash_planner.server.mcp_server import DoorError

        if task:
            raise DoorError("the run did not complete (gate, 0 steps done): nothing sent")
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


def test_execute_refusals_are_tool_errors_and_a_hosts_cancel_reaches_the_run():
    """The server's side without a node (test/ros/test_node_mcp.py has it with one): the
    host's cancel of a call cancels the executor's coroutine while the session goes on."""
    import anyio
    from mcp import Client

    from flash_planner.server.mcp_server import HttpDoor, build_server

    executor = _Executor()
    app = build_server(HttpDoor(f"http://127.0.0.1:{free_port()}", timeout=5), executor)

    async def run():
        async with Client(app, mode="legacy") as client:
            refused = await client.call_tool("execute", {"task": "go"})
            async with anyio.create_task_group() as tg:
                tg.start_soon(client.call_tool, "execute", {"plan": [{"skill": "wait"}]})
                await executor.started.wait()
                tg.cancel_scope.cancel()
            await asyncio.wait_for(executor.cancelled.wait(), TIMEOUT)
            return refused

    refused = asyncio.run(asyncio.wait_for(run(), TIMEOUT))
    assert refused.is_error and "(gate, 0 steps done)" in refused.content[0].text, refused


def test_a_bad_port_is_a_usage_error_naming_it(capsys):
    from flash_planner.cli import EXIT_USAGE, main

    assert main(["mcp", "--port", "0"]) == EXIT_USAGE
    assert "--port must be 1 to 65535, got 0" in capsys.readouterr().err
