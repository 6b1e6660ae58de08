"""`flash-planner mcp`: the planner as an MCP server (the official `mcp` SDK), over stdio or
streamable HTTP, for agents on and off the robot.

Its tools reach the planner through a door, each the same service every other door reaches:
`flash-planner mcp --model` loads the planner in this process (`ServiceDoor`, the way
`serve` loads it), `flash-planner mcp --url` calls a `flash-planner serve` (its /v1/plans,
/v1/skills, /health and /metrics: `HttpDoor`), and `planner_mcp --node` a running planner
node (its ~/plan action and ~/skills topic: ros/mcp_door.py), whose `~/execute` action runs
plans with `--execute` (its safety gate, approvals and limits included: this server never
sends a goal to a skill's server itself). Tools: `plan` (task, optional scene, context and
images -> the validated plan and its telemetry; `format="bt"` adds the plan as a
BehaviorTree.CPP v4 tree, `bt_xml`), `skills` (the catalog as OpenAI tools) and, with
`--execute`, `execute`. Resources: the planner's health (JSON, always) and metrics (the
door's `METRICS_MIME`).

A refusal (a rejected request, a busy queue, a plan that failed, a refused or failed
execution, a planner that cannot be reached) comes back as the tool's error (`isError`) with
its message; the session goes on. The door's blocking calls run in worker threads the server
abandons when the call is cancelled (the door's `close` ends them); `execute` runs on the
event loop, so a host's cancel or timeout of the call cancels the run on the node. SIGINT
and SIGTERM end the server as a host closing stdio does: the door is closed and the process
exits 0.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import signal
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

INSTRUCTIONS = ("flash_planner plans robot tasks into validated JSON plans of the robot's "
                "skills. Call `skills` to see what the robot can do, `plan` with a task in "
                "plain language (and the scene's object names when known) to get a plan.")
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
HEALTH_TIMEOUT_S = 5.0
# how long open HTTP sessions may hold the server once a signal asked it to stop
HTTP_GRACE_S = 3
# the `plan` tool's answers: the plan as JSON, or that and the plan as a BehaviorTree.CPP v4
# tree (`bt_xml`), as /v1/plans's `format` takes them; a door's request carries `format`
# only when it is "bt"
PLAN_FORMATS = ("json", "bt")


class DoorError(RuntimeError):
    """The planner refused or could not be reached; the message says why."""


class HttpRefusal(DoorError):
    """The server answered with an HTTP error: its status and body beside the message."""

    def __init__(self, status: int, body: str):
        super().__init__(f"the planner answered {status}: {_message(body)}")
        self.status, self.body = status, body


class HttpDoor:
    """A running `flash-planner serve`."""

    METRICS_MIME = "text/plain"     # its /metrics: Prometheus text

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 300.0):
        self.url, self.api_key, self.timeout = url.rstrip("/"), api_key, timeout

    def _call(self, path: str, body: Any = None, text: bool = False,
              timeout: float | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data,
                                         method="GET" if data is None else "POST")
        request.add_header("Content-Type", "application/json")
        if self.api_key:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.timeout) as answer:
                raw = answer.read().decode()
        except urllib.error.HTTPError as exc:
            raise HttpRefusal(exc.code, exc.read().decode(errors="replace")) from None
        except (urllib.error.URLError, OSError) as exc:
            raise DoorError(f"the planner at {self.url} cannot be reached: "
                            f"{getattr(exc, 'reason', exc)}") from None
        return raw if text else json.loads(raw)

    def check(self) -> None:
        """DoorError (one line naming the URL and why) unless a planner server answers
        /health: a loading or failed model answers too (503, its state in the body)."""
        try:
            body = json.loads(self._health_text())
        except ValueError:
            body = None
        if not isinstance(body, dict) or "status" not in body:
            raise DoorError(f"{self.url}/health does not answer as `flash-planner serve` "
                            "does (no JSON status)")

    def _health_text(self) -> str:
        try:
            return self._call("/health", text=True, timeout=HEALTH_TIMEOUT_S)
        except HttpRefusal as exc:
            if exc.status == 503:           # loading, or failed: the body says which
                return exc.body
            raise

    def plan(self, request: dict[str, Any]) -> dict[str, Any]:
        """/v1/plans's answer: its `format` ("bt": `bt_xml` beside the plan) is the
        request's."""
        return self._call("/v1/plans", request)

    def skills(self, scene: list[str]) -> list[dict[str, Any]]:
        query = "&".join("scene=" + urllib.request.quote(s) for s in scene)
        return self._call("/v1/skills" + (f"?{query}" if query else ""))["data"]

    def health(self) -> str:
        """/health's JSON; a server that cannot be reached, or does not answer JSON, as
        {"status": "error", "url", "error"}: the resource is JSON whatever happens."""
        try:
            text = self._health_text()
            json.loads(text)
            return text
        except ValueError:
            error = f"{self.url}/health did not answer JSON"
        except DoorError as exc:
            error = str(exc)
        return json.dumps({"status": "error", "url": self.url, "error": error})

    def metrics(self) -> str:
        return self._call("/metrics", text=True)


