"""An MCP server process stopped by a signal, as `ros2 launch` stops it (Ctrl-C: the
terminal's SIGINT, then launch's own right after it) or a host does (SIGTERM), with a
session open and a tool called through it: it must exit 0 with no traceback. Readiness is
waited for on the server's own answers (a JSON-RPC reply over stdio, the SDK's client over
HTTP), never on time."""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import closing

TIMEOUT = 120.0
INITIALIZE = {"protocolVersion": "2025-06-18", "capabilities": {},
              "clientInfo": {"name": "test", "version": "0"}}


class Server:
    """`python -m MODULE ARGS --transport T [--port P]`; stderr kept in a file (a pipe
    nobody reads could fill and block it), stdout the stdio channel (unbuffered bytes, so
    `select` sees every line)."""

    def __init__(self, module: str, args: list[str], transport: str, port: int):
        self.transport, self.port, self._ids = transport, port, 0
        self._stderr = tempfile.TemporaryFile()
        cmd = [sys.executable, "-m", module, *args, "--transport", transport]
        if transport == "http":
            cmd += ["--port", str(port)]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, bufsize=0, stderr=self._stderr, env=dict(os.environ),
            stdout=subprocess.PIPE if transport == "stdio" else subprocess.DEVNULL)

    def stderr(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")

    def _line(self) -> bytes:
        deadline = time.monotonic() + TIMEOUT
        line = b""
        while not line.endswith(b"\n"):
            ready, _, _ = select.select([self.proc.stdout], [], [], 1.0)
            assert self.proc.poll() is None, self.stderr()
            assert time.monotonic() < deadline, f"no answer on stdout: {self.stderr()}"
            if ready:
                line += self.proc.stdout.read(1)
        return line

    def send(self, method: str, params: dict | None = None, answer: bool = True) -> dict:
        """One JSON-RPC message over stdio; with `answer`, a request and its reply."""
        message = {"jsonrpc": "2.0", "method": method, **({"params": params} if params
                                                         else {})}
        if answer:
            self._ids += 1
            message["id"] = self._ids
        self.proc.stdin.write((json.dumps(message) + "\n").encode())
        while answer:
            reply = json.loads(self._line())
            if reply.get("id") == self._ids:
                return reply
        return {}

    def call_over_stdio(self, tool: str, arguments: dict) -> dict:
        """A host's handshake, then one tool call; its reply."""
        assert "result" in self.send("initialize", INITIALIZE)
        self.send("notifications/initialized", answer=False)
        return self.send("tools/call", {"name": tool, "arguments": arguments})

    def wait_listening(self) -> None:
        deadline = time.monotonic() + TIMEOUT
        while True:
            assert self.proc.poll() is None, self.stderr()
            try:
                with closing(socket.create_connection(("127.0.0.1", self.port), 0.2)):
                    return
            except OSError:
                assert time.monotonic() < deadline, self.stderr()
                time.sleep(0.05)

    def signal(self, sig: int) -> None:
        """`sig`; SIGINT twice, as Ctrl-C under `ros2 launch` delivers it."""
        self.proc.send_signal(sig)
        if sig == signal.SIGINT:
            self.proc.send_signal(sig)

    def wait(self) -> int:
        """The exit code; the input stays open until then, as a host keeps it."""
        try:
            return self.proc.wait(TIMEOUT)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            for stream in (self.proc.stdin, self.proc.stdout):
                if stream is not None:
                    stream.close()


def stop_with_a_session_open(server: Server, tool: str, arguments: dict, sig: int):
    """`tool` called with a session open, then `sig` while it still is; the call's result
    (the JSON-RPC reply over stdio, the SDK's CallToolResult over HTTP) and the exit code."""
    if server.transport == "stdio":
        reply = server.call_over_stdio(tool, arguments)
        server.signal(sig)
        return reply, server.wait()

    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    server.wait_listening()

    async def run():
        async with streamable_http_client(f"http://127.0.0.1:{server.port}/mcp") as streams:
            async with ClientSession(streams[0], streams[1]) as session:
                await session.initialize()
                result = await session.call_tool(tool, arguments)
                server.signal(sig)
                return result, await asyncio.to_thread(server.wait)

    return asyncio.run(asyncio.wait_for(run(), 2 * TIMEOUT))


def assert_clean_exit(server: Server, code: int) -> None:
    err = server.stderr()
    assert code == 0, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
