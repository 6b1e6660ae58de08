"""`planner_mcp` (ros/mcp_door.py): the MCP server's tools reach a running planner node
through its own actions. `plan` is a goal of ~/plan (the node's queue and grammar) and comes
back as /v1/plans answers (`format: "bt"` with the node's tree), a refused request as the
tool's error; `skills` is the catalog the node loaded (its latched ~/skills), whatever
`--skills` names; the resources are JSON under application/json. `execute` is offered only
when asked for and goes through ~/execute, whose gate refuses what the catalog does not bind
(the tool's error). A host's cancel or timeout of `execute`, or `--execute-timeout`, cancels
the run on the node: the skill server counts the cancel of the running step's goal. SIGINT
and SIGTERM end `planner_mcp` with exit 0 and no traceback, over stdio and HTTP."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import pytest
import test_node_execute
from live import NODE, requires_ros, wait_for
from mcp_stop import Server, assert_clean_exit, stop_with_a_session_open
from served import free_port
from test_node_execute import PLAN

from flash_planner.planning.bt import from_bt_xml
from flash_planner.planning.parse import validate_plan
from flash_planner.planning.presets import default_skills_path
from flash_planner.planning.skill_tools import skill_tools
from flash_planner.planning.skills import SkillCatalog

pytestmark = requires_ros
TASK = "bring the red cup from the kitchen table to the sink"
robot = test_node_execute.robot     # the fixture: the node, the skill servers, their counts


def test_plan_and_execute_go_through_the_nodes_own_actions(harness, ros_context):
    from flash_planner.ros.mcp_door import RosDoor
    from flash_planner.server.mcp_server import build_server

    h = harness()
    h.bring_up()
    door = RosDoor(NODE, context=ros_context)
    try:
        planned = door.plan({"task": TASK})
        assert planned["success"], planned
        validate_plan({"plan": planned["plan"]}, SkillCatalog.from_yaml(default_skills_path()))
        assert planned["telemetry"]["new_tokens"] > 0
        assert {t["function"]["name"] for t in door.skills([])} == set(
            SkillCatalog.from_yaml(default_skills_path()).names)

        async def names(app) -> set[str]:
            return {t.name for t in await app.list_tools()}

        assert asyncio.run(names(build_server(door))) == {"plan", "skills"}
        # `format: "bt"`: the tree the node wrote beside the plan, which reads back to it
        assert "bt_xml" not in planned, planned
        tree = json.loads(_text(_call(build_server(door), "plan",
                                      {"task": TASK, "format": "bt"})))
        assert tree["success"] and tree["plan"], tree
        assert from_bt_xml(tree["bt_xml"], SkillCatalog.from_yaml(default_skills_path())) \
            == tree["plan"], tree
        assert asyncio.run(names(build_server(door, door))) == {"plan", "skills", "execute"}
        # the default catalog binds no skill to a server: the node refuses the run, which
        # is the tool's error
        ran = _call(build_server(door, door), "execute", {"task": TASK, "dry_run": True})
        assert ran.is_error and "(refused, 0 steps done)" in _text(ran), ran
        assert "binds no skill to an action or service" in _text(ran), ran
        with pytest.raises(ValueError, match="a task or a plan"):
            asyncio.run(door.execute("  ", [], False))
        assert wait_for(lambda: json.loads(door.health())["diagnostics"])
        health = json.loads(door.health())
        assert health["status"] == "ok"
        assert any("latency" in k or "p50" in k or "state" in k
                   for entry in health["diagnostics"].values() for k in entry["values"]), health
    finally:
        door.close()


def test_planner_mcp_over_stdio_plans_through_the_node(harness):
    """What the launch file's `mcp` argument starts (over stdio here): the SDK's client lists
    plan, skills and execute, and `plan` returns the node's valid plan."""
    import os
    import sys

    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    h = harness()
    h.bring_up()
    params = StdioServerParameters(
        command=sys.executable, env=dict(os.environ),
        args=["-m", "flash_planner.ros.mcp_door", "--node", f"/{NODE}", "--execute"])

    async def run():
        async with stdio_client(params) as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                tools = {t.name for t in (await session.list_tools()).tools}
                return tools, await session.call_tool("plan", {"task": TASK})

    tools, planned = asyncio.run(asyncio.wait_for(run(), 300))
    assert tools == {"plan", "skills", "execute"}
    assert not planned.is_error, planned
    plan = json.loads(planned.content[0].text)
    assert plan["success"], plan
    validate_plan({"plan": plan["plan"]}, SkillCatalog.from_yaml(default_skills_path()))


