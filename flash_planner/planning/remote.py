"""Planning on a remote OpenAI-compatible server: vLLM, SGLang, or another robot's
`flash-planner serve`.

A plan request becomes one streamed chat completion: our prompt (the system prompt with the
skill catalog, then the task), the answer's JSON schema (a plan or a refusal,
`plan_grammar.answer_schema`) as `response_format`, `chat_template_kwargs.enable_thinking`
(and `reasoning_effort` when a request or the planner sets one),
and the request's sampling (the thinking phase's settings when it thinks: one set per
request is all the protocol carries) and seed. The streamed text goes through the caller's
token callback, so the step boundary sends each step as it closes, exactly as for a local
plan; the whole answer is then validated against the catalog by the caller. A thought sent
as `reasoning_content` (vLLM/SGLang reasoning parsers, our server) is put back as the
`<think>` block it was.

Failures are `RemoteError` with a reason: unreachable, an HTTP error status, a stream that
stalls past `read_timeout_s`, the request's deadline, a cancel, or a malformed stream. The
key is read from the environment variable `key_env`, never from a parameter (ROS prints
parameters).
"""

from __future__ import annotations

import http.client
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from ..engine.loop.sampling import Sampling

BACKENDS = ("local", "remote", "remote_or_local")


class RemoteError(RuntimeError):
    """The remote could not give an answer; the message says why."""


@dataclass(frozen=True)
class RemoteConfig:
    url: str                                 # the server's base, e.g. http://host:8000/v1
    model: str                               # the model id it serves
    key_env: str = "FLASH_PLANNER_REMOTE_KEY"
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 30.0             # the longest silence inside a stream

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"remote url must be http(s)://host[:port]/path, got "
                             f"{self.url!r}")
        if not self.model:
            raise ValueError("remote model must name the model the server serves")
        for name in ("connect_timeout_s", "read_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"remote {name} must be positive, got {getattr(self, name)}")


@dataclass
class RemoteHealth:
    """What /diagnostics reports of the remote: the last outcome and its latency."""
    ok: bool | None = None                   # None: never tried
    last_error: str = ""
    last_latency_ms: float = 0.0
    answered: int = 0
    failed: int = 0

    def record(self, ok: bool, latency_ms: float, error: str = "") -> None:
        self.ok, self.last_latency_ms, self.last_error = ok, latency_ms, error
        if ok:
            self.answered += 1
        else:
            self.failed += 1


class RemotePlanner:
    def __init__(self, config: RemoteConfig):
        self.config = config
        self.health = RemoteHealth()

    def body(self, messages: list[dict], schema: dict[str, Any], max_tokens: int,
             thinking: bool, sampling: Sampling | None,
             reasoning_effort: str | None = None) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"enable_thinking": thinking}
        if reasoning_effort is not None:   # a template variable, as vLLM and SGLang pass it
            kwargs["reasoning_effort"] = reasoning_effort
        body: dict[str, Any] = {
            "model": self.config.model, "messages": messages, "stream": True,
            "max_tokens": max_tokens, "temperature": 0.0,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "plan", "schema": schema}},
            "chat_template_kwargs": kwargs}
        if sampling is not None:
            params = sampling.thinking if thinking else sampling.answer
            body.update(temperature=params.temperature, top_p=params.top_p,
                        presence_penalty=params.presence_penalty,
                        frequency_penalty=params.frequency_penalty)
            if params.top_k:
                body["top_k"] = params.top_k
            if params.min_p:
                body["min_p"] = params.min_p
            if sampling.seed is not None:
                body["seed"] = sampling.seed
        return body

    def complete(self, body: dict[str, Any], on_text: Callable[[str], None],
                 deadline: float | None, cancelled: Callable[[], bool]) -> str:
        """Stream one chat completion; returns the whole text (thought included). The
        caller records the outcome in `health` once it has judged the answer."""
        cfg = self.config
        parts = urlsplit(cfg.url)
        kind = http.client.HTTPSConnection if parts.scheme == "https" else \
            http.client.HTTPConnection
        conn = kind(parts.hostname, parts.port, timeout=cfg.connect_timeout_s)
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        key = os.environ.get(cfg.key_env)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        path = parts.path.rstrip("/") + "/chat/completions"
        try:
            try:
                conn.connect()
                sock = conn.sock       # kept: a `Connection: close` response detaches it
                sock.settimeout(self._timeout(deadline))
                conn.request("POST", path, json.dumps(body).encode(), headers)
                response = conn.getresponse()
            except (OSError, http.client.HTTPException) as exc:
                raise RemoteError(f"{cfg.url} unreachable: {exc}") from None
            if response.status != 200:
                detail = response.read(2000).decode("utf-8", "replace")
                raise RemoteError(f"{cfg.url} answered HTTP {response.status}: {detail}")
            return self._read(response, sock, on_text, deadline, cancelled)
        finally:
            conn.close()

    def _timeout(self, deadline: float | None) -> float:
        timeout = self.config.read_timeout_s
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RemoteError("the request's deadline passed before the remote answered")
            timeout = min(timeout, left)
        return timeout

    def _read(self, response, sock, on_text, deadline, cancelled) -> str:
        thought, answer, thinking = [], [], False
        while True:
            if cancelled():
                raise RemoteError("cancelled")
            sock.settimeout(self._timeout(deadline))
            try:
                line = response.readline()
            except TimeoutError:
                if deadline is not None and time.monotonic() >= deadline:
                    raise RemoteError("the request's deadline passed while the remote "
                                      "was answering") from None
                raise RemoteError(f"the remote stalled for {self.config.read_timeout_s} s "
                                  "inside its stream") from None
            except (OSError, http.client.HTTPException) as exc:
                raise RemoteError(f"the remote's stream broke: {exc}") from None
            if not line:
                raise RemoteError("the remote closed its stream before [DONE]")
            line = line.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            try:
                event = json.loads(data)
            except ValueError:
                raise RemoteError(f"the remote sent a malformed event: {data[:200]}") from None
            if "error" in event:
                raise RemoteError(f"the remote failed: {event['error']}")
            choices = event.get("choices") or []
            delta = choices[0].get("delta", {}) if choices else {}
            reasoning, content = delta.get("reasoning_content"), delta.get("content")
            if reasoning:
                if not thinking and not thought:
                    thinking = True
                    reasoning = "<think>\n" + reasoning
                thought.append(reasoning)
                on_text(reasoning)
            if content:
                if thinking:                     # the thought ended: close it as we write it
                    thinking = False
                    content = "\n</think>\n\n" + content
                answer.append(content)
                on_text(content)
        if thinking:
            answer.append("\n</think>\n\n")
        return "".join(thought) + "".join(answer)
