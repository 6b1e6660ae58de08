"""`flash-planner mcp --ros-node` (ros/mcp_door.py): the MCP server's tools reach a running
planner node through its own actions. `plan` is a goal of ~/plan (the node's queue and
grammar) and comes back as /v1/plans answers; `execute` is offered only when asked for and
goes through ~/execute, whose gate refuses what the catalog does not bind."""

from __future__ import annotations

import asyncio
import json

import pytest
from live import NODE, requires_ros, wait_for

from flash_planner.planning.parse import validate_plan
from flash_planner.planning.presets import default_skills_path
from flash_planner.planning.skills import SkillCatalog

pytestmark = requires_ros
TASK = "bring the red cup from the kitchen table to the sink"


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
        assert asyncio.run(names(build_server(door, door))) == {"plan", "skills", "execute"}
        # the default catalog binds no skill to a server: the node's gate refuses the run
        ran = door.execute(TASK, [], dry_run=True)
        assert not ran["success"] and ran["error"], ran
        with pytest.raises(ValueError, match="a task or a plan"):
            door.execute("  ", [], False)
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
