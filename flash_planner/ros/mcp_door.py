"""`planner_mcp` (`ros2 run flash_planner planner_mcp --node /flash_planner [--execute]`):
the MCP server (server/mcp_server.py) over a running planner node, through this door: `plan`
as a goal of the node's `~/plan` action (`format` "bt": its result's `bt_xml` too),
`execute` as one of its `~/execute` action, each waited for and its result as a dict (a
plan that failed is the tool's error); `skills` from the catalog the node publishes on
`~/skills` (skills_topic.py). The node's queue, gate, limits and approvals decide what runs;
this client only asks (the MCP server never reaches a skill's server itself).

`execute` is a coroutine on the MCP server's event loop: a host's cancel or timeout of the
call cancels the ExecutePlan goal on the node (whose running step's goal is then cancelled
on its server), and so does `--execute-timeout`; a refusal or a failed run is a DoorError
(the tool's error) with the node's reason."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import threading
import time
from typing import Any

from ..server.mcp_server import DoorError
from .messages import to_fields
from .skills_topic import catalog_of, latched_qos

# how long the node's actions may take to appear, and one goal's result at most
SERVER_WAIT_S = 10.0
RESULT_WAIT_S = 3600.0
# one execution's result at most (--execute-timeout): past it the run is cancelled
EXECUTE_WAIT_S = 600.0
# how long the node may take to accept a cancel (and, after a timeout, to end the run)
CANCEL_WAIT_S = 10.0
# the door's spin loop ends within one of its 0.1 s waits; this bounds close()'s join
SPIN_STOP_S = 5.0


class RosDoor:
    """An rclpy node of its own, spun in a thread, with ActionClients of NODE/plan and
    NODE/execute and a subscription of NODE/skills; `skills_file`: a catalog for `skills`
    while the node publishes none (a node older than ~/skills); `execute_timeout_s`: how
    long `execute` waits for a run before cancelling it."""

    METRICS_MIME = "application/json"    # the node's /diagnostics entries

    def __init__(self, node_name: str, skills_file: str | None = None, context=None,
                 execute_timeout_s: float = EXECUTE_WAIT_S):
        # checked before rclpy starts, so a bad value leaves nothing to shut down
        if not (math.isfinite(execute_timeout_s) and execute_timeout_s > 0):
            raise ValueError("--execute-timeout must be a positive number of seconds, got "
                             f"{execute_timeout_s}")
        self.execute_timeout_s = execute_timeout_s
        import rclpy
        from diagnostic_msgs.msg import DiagnosticArray
        from rclpy.action import ActionClient
        from rclpy.executors import SingleThreadedExecutor
        from std_msgs.msg import String

        from flash_planner_interfaces.action import ExecutePlan, Plan

        from ..planning.skills import SkillCatalog

        self._fallback = SkillCatalog.from_yaml(skills_file) if skills_file else None
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
        self._catalog: SkillCatalog | None = None    # the node's, as it loaded it
        self._catalog_seen = threading.Event()
        self._started = time.monotonic()
        self._node.create_subscription(String, base + "/skills", self._on_skills,
                                       latched_qos())
        # goals waited for: close() wakes them, so no thread waits on a node gone away
        self._waiting: set[threading.Event] = set()
        self._closing = False
        self._executor = SingleThreadedExecutor(context=self._context)
        self._executor.add_node(self._node)
        self._spin = threading.Thread(target=self._spin_until_closed, daemon=True,
                                      name="mcp-door-spin")
        self._spin.start()
        self._owns_context = context is None

    def _spin_until_closed(self) -> None:
        # our own loop, not executor.spin(): close() ends it and joins the thread before
        # the executor and the node are destroyed (destroyed under a spin, the process was
        # seen to abort at exit: "terminate called without an active exception", 134)
        from rclpy.executors import ExternalShutdownException

        while not self._closing and self._context.ok():
            try:
                self._executor.spin_once(timeout_sec=0.1)
            except ExternalShutdownException:      # the context was shut down under us
                return

    def _result(self, client, name: str, goal):
        """Send `goal`, wait for its result (ValueError naming why there is none)."""
        if not client.wait_for_server(timeout_sec=SERVER_WAIT_S):
            raise ValueError(f"no planner node serves {name} (is the node running and "
                             "active?)")
        done = threading.Event()
        box: dict[str, Any] = {}
        self._waiting.add(done)

        def accepted(future) -> None:
            handle = future.result()
            if not handle.accepted:
                box["refused"] = True
                done.set()
                return
            handle.get_result_async().add_done_callback(
                lambda f: (box.update(result=f.result().result), done.set()))

        client.send_goal_async(goal).add_done_callback(accepted)
        try:
            if not done.wait(RESULT_WAIT_S):
                raise ValueError(f"{name} gave no result within {RESULT_WAIT_S:.0f} s")
        finally:
            self._waiting.discard(done)
        if self._closing and not box:
            raise ValueError("the MCP server is shutting down")
        if box.get("refused"):
            raise ValueError(f"{name} refused the goal (busy, or the node is not serving)")
        return box["result"]

    def plan(self, request: dict[str, Any]) -> dict[str, Any]:
        """A plan from the node's ~/plan (its queue and grammar), as /v1/plans answers;
        `format` "bt" adds the result's `bt_xml` (the tree the node wrote with its catalog)."""
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
        answer = {"success": r.success, "plan": plan, "error": r.error, "telemetry": telemetry}
        if request.get("format") == "bt" and r.success:
            answer["bt_xml"] = r.bt_xml
        return answer

    def _on_skills(self, msg) -> None:
        try:
            self._catalog = catalog_of(msg.data)
        except ValueError as exc:
            self._node.get_logger().error(f"{self.node_name}/skills not read: {exc}")
            return
        self._catalog_seen.set()

    def skills(self, scene: list[str]) -> list[dict[str, Any]]:
        """The node's catalog as OpenAI tools (`--skills` while the node publishes none)."""
        from ..planning.skill_tools import skill_tools

        # a latched message arrives once the node is discovered: waited for only that long
        self._catalog_seen.wait(max(0.0, self._started + SERVER_WAIT_S - time.monotonic()))
        if self._catalog is not None:
            return skill_tools(self._catalog, scene)
        if self._fallback is not None:
            return skill_tools(self._fallback, scene)
        raise ValueError(f"no catalog on {self.node_name}/skills (is the node running and "
                         "configured?)")

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

    async def execute(self, task: str, plan: list[dict[str, Any]], dry_run: bool
                      ) -> dict[str, Any]:
        """Run `plan` (or plan `task` and run it) through the node's ~/execute; its successful
        result as a dict. Waits on the running event loop, never blocking it: the caller's
        cancellation (the MCP host's cancel or timeout) cancels the goal on the node before
        it propagates, and so does `execute_timeout_s` (a DoorError saying so). A refused
        goal, a missing node or a failed run: DoorError with the reason; ValueError: nothing
        to run."""
        import anyio

        if not task.strip() and not plan:
            raise ValueError("execute needs a task or a plan")
        goal = self._action.Goal(task=task, dry_run=dry_run, max_replans=-1,
                                 plan_json=json.dumps({"plan": plan}) if plan else "")
        with anyio.move_on_after(SERVER_WAIT_S):
            while not self._client.server_is_ready():
                await anyio.sleep(0.05)
        if not self._client.server_is_ready():
            raise DoorError(f"no planner node serves {self.target} (is the node running and "
                            "active?)")
        sent = self._client.send_goal_async(goal)
        try:
            handle = await _settled(sent)
        except BaseException:
            # cancelled before the node answered: a goal it accepts after all is cancelled then
            sent.add_done_callback(_cancel_if_accepted)
            raise
        if not handle.accepted:
            raise DoorError(f"{self.target} refused the goal (the node is not serving)")
        try:
            with anyio.fail_after(self.execute_timeout_s):
                r = (await _settled(handle.get_result_async())).result
        except TimeoutError:
            r = await self._cancel(handle, wait_result=True)
            late = (f"{self.target} gave no result within {self.execute_timeout_s:g} s "
                    "(--execute-timeout)")
            if r is None:
                raise DoorError(f"{late}; its cancel got no answer within {CANCEL_WAIT_S:g} s: "
                                "the run may still go on") from None
            if not r.success:   # else it ended well as the cancel went out
                raise DoorError(f"{late}, so the run was cancelled: {_failure(r)}") from None
        except anyio.get_cancelled_exc_class():
            await self._cancel(handle, wait_result=False)
            raise
        if not r.success:
            raise DoorError(_failure(r))
        return {"success": r.success, "steps_done": r.steps_done,
                "failed_step": r.failed_step, "failed_skill": r.failed_skill,
                "failed_state": r.failed_state, "error": r.error, "replans": r.replans,
                "plans": json.loads(r.plans_json or "[]")}

    async def _cancel(self, handle, wait_result: bool):
        """Cancel the goal of `handle` on the node and wait at most CANCEL_WAIT_S for the node
        to answer (and, with `wait_result`, for the run's result, returned: None without it
        or past the wait), shielded: the caller's own cancellation is what brought us here."""
        import anyio

        result = None
        with anyio.move_on_after(CANCEL_WAIT_S, shield=True) as scope:
            await _settled(handle.cancel_goal_async())
            if wait_result:
                result = (await _settled(handle.get_result_async())).result
        if scope.cancelled_caught:   # the host may have gone: only the log can say it
            self._node.get_logger().warning(
                f"the cancel of an execution on {self.target} got no answer within "
                f"{CANCEL_WAIT_S:g} s: it may still run")
        return result

    def close(self) -> None:
        self._closing = True
        for done in list(self._waiting):
            done.set()
        self._catalog_seen.set()
        self._spin.join(SPIN_STOP_S)
        self._executor.shutdown()
        self._planner.destroy()
        self._client.destroy()
        self._node.destroy_node()
        if self._owns_context:
            self._context.try_shutdown()