MOBILE = Path(__file__).resolve().parents[2] / "config" / "catalogs" / "mobile_manipulator.yaml"


def test_refusals_are_tool_errors_and_the_resources_json(harness, ros_context):
    from mcp import Client

    from flash_planner.ros.mcp_door import RosDoor
    from flash_planner.server.mcp_server import build_server

    harness().bring_up()
    door = RosDoor(NODE, context=ros_context)

    async def run():
        async with Client(build_server(door), mode="legacy") as client:
            bad = await client.call_tool("plan", {"task": "   "})
            # the node's first /diagnostics status, which both resources report
            assert await asyncio.to_thread(
                wait_for, lambda: json.loads(door.health())["diagnostics"])
            return bad, [(await client.read_resource(f"flash-planner://{name}")).contents[0]
                         for name in ("health", "metrics")]

    try:
        bad, (health, metrics) = asyncio.run(asyncio.wait_for(run(), 300))
    finally:
        door.close()
    assert bad.is_error and "task is empty" in _text(bad), bad
    assert health.mime_type == metrics.mime_type == "application/json"
    assert json.loads(health.text)["status"] == "ok", health.text
    assert any(name.startswith(NODE) for name in json.loads(metrics.text)), metrics.text


def test_skills_are_the_catalog_the_node_loaded_not_the_file_given(harness, ros_context):
    """The node plans with the example catalog; `--skills` names the default one, which the
    node's ~/skills overrides: the tools, scene grounding included, are the node's."""
    from flash_planner.ros.mcp_door import RosDoor

    harness(**{"planner.skills_file": str(MOBILE)}).bring_up()
    door = RosDoor(NODE, str(default_skills_path()), context=ros_context)
    scene = ["blue mug|mug", "kitchen sink|sink"]
    try:
        node_catalog = SkillCatalog.from_yaml(MOBILE)
        assert door.skills([]) == skill_tools(node_catalog)
        assert door.skills(scene) == skill_tools(node_catalog, scene)
    finally:
        door.close()
    assert set(node_catalog.names) != set(SkillCatalog.from_yaml(default_skills_path()).names)


def test_without_a_node_skills_is_the_tools_error_or_the_file_given(ros_context,
                                                                  monkeypatch):
    from flash_planner.ros import mcp_door

    monkeypatch.setattr(mcp_door, "SERVER_WAIT_S", 0.0)   # no node at all: nothing to wait on
    alone = mcp_door.RosDoor("/nobody", context=ros_context)
    given = mcp_door.RosDoor("/nobody", str(MOBILE), context=ros_context)
    try:
        with pytest.raises(ValueError, match="no catalog on /nobody/skills"):
            alone.skills([])
        assert given.skills([]) == skill_tools(SkillCatalog.from_yaml(MOBILE))
    finally:
        alone.close()
        given.close()


