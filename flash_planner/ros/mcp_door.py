"""`planner_mcp` (`ros2 run flash_planner planner_mcp --node /flash_planner [--execute]`):
the MCP server (server/mcp_server.py) over a running planner node, through this door: `plan`
as a goal of the node's `~/plan` action, `execute` as one of its `~/execute` action, each
waited for and its result as a dict; `skills` from the catalog file the node was given. The
node's queue, gate, limits and approvals decide what runs; this client only asks (the MCP
server never reaches a skill's server itself)."""

from __future__ import annotations

import argparse
import json
import sys
import threading
from typing import Any

from .messages import to_fields

# how long the node's actions may take to appear, and one goal's result at most
SERVER_WAIT_S = 10.0
RESULT_WAIT_S = 3600.0


class RosDoor:
    """An rclpy node of its own, spun in a thread, with ActionClients of NODE/plan and
    NODE/execute; `skills_file`: the catalog the node plans with (for `skills`)."""

    def __init__(self, node_name: str, skills_file: str | None = None, context=None):
        import rclpy
        from diagnostic_msgs.msg import DiagnosticArray
        from rclpy.action import ActionClient
        from rclpy.executors import SingleThreadedExecutor

        from flash_planner_interfaces.action import ExecutePlan, Plan

        from ..planning.presets import default_skills_path
        from ..planning.skills import SkillCatalog

        self.catalog = SkillCatalog.from_yaml(skills_file or default_skills_path())
        self._plan_action, self._action = Plan, ExecutePlan
        self._context = context or rclpy.Context()
        if context is None:
            rclpy.init(context=self._context)
        self._node = rclpy.create_node("flash_planner_mcp", context=self._context)
        base = "/" + node_name.strip("/")
        self.node_name, self.target = base, base + "/execute"
        self._planner = ActionClient(self._node, Plan, base + "/plan")
        # the node's latest /diagnostics entries (its status name starts with its name)
        self._diagnostics: dict[str, dict] = {}
        self._node.create_subscription(DiagnosticArray, "/diagnostics", self._on_diagnostics,
                                       10)
        self._client = ActionClient(self._node, ExecutePlan, self.target)
        self._executor = SingleThreadedExecutor(context=self._context)
        self._executor.add_node(self._node)
        self._spin = threading.Thread(target=self._executor.spin, daemon=True,
                                      name="mcp-door-spin")
        self._spin.start()
        self._owns_context = context is None

    def _result(self, client, name: str, goal):
        """Send `goal`, wait for its result (ValueError naming why there is none)."""
        if not client.wait_for_server(timeout_sec=SERVER_WAIT_S):
            raise ValueError(f"no planner node serves {name} (is the node running and "
                             "active?)")
        done = threading.Event()
        box: dict[str, Any] = {}

        def accepted(future) -> None:
            handle = future.result()
            if not handle.accepted:
                box["refused"] = True
                done.set()
                return
            handle.get_result_async().add_done_callback(
                lambda f: (box.update(result=f.result().result), done.set()))

        client.send_goal_async(goal).add_done_callback(accepted)
        if not done.wait(RESULT_WAIT_S):
            raise ValueError(f"{name} gave no result within {RESULT_WAIT_S:.0f} s")
        if box.get("refused"):
            raise ValueError(f"{name} refused the goal (busy, or the node is not serving)")
        return box["result"]

    def plan(self, request: dict[str, Any]) -> dict[str, Any]:
        """A plan from the node's ~/plan (its queue and grammar), as /v1/plans answers."""
        goal = self._plan_action.Goal(task=request["task"],
                                      context=request.get("context", ""),
                                      scene=list(request.get("scene", [])),
                                      enable_thinking=True)
        if request.get("images"):
            raise ValueError("images reach the node as sensor_msgs/Image on ~/plan: send "
                             "them through `flash-planner serve` (--url) instead")
        r = self._result(self._planner, self.node_name + "/plan", goal)
        telemetry = to_fields(r.telemetry)
        plan = json.loads(r.plan_json)["plan"] if r.plan_json else []
        return {"success": r.success, "plan": plan,
                "error": r.error, "telemetry": telemetry}

    def skills(self, scene: list[str]) -> list[dict[str, Any]]:
        from ..planning.skill_tools import skill_tools

        return skill_tools(self.catalog, scene)

    def _on_diagnostics(self, array) -> None:
        own = self.node_name.strip("/").split("/")[-1]
        for status in array.status:
            if status.name.startswith(own):
                self._diagnostics[status.name] = {
                    "level": int.from_bytes(bytes(status.level), "little"),
                    "message": status.message,
                    "values": {kv.key: kv.value for kv in status.values}}

    def health(self) -> str:
        """Whether the node's ~/plan is served, and its latest /diagnostics entries."""
        ready = self._planner.server_is_ready()
        return json.dumps({"status": "ok" if ready else "unavailable", "node": self.node_name,
                           "diagnostics": dict(self._diagnostics)})

    def metrics(self) -> str:
        """The node's latency and load as its /diagnostics report them (JSON)."""
        return json.dumps(dict(self._diagnostics))

    def execute(self, task: str, plan: list[dict[str, Any]], dry_run: bool) -> dict[str, Any]:
        """Run `plan` (or plan `task` and run it); the node's result as a dict, or a
        ValueError naming why nothing ran."""
        if not task.strip() and not plan:
            raise ValueError("execute needs a task or a plan")
        goal = self._action.Goal(task=task, dry_run=dry_run, max_replans=-1,
                                 plan_json=json.dumps({"plan": plan}) if plan else "")
        r = self._result(self._client, self.target, goal)
        return {"success": r.success, "steps_done": r.steps_done,
                "failed_step": r.failed_step, "failed_skill": r.failed_skill,
                "failed_state": r.failed_state, "error": r.error, "replans": r.replans,
                "plans": json.loads(r.plans_json or "[]")}

    def close(self) -> None:
        self._executor.shutdown()
        self._planner.destroy()
        self._client.destroy()
        self._node.destroy_node()
        if self._owns_context:
            self._context.try_shutdown()


def main(argv: list[str] | None = None) -> int:
    from ..server.mcp_server import add_transport_args, serve

    parser = argparse.ArgumentParser(prog="planner_mcp", description="An MCP server over a "
                                     "running flash_planner node: plan, skills (and execute)")
    parser.add_argument("--node", default="/flash_planner", help="the planner node "
                        "(default: %(default)s)")
    parser.add_argument("--skills", metavar="YAML", help="the catalog the node plans with "
                        "(default: the package's), for the skills tool")
    parser.add_argument("--execute", action="store_true", help="an execute tool that runs "
                        "plans through the node's ~/execute (its safety gate)")
    add_transport_args(parser)
    args = parser.parse_args(argv)
    try:
        door = RosDoor(args.node, args.skills)
    except (ValueError, OSError) as exc:       # a catalog that does not load
        print(f"planner_mcp: error: {exc}", file=sys.stderr)
        return 2
    try:
        serve(door, args.transport, args.host, args.port, door if args.execute else None)
    except ValueError as exc:
        print(f"planner_mcp: error: {exc}", file=sys.stderr)
        return 2
    finally:
        door.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