def _message(raw: str) -> str:
    try:
        error = json.loads(raw)
        return error["error"]["message"] if "error" in error else json.dumps(error)
    except (ValueError, KeyError, TypeError):
        return raw[:500]


class ServiceDoor:
    """The planner in this process (`flash-planner mcp --model`). `load` returns the started
    PlannerService; it runs in a thread of its own from `start` (the server's startup), so
    a host's handshake is answered while a large model loads: health says `loading`, and a
    plan waits for the load (or gets its failure as the tool's error)."""

    METRICS_MIME = "application/json"

    def __init__(self, load: Callable[[], Any], model: str,
                 progress: Callable[[str], None] | None = None):
        self._load, self.model, self._progress = load, model, progress or _to_stderr
        self._loaded = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._service, self._error, self._closed = None, "", False
        self._counts = {"ok": 0, "failed": 0, "rejected": 0, "new_tokens": 0}

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                # not a daemon: a process ending mid-load exits at once (`_exit_if_held`)
                # rather than finalize the interpreter under torch's load, which aborts
                self._thread = threading.Thread(target=self._run_load, name="mcp-model-load")
                self._thread.start()

    def _run_load(self) -> None:
        try:
            service = self._load()
        except Exception as exc:   # the load's own message is the story (as `serve` says it)
            self._error = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            self._progress(f"loading the model failed: {self._error}")
        else:
            with self._lock:
                closed, self._service = self._closed, service
            if closed:                       # closed while it loaded
                service.stop(reason="the MCP server is shutting down")
        self._loaded.set()

    def _ready(self):
        self.start()
        self._loaded.wait()
        if self._service is None or self._closed:
            raise DoorError(f"the planner is not serving: {self._error or 'shutting down'}")
        return self._service

    def plan(self, request: dict[str, Any]) -> dict[str, Any]:
        """The service's result as /v1/plans answers it, `format` "bt" included."""
        from ..planning.bt import to_bt_xml
        from ..planning.request import PlanRequest, RequestError

        service = self._ready()
        request = dict(request)
        bt = request.pop("format", "json") == "bt"
        try:
            result = service.plan(PlanRequest.from_dict(request))
        except RequestError as exc:
            raise DoorError(str(exc)) from None
        with self._lock:
            self._counts["ok" if result.success else
                         "rejected" if result.rejected else "failed"] += 1
            self._counts["new_tokens"] += int(result.telemetry.get("new_tokens", 0))
        answer = result.as_dict()
        if bt and result.success:
            answer["bt_xml"] = to_bt_xml(result.plan, service.catalog)
        return answer

    def skills(self, scene: list[str]) -> list[dict[str, Any]]:
        from ..planning.skill_tools import skill_tools

        return skill_tools(self._ready().catalog, scene)

    def health(self) -> str:
        """As `serve`'s /health: loading, ok (queue depth, busy) or error with the reason."""
        service = self._service
        if service is None:
            state = {"status": "error", "error": self._error} if self._error else \
                {"status": "loading"}
            return json.dumps({**state, "model": self.model})
        load = service.load_report()
        return json.dumps({"status": "ok", "model": self.model, "queue_depth": load["queued"],
                           "busy": load["running"] > 0, "running": load["running"],
                           "max_batch": load["max_batch"]})

    def metrics(self) -> str:
        """This process's requests (ok, failed, rejected), tokens and the queue (JSON)."""
        service = self._service
        with self._lock:
            counts = dict(self._counts)
        return json.dumps({"requests": {k: counts[k] for k in ("ok", "failed", "rejected")},
                           "generated_tokens": counts["new_tokens"],
                           "load": service.load_report() if service is not None else None})

    def close(self) -> None:
        with self._lock:
            self._closed, service = True, self._service
        self._error = self._error or "the MCP server is shutting down"
        if service is not None:    # ends a plan still waiting: its caller was abandoned
            service.stop(reason="the MCP server is shutting down")
        self._loaded.set()


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def build_server(door, executor=None):
    """The MCP server over `door` (HttpDoor, ServiceDoor or ros/mcp_door.RosDoor: plan,
    skills, health, metrics, METRICS_MIME; `start`, if it has one, runs at the server's
    startup); `executor` (a RosDoor, whose `execute` is a coroutine) adds `execute`."""
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError

    @asynccontextmanager
    async def lifespan(_app):
        # here, not before: over stdio the SDK has moved fd 1 off the wire by now, so
        # nothing a loading model prints reaches the host as a message
        getattr(door, "start", lambda: None)()
        yield {}

    app = MCPServer("flash_planner", instructions=INSTRUCTIONS, lifespan=lifespan)

    @app.tool()
    async def plan(task: str, scene: list[str] | None = None, context: str = "",
                   images: list[str] | None = None, format: str = "json") -> dict[str, Any]:
        """Plan a robot task: a validated JSON plan of the robot's skills, with the
        planner's latency telemetry; a task the skills cannot do, or a request the planner
        refuses, is the tool's error naming why. `scene`: the names of what the robot sees;
        `images`: data URLs of camera frames; `format`: "json" (the default) or "bt", which
        adds the plan as a BehaviorTree.CPP v4 XML tree (`bt_xml`, with the TreeNodesModel of
        its skills: what Nav2's bt_navigator runs and Groot2 opens)."""
        if format not in PLAN_FORMATS:
            raise ToolError("invalid request: format must be json or bt (the plan also as a "
                            f"BehaviorTree.CPP v4 tree), got {format!r}")
        request: dict[str, Any] = {"task": task}
        if scene:
            request["scene"] = scene
        if context:
            request["context"] = context
        if images:
            request["images"] = images
        if format != "json":
            request["format"] = format
        result = await _in_thread(door.plan, request)
        if not result.get("success", False):
            raise ToolError(result.get("error") or "the planner returned no plan")
        return result

    @app.tool()
    async def skills(scene: list[str] | None = None) -> dict[str, Any]:
        """The robot's skills as OpenAI function tools (name, description, JSON-schema
        parameters); given `scene`, grounded arguments are limited to its names."""
        return {"tools": await _in_thread(door.skills, scene or [])}

    if executor is not None:
        @app.tool()
        async def execute(task: str = "", plan: list[dict[str, Any]] | None = None,
                          dry_run: bool = False) -> dict[str, Any]:
            """Run a task (planned first) or a given plan on the robot through the planner
            node's own execute action: its safety gate, limits and approvals hold; nothing
            runs that fails them. Returns the steps done and the plans run; a refused or
            failed run is an error naming the failed step and why. Cancelling this call (or
            its timeout) cancels the run: the running step stops, nothing after it is sent."""
            # on the loop, not in a worker thread as the other tools: the SDK cancels a call
            # by cancelling its task, which a thread would not notice (the robot would go on)
            try:
                return await executor.execute(task, plan or [], dry_run)
            except (DoorError, ValueError) as exc:
                raise ToolError(str(exc)) from None

    @app.resource("flash-planner://health", mime_type="application/json")
    async def health() -> str:
        """The planner's health (JSON): loading, ok (queue depth, busy) or error with the
        reason, also when the planner cannot be reached."""
        return await _in_thread(door.health)

    @app.resource("flash-planner://metrics", mime_type=door.METRICS_MIME)
    async def metrics() -> str:
        """The planner's metrics (latency, tokens per second, acceptance): Prometheus text
        from `serve`, JSON from a planner in this process or a node."""
        return await _in_thread(door.metrics, resource=True)

    return app


