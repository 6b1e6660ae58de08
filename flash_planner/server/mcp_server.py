"""`flash-planner mcp`: the planner as an MCP server (the official `mcp` SDK), over stdio or
streamable HTTP, for agents on and off the robot.

It adds no model of its own: every tool calls a planner that is already running, the same
service every other door reaches: `flash-planner mcp --url` a `flash-planner serve` (its /v1/plans,
/v1/skills, /health and /metrics: `HttpDoor`), or `planner_mcp --node` a running planner node
(its ~/plan action: ros/mcp_door.py), whose `~/execute` action runs plans with `--execute`
(its safety gate, approvals and limits included: this server never sends a goal to a skill's
server itself). Tools: `plan` (task, optional scene, context and images -> the validated plan
and its telemetry), `skills` (the catalog as OpenAI tools) and, with `--execute`, `execute`.
Resources: the planner's health and metrics.

A door's refusal (a 4xx with its message, a busy queue, a refused or failed execution) comes
back as the tool's error with that message; the MCP session goes on. `execute` runs on the
event loop, so a host's cancel or timeout of the call cancels the run on the node.
"""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from typing import Any

INSTRUCTIONS = ("flash_planner plans robot tasks into validated JSON plans of the robot's "
                "skills. Call `skills` to see what the robot can do, `plan` with a task in "
                "plain language (and the scene's object names when known) to get a plan.")


class DoorError(RuntimeError):
    """The planner refused or could not be reached; the message says why."""


class HttpDoor:
    """A running `flash-planner serve`."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 300.0):
        self.url, self.api_key, self.timeout = url.rstrip("/"), api_key, timeout

    def _call(self, path: str, body: Any = None, text: bool = False) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data,
                                         method="GET" if data is None else "POST")
        request.add_header("Content-Type", "application/json")
        if self.api_key:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as answer:
                raw = answer.read().decode()
        except urllib.error.HTTPError as exc:
            raise DoorError(f"the planner answered {exc.code}: {_message(exc.read())}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise DoorError(f"the planner at {self.url} cannot be reached: "
                            f"{getattr(exc, 'reason', exc)}") from None
        return raw if text else json.loads(raw)

    def plan(self, request: dict[str, Any]) -> dict[str, Any]:
        return self._call("/v1/plans", request)

    def skills(self, scene: list[str]) -> list[dict[str, Any]]:
        query = "&".join("scene=" + urllib.request.quote(s) for s in scene)
        return self._call("/v1/skills" + (f"?{query}" if query else ""))["data"]

    def health(self) -> str:
        try:
            return self._call("/health", text=True)
        except DoorError as exc:          # a loading model answers 503 with its state
            return str(exc)

    def metrics(self) -> str:
        return self._call("/metrics", text=True)


def _message(raw: bytes) -> str:
    try:
        error = json.loads(raw)
        return error["error"]["message"] if "error" in error else json.dumps(error)
    except (ValueError, KeyError, TypeError):
        return raw.decode(errors="replace")[:500]


def build_server(door, executor=None):
    """The MCP server over `door` (HttpDoor or ros/mcp_door.RosDoor: plan, skills, health,
    metrics); `executor` (a RosDoor, whose `execute` is a coroutine) adds `execute`."""
    from mcp.server.mcpserver import MCPServer

    app = MCPServer("flash_planner", instructions=INSTRUCTIONS)

    @app.tool()
    def plan(task: str, scene: list[str] | None = None, context: str = "",
             images: list[str] | None = None) -> dict[str, Any]:
        """Plan a robot task: a validated JSON plan of the robot's skills (or a refusal
        naming why the skills cannot do it), with the planner's latency telemetry. `scene`:
        the names of what the robot sees; `images`: data URLs of camera frames."""
        request: dict[str, Any] = {"task": task}
        if scene:
            request["scene"] = scene
        if context:
            request["context"] = context
        if images:
            request["images"] = images
        return _door(door.plan, request)

    @app.tool()
    def skills(scene: list[str] | None = None) -> dict[str, Any]:
        """The robot's skills as OpenAI function tools (name, description, JSON-schema
        parameters); given `scene`, grounded arguments are limited to its names."""
        return {"tools": _door(door.skills, scene or [])}

    if executor is not None:
        @app.tool()
        async def execute(task: str = "", plan: list[dict[str, Any]] | None = None,
                          dry_run: bool = False) -> dict[str, Any]:
            """Run a task (planned first) or a given plan on the robot through the planner
            node's own execute action: its safety gate, limits and approvals hold; nothing
            runs that fails them. Returns the steps done and the plans run; a refused or
            failed run is an error naming the failed step and why. Cancelling this call (or
            its timeout) cancels the run: the running step stops, nothing after it is sent."""
            # async, not a worker thread as the other tools: the SDK cancels a call by
            # cancelling its task, which a thread would not notice (the robot would go on)
            from mcp.server.mcpserver.exceptions import ToolError

            try:
                return await executor.execute(task, plan or [], dry_run)
            except (DoorError, ValueError) as exc:
                raise ToolError(str(exc)) from None

    @app.resource("flash-planner://health", mime_type="application/json")
    def health() -> str:
        """The planner's /health: loading, ok (queue depth, busy) or error with the reason."""
        return door.health()

    @app.resource("flash-planner://metrics", mime_type="text/plain")
    def metrics() -> str:
        """The planner's Prometheus metrics (latency, tokens per second, acceptance)."""
        return _door(door.metrics, resource=True)

    return app


def _door(call, *args, resource: bool = False):
    """The door's answer; its refusal (or the executor's ValueError) as the SDK's ToolError
    (ResourceError for a resource), whose message reaches the host (any other exception is
    a crash: a generic message)."""
    from mcp.server.mcpserver.exceptions import ResourceError, ToolError

    try:
        return call(*args)
    except (DoorError, ValueError) as exc:
        raise (ResourceError if resource else ToolError)(str(exc)) from None


def add_transport_args(parser: argparse.ArgumentParser) -> None:
    """The transport options (`flash-planner mcp` and ros/mcp_door.py's `planner_mcp`)."""
    parser.add_argument("--transport", choices=["stdio", "http"], default="stdio",
                        help="stdio (an MCP host starts this process) or streamable HTTP "
                        "(default: %(default)s)")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default "
                        "loopback)")
    parser.add_argument("--port", type=int, default=8765, help="HTTP port (default: "
                        "%(default)s); the endpoint is /mcp")


def serve(door, transport: str, host: str, port: int, executor=None) -> None:
    if not 0 < port < 65536:
        raise ValueError(f"--port must be 1 to 65535, got {port}")
    app = build_server(door, executor)
    if transport == "stdio":
        app.run("stdio")
    else:
        app.run("streamable-http", host=host, port=port)