@pytest.mark.parametrize("transport", ["stdio", "http"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_planner_mcp_ends_on_a_signal_with_exit_0_and_no_traceback(harness, transport, sig):
    """As `ros2 launch ... mcp:=true` stops it (SIGINT twice: the terminal's, then
    launch's), or SIGTERM, with a session open that read the node's skills."""
    harness().bring_up()
    server = Server("flash_planner.ros.mcp_door", ["--node", f"/{NODE}"], transport,
                    free_port())
    reply, code = stop_with_a_session_open(server, "skills", {}, sig)
    assert_clean_exit(server, code)
    text = reply["result"]["content"][0]["text"] if transport == "stdio" else _text(reply)
    names = {t["function"]["name"] for t in json.loads(text)["tools"]}
    assert names == set(SkillCatalog.from_yaml(default_skills_path()).names)


def _call(app, tool: str, arguments: dict, **kwargs):
    """One tool call through the SDK's client over JSON-RPC in memory (what a host sends)."""
    from mcp import Client

    async def run():
        async with Client(app, mode="legacy") as client:
            return await client.call_tool(tool, arguments, **kwargs)

    return asyncio.run(run())


def _text(result) -> str:
    return result.content[0].text


def _execute_statuses(r) -> list:
    """Every GoalStatusArray the node publishes for its ~/execute goals, in order."""
    from action_msgs.msg import GoalStatusArray
    from rclpy.qos import qos_profile_action_status_default

    seen: list = []
    r.h.client_node.create_subscription(GoalStatusArray, f"/{NODE}/execute/_action/status",
                                        seen.append, qos_profile_action_status_default)
    return seen


def _ended_canceled(seen: list) -> bool:
    from action_msgs.msg import GoalStatus

    return bool(seen) and [s.status for s in seen[-1].status_list] == \
        [GoalStatus.STATUS_CANCELED]


@pytest.mark.parametrize("how", ["cancel", "timeout"])
def test_a_hosts_cancel_or_timeout_of_execute_cancels_the_run_on_the_node(robot, ros_context,
                                                                          how):
    """The pick hangs; the host cancels its call once the pick's goal is out (or its read
    timeout passes): the door cancels the ExecutePlan goal, the node the pick's, and the
    session goes on."""
    import anyio
    from mcp import Client
    from mcp.shared.exceptions import MCPError

    from flash_planner.ros.mcp_door import RosDoor
    from flash_planner.server.mcp_server import build_server

    r = robot()
    r.servers.manip.script = ["hang"]
    statuses = _execute_statuses(r)
    door = RosDoor(NODE, context=ros_context)

    def picking() -> bool:
        return wait_for(lambda: len(r.servers.manip.goals) == 1)

    async def run():
        async with Client(build_server(door, door), mode="legacy") as client:
            if how == "cancel":
                async with anyio.create_task_group() as tg:
                    tg.start_soon(client.call_tool, "execute", {"plan": PLAN})
                    assert await anyio.to_thread.run_sync(picking)
                    tg.cancel_scope.cancel()
            else:
                # the pick is out within milliseconds of the call: 3 s only bounds a slow host
                with pytest.raises(MCPError, match="timed out"):
                    await client.call_tool("execute", {"plan": PLAN}, read_timeout_seconds=3)
                assert r.servers.manip.goals, "the pick was not sent before the host's timeout"
            # while the session is open: the host's cancel notification did it, not its exit
            assert await anyio.to_thread.run_sync(
                lambda: wait_for(lambda: r.servers.manip.cancels == 1))
            assert await anyio.to_thread.run_sync(lambda: wait_for(lambda: _ended_canceled(
                statuses)))
            return await client.call_tool("skills", {})

    try:
        skills = asyncio.run(asyncio.wait_for(run(), 300))
    finally:
        door.close()
    assert not skills.is_error, skills
    assert (len(r.servers.nav.goals), len(r.servers.manip.goals), r.sent()) == (1, 1, 2)


def test_execute_timeout_cancels_a_hanging_run_with_a_tool_error(robot, ros_context):
    from flash_planner.ros.mcp_door import RosDoor
    from flash_planner.server.mcp_server import build_server

    r = robot()
    r.servers.manip.script = ["hang"]
    statuses = _execute_statuses(r)
    door = RosDoor(NODE, context=ros_context, execute_timeout_s=2)   # the pick is out in ms
    try:
        ran = _call(build_server(door, door), "execute", {"plan": PLAN})
    finally:
        door.close()
    assert ran.is_error, ran
    assert "no result within 2 s (--execute-timeout), so the run was cancelled: " in _text(ran)
    assert "step 1 (pick), canceled" in _text(ran), ran
    assert r.servers.manip.cancels == 1 and r.sent() == 2
    assert wait_for(lambda: _ended_canceled(statuses))


def test_a_refused_run_is_the_tools_error_and_a_good_one_its_result(robot, ros_context):
    from flash_planner.ros.mcp_door import RosDoor
    from flash_planner.server.mcp_server import build_server

    r = robot()
    door = RosDoor(NODE, context=ros_context)
    app = build_server(door, door)
    try:
        refused = _call(app, "execute", {"plan": [PLAN[0], {"skill": "close",
                                                            "args": {"object": "fridge"}}]})
        ran = _call(app, "execute", {"plan": [{"skill": "say", "args": {"text": "hi"}}]})
    finally:
        door.close()
    assert refused.is_error, refused
    assert "step 1 (close): the skill has no binding" in _text(refused)
    assert "(step 1 (close), gate, 0 steps done)" in _text(refused)
    assert not ran.is_error, ran
    result = json.loads(_text(ran))
    assert (result["success"], result["steps_done"]) == (True, 1)
    assert r.servers.speech.goals == [{"text": "hi"}] and r.sent() == 1


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_a_bad_execute_timeout_is_a_usage_error_naming_it(capsys, value):
    from flash_planner.ros.mcp_door import main

    assert main(["--execute", "--execute-timeout", value]) == 2
    assert "--execute-timeout must be a positive number of seconds" in capsys.readouterr().err