async def _in_thread(call, *args, resource: bool = False):
    """The door's answer, from a worker thread that a cancelled call abandons (the door's
    close ends it); its refusal (or a ValueError) as the SDK's ToolError (ResourceError for
    a resource), whose message reaches the host (any other exception is a crash: a generic
    message)."""
    import anyio
    from mcp.server.mcpserver.exceptions import ResourceError, ToolError

    try:
        return await anyio.to_thread.run_sync(functools.partial(call, *args),
                                              abandon_on_cancel=True)
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


def check_port(port: int) -> None:
    if not 0 < port < 65536:
        raise ValueError(f"--port must be 1 to 65535, got {port}")


def serve(door, transport: str, host: str, port: int, executor=None) -> None:
    """Serve until the host closes stdio, or SIGINT or SIGTERM, then close `door` (its
    `close`, if it has one): a signal is a normal end, no traceback. The first signal stops
    the transport as it stops by itself (stdio: the end of its input; HTTP: uvicorn's
    graceful stop, bounded); later ones change nothing, so a second one (`ros2 launch` sends
    its SIGINT after the terminal's Ctrl-C) cannot break into the stop or the close. The
    process's last call: it returns, or exits 0 itself (`_exit_if_held`)."""
    import anyio

    check_port(port)
    app = build_server(door, executor)
    stop = _Stop()
    if transport == "stdio":
        try:
            stop.on_signal(_StdinRelay().close)
        except OSError:                # no stdin at all: no input to end either
            pass
    for sig in STOP_SIGNALS:
        signal.signal(sig, stop)
    try:
        anyio.run(_serve_stdio if transport == "stdio" else _serve_http, app, host, port,
                  stop)
    finally:
        getattr(door, "close", lambda: None)()
        # the process ends with this call: a signal while it does must change nothing, and
        # the interpreter's finalization resets a Python handler (not SIG_IGN) to the
        # default, which a late second SIGINT would die of (exit -2)
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
    _exit_if_held()


