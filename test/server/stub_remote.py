"""A remote that misbehaves on purpose, on loopback: the ways an OpenAI-compatible server
fails a streamed chat completion (the remote backend must fall back on each).

Modes: `error` (HTTP 500 with an OpenAI error body), `stall` (headers and one event, then
silence), `slow` (one event every `period` seconds, forever), `cut` (two events, then the
connection closes without [DONE]), `invalid` (a complete stream whose plan names a skill the
catalog lacks), `valid` (a complete stream with a valid plan and a thought as
reasoning_content). Every request is counted in `requests`.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

VALID_PLAN = {"plan": [{"skill": "navigate_to", "args": {"target": "sink"}},
                       {"skill": "say", "args": {"text": "done"}}]}


def _event(delta: dict) -> bytes:
    body = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "stub",
            "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
    return f"data: {json.dumps(body)}\n\n".encode()


class StubRemote:
    def __init__(self, mode: str, period: float = 0.2):
        self.mode, self.period, self.requests = mode, period, []
        self.stop = threading.Event()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", 0))
                stub.requests.append(json.loads(self.rfile.read(length)))
                stub.answer(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()

    def answer(self, h) -> None:
        if self.mode == "error":
            body = json.dumps({"error": {"message": "boom", "type": "server_error",
                                         "param": None, "code": None}}).encode()
            h.send_response(500)
            h.send_header("Content-Type", "application/json")
            h.send_header("Content-Length", str(len(body)))
            h.end_headers()
            h.wfile.write(body)
            return
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Connection", "close")
        h.end_headers()
        write = h.wfile.write
        try:
            write(_event({"role": "assistant", "content": ""}))
            h.wfile.flush()
            if self.mode == "stall":
                self.stop.wait(60)
            elif self.mode == "slow":
                while not self.stop.wait(self.period):
                    write(_event({"reasoning_content": "hmm "}))
                    h.wfile.flush()
            elif self.mode == "cut":
                write(_event({"content": '{"plan": [{"skill": "navigate_to", '}))
                h.wfile.flush()
            else:
                plan = VALID_PLAN if self.mode == "valid" else {
                    "plan": [{"skill": "fly", "args": {"to": "moon"}}]}
                write(_event({"reasoning_content": "Go to the sink, then say so."}))
                text = json.dumps(plan)
                for at in range(0, len(text), 16):
                    write(_event({"content": text[at:at + 16]}))
                    time.sleep(0.001)
                write(b"data: [DONE]\n\n")
            h.wfile.flush()
        except OSError:          # the client went away
            pass
