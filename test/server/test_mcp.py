"""`flash-planner mcp` (server/mcp_server.py) with the MCP SDK's own client, over stdio and over
streamable HTTP, on the demo planner served in this process: the tools are listed, `plan`
returns a valid plan for a task the demo plans, `skills` the catalog as OpenAI tools, the
health resource reads; a bad request is the tool's error naming it, and the session goes on.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from contextlib import closing

import pytest
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
    bad = await session.call_tool("plan", {"task": "   "})
    again = await session.call_tool("plan", {"task": TASK})
    return {"tools": tools, "plan": planned, "skills": skills, "health": health, "bad": bad,
            "again": again}


def _json(result) -> dict:
    assert not result.is_error, result
    return json.loads(result.content[0].text)


def _check(seen: dict) -> None:
    assert seen["tools"] == {"plan", "skills"}          # no execute without --execute-node
    plan = _json(seen["plan"])
    assert plan["success"], plan
    catalog = SkillCatalog.from_yaml(default_skills_path())
    validate_plan({"plan": plan["plan"]}, catalog)
    assert plan["telemetry"]["new_tokens"] > 0
    tools = _json(seen["skills"])["tools"]
    assert {t["function"]["name"] for t in tools} == set(catalog.names)
    assert json.loads(seen["health"].contents[0].text)["status"] == "ok"
    assert seen["bad"].is_error and "task" in seen["bad"].content[0].text, seen["bad"]
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