def _exit_if_held() -> None:
    """Exit now (0) if a thread that the stopped server left still runs: a call abandoned
    in a door's read, a model still loading. The interpreter's exit would wait for it (it
    joins every thread that is not a daemon), or, for a daemon inside torch, abort."""
    held = [t for t in threading.enumerate()
            if t is not threading.current_thread() and t.is_alive() and not t.daemon]
    if held:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


class _Stop:
    """The handler of SIGINT and SIGTERM: the first runs every stop registered (at once for
    one registered after it); the handler runs in the main thread, between two steps of
    the event loop, so a stop only sets a flag, closes a descriptor or schedules a call."""

    def __init__(self):
        self.signalled = False
        self._stops: list[Callable[[], None]] = []

    def on_signal(self, stop: Callable[[], None]) -> None:
        self._stops.append(stop)
        if self.signalled:
            stop()

    def __call__(self, signum, frame) -> None:
        if not self.signalled:
            self.signalled = True
            for stop in self._stops:
                stop()


class _StdinRelay:
    """fd 0 as a pipe that a daemon thread feeds from the real stdin, so that a signal ends
    the stdio server as a host does, by closing its input: the SDK reads stdin in a worker
    thread that no cancel reaches (the server would wait on it, and so would the exit)."""

    def __init__(self):
        self._source = os.dup(0)       # never closed: a read of it may be under way
        read, self._write = os.pipe()
        os.dup2(read, 0)
        os.close(read)
        threading.Thread(target=self._copy, daemon=True, name="mcp-stdin").start()

    def _copy(self) -> None:
        while True:
            try:
                data = memoryview(os.read(self._source, 1 << 16))
            except OSError:
                data = memoryview(b"")
            if not data:               # the host closed stdin
                self.close()
                return
            try:
                while data:
                    data = data[os.write(self._write, data):]
            except OSError:            # nobody reads the pipe any more
                return

    def close(self) -> None:
        """End of input for the server: the pipe's write end becomes /dev/null, its number
        kept, so a write still under way never lands in a descriptor opened since."""
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, self._write)
        os.close(null)


async def _serve_stdio(app, host: str, port: int, stop: _Stop) -> None:
    import asyncio

    import anyio

    loop = asyncio.get_running_loop()
    with anyio.CancelScope() as scope:
        # the end of input ends the session; the cancel ends the calls still running
        stop.on_signal(lambda: _soon(loop, scope.cancel))
        await app.run_stdio_async()


def _soon(loop, call: Callable[[], None]) -> None:
    try:
        loop.call_soon_threadsafe(call)
    except RuntimeError:               # the loop has closed: nothing left to stop
        pass


async def _serve_http(app, host: str, port: int, stop: _Stop) -> None:
    """The SDK's streamable HTTP app on uvicorn, as `MCPServer.run` serves it, but with the
    signals left to `_Stop`: uvicorn's own take a second SIGINT for a forced stop, which
    cuts its lifespan short with a traceback. The first signal goes to uvicorn's handler
    once, which sse-starlette (the event streams of open sessions) hooks to end its
    streams; the graceful stop is bounded all the same."""
    import contextlib

    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            yield

    server = Server(uvicorn.Config(app.streamable_http_app(host=host), host=host, port=port,
                                   log_level=app.settings.log_level.lower(),
                                   timeout_graceful_shutdown=HTTP_GRACE_S))
    # SIGTERM: the one uvicorn never takes for its forced stop
    stop.on_signal(lambda: server.handle_exit(signal.SIGTERM, None))
    await server.serve()