async def _settled(future):
    """The result of an rclpy Future, awaited on the running asyncio loop without blocking it
    (the door's executor thread completes the future and hands the result over)."""
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()

    def deliver(done) -> None:
        if waiter.done():         # the awaiting task was cancelled meanwhile
            return
        if done.exception() is not None:
            waiter.set_exception(done.exception())
        else:
            waiter.set_result(done.result())

    def settle(done) -> None:
        try:
            loop.call_soon_threadsafe(deliver, done)
        except RuntimeError:      # the loop has closed: nobody waits for it any more
            pass

    future.add_done_callback(settle)
    return await waiter


def _cancel_if_accepted(sent) -> None:
    if sent.exception() is None and sent.result().accepted:
        sent.result().cancel_goal_async()


def _failure(r) -> str:
    """The tool's error for an ExecutePlan result that is not a success."""
    where = f"step {r.failed_step} ({r.failed_skill}), " if r.failed_step >= 0 else ""
    return (f"the run did not complete ({where}{r.failed_state or 'failed'}, "
            f"{r.steps_done} steps done): {r.error}")


def main(argv: list[str] | None = None) -> int:
    """Exits 0 when the host closes stdio or on SIGINT/SIGTERM (`ros2 launch`'s stop), 2 with
    one line on a bad option."""
    from ..server.mcp_server import add_transport_args, check_port, serve

    parser = argparse.ArgumentParser(prog="planner_mcp", description="An MCP server over a "
                                     "running flash_planner node: plan, skills (and execute)")
    parser.add_argument("--node", default="/flash_planner", help="the planner node "
                        "(default: %(default)s)")
    parser.add_argument("--skills", metavar="YAML", help="the skills tool's catalog while "
                        "the node publishes none on ~/skills (a node older than ~/skills); "
                        "the node's own, once published, always wins")
    parser.add_argument("--execute", action="store_true", help="an execute tool that runs "
                        "plans through the node's ~/execute (its safety gate)")
    parser.add_argument("--execute-timeout", type=float, default=EXECUTE_WAIT_S,
                        metavar="SECONDS", help="how long execute waits for a run before it "
                        "cancels it on the node (default: %(default)g)")
    add_transport_args(parser)
    args = parser.parse_args(argv)
    try:
        check_port(args.port)
        door = RosDoor(args.node, args.skills, execute_timeout_s=args.execute_timeout)
    except (ValueError, OSError) as exc:       # a bad port, a catalog that does not load
        print(f"planner_mcp: error: {exc}", file=sys.stderr)
        return 2
    serve(door, args.transport, args.host, args.port, door if args.execute else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
