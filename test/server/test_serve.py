"""`flash-planner serve` over real HTTP on loopback: the demo model in a child process, the
official `openai` client, every error status produced by a real bad request, a disconnect
mid-stream, and a bounded concurrent run where every request is answered or refused."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing

import pytest

KEY = "test-key-123"
TIMEOUT = 300
# A schema that holds a request for a while: the answer's string is long by construction.
LONG = {"type": "object", "required": ["note"], "additionalProperties": False,
        "properties": {"note": {"type": "string", "minLength": 600, "maxLength": 700}}}


def _free_port() -> int:
    with closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(url: str, body=None, key: str | None = KEY, raw: bytes | None = None,
          timeout: float = TIMEOUT) -> tuple[int, dict]:
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET")
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


class Server:
    def __init__(self, *args: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, FLASH_PLANNER_API_KEY=KEY)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "flash_planner.cli", "serve", "--port", str(self.port),
             "--device", "cpu", "--dtype", "fp32", *args],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:          # the socket opens before the model loads
            assert self.proc.poll() is None, self.proc.stdout.read()
            try:
                with closing(socket.create_connection(("127.0.0.1", self.port), 0.2)):
                    break
            except OSError:
                time.sleep(0.02)
        self.early = _http(self.url + "/v1/chat/completions",
                           {"model": "demo", "messages": [{"role": "user", "content": "x"}]})

    def wait_ready(self) -> Server:
        deadline = time.monotonic() + TIMEOUT
        while _http(self.url + "/health")[0] != 200:
            assert self.proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        return self

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(self.url + "/metrics", timeout=TIMEOUT) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " ") or line.startswith(name + "{"):
                    return float(line.rsplit(" ", 1)[1])
        return 0.0

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


@pytest.fixture(scope="module")
def server():
    s = Server("--queue-depth", "1", "--max-body-bytes", "20000", "--max-prompt-chars", "4000",
               "--threads", "1", "--max-batch", "2")
    yield s.wait_ready()
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=TIMEOUT, max_retries=0)


def test_not_ready_while_loading_then_health_and_models(server, client):
    status, body = server.early
    assert status == 503 and body["error"]["code"] == "not_ready", body
    assert "still loading" in body["error"]["message"]
    status, health = _http(server.url + "/health", key=None)
    assert status == 200 and health["status"] == "ok"
    assert health["threads"] == {"intra_op": 1, "inter_op": 1, "why": "engine.threads"}
    assert [m.id for m in client.models.list().data] == ["demo"]


def test_chat_completion_plain_streamed_and_json_schema(client):
    messages = [{"role": "user", "content": "bring the red cup from the kitchen table to "
                                            "the sink"}]
    plain = {"chat_template_kwargs": {"enable_thinking": False}}
    done = client.chat.completions.create(model="demo", messages=messages, max_tokens=24,
                                          temperature=0, extra_body=plain)
    text = done.choices[0].message.content
    assert text and done.choices[0].finish_reason in ("stop", "length")
    assert done.usage.completion_tokens > 0 and done.usage.prompt_tokens > 0
    stream = client.chat.completions.create(model="demo", messages=messages, max_tokens=24,
                                            temperature=0, stream=True, extra_body=plain,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text                       # greedy: the same text either way
    # thinking on: the thought comes as reasoning_content (as vLLM's reasoning parsers send
    # it), in one piece or streamed
    thinking = client.chat.completions.create(model="demo", messages=messages, max_tokens=40,
                                              temperature=0)
    thought = thinking.choices[0].message.reasoning_content
    assert thought and "<think>" not in thought
    parts = list(client.chat.completions.create(model="demo", messages=messages,
                                                max_tokens=40, temperature=0, stream=True))
    assert "".join(getattr(c.choices[0].delta, "reasoning_content", None) or ""
                   for c in parts if c.choices) == thought
    assert chunks[-1].usage.completion_tokens == done.usage.completion_tokens
    schema = {"type": "object", "required": ["skill", "count"], "additionalProperties": False,
              "properties": {"skill": {"enum": ["pick", "place"]},
                             "count": {"type": "integer", "minimum": 1, "maximum": 9}}}
    out = client.chat.completions.create(
        model="demo", messages=messages, max_tokens=256, seed=3, temperature=0.8,
        response_format={"type": "json_schema", "json_schema": {"name": "step",
                                                                "schema": schema}})
    assert out.choices[0].message.reasoning_content       # it thought, then answered
    parsed = json.loads(out.choices[0].message.content)
    assert parsed["skill"] in ("pick", "place") and 1 <= parsed["count"] <= 9


def test_plans_endpoint_plans_and_streams_each_step(server):
    task = {"task": "bring the red cup from the kitchen table to the sink"}
    status, result = _http(server.url + "/v1/plans", task)
    assert status == 200 and result["success"] and result["plan"]
    req = urllib.request.Request(server.url + "/v1/plans", method="POST",
                                 data=json.dumps({**task, "stream": True}).encode(),
                                 headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
        events = [line[6:] for line in r.read().decode().splitlines()
                  if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    steps = [json.loads(e) for e in events[:-2]]
    final = json.loads(events[-2])
    assert [s["step"] for s in steps] == final["plan"] == result["plan"]
    assert [s["index"] for s in steps] == list(range(len(final["plan"])))


def test_a_plan_comes_as_a_behaviortree_cpp_tree_with_format_bt(server):
    """The same plan, also as BT XML that reads back to it; a format we do not write is a
    400 naming it."""
    from flash_planner.planning.bt import from_bt_xml
    from flash_planner.planning.presets import default_skills_path
    from flash_planner.planning.skills import SkillCatalog

    task = {"task": "bring the red cup from the kitchen table to the sink", "format": "bt"}
    status, result = _http(server.url + "/v1/plans", task)
    assert status == 200 and result["success"] and 'BTCPP_format="4"' in result["bt_xml"]
    catalog = SkillCatalog.from_yaml(default_skills_path())
    assert from_bt_xml(result["bt_xml"], catalog) == result["plan"]
    status, error = _http(server.url + "/v1/plans", {**task, "format": "yaml"})
    assert status == 400 and error["error"]["param"] == "format"


@pytest.mark.parametrize("case,status,code_or_type", [
    ("bad_json", 400, "invalid_request_error"),
    ("n2", 400, "invalid_request_error"),
    ("functions", 400, "invalid_request_error"),
    ("top_p", 400, "invalid_request_error"),
    ("no_key", 401, "invalid_api_key"),
    ("model", 404, "model_not_found"),
    ("body", 413, "request_too_large"),
    ("prompt", 413, "context_length_exceeded"),
])
def test_each_error_status_from_a_real_bad_request(server, case, status, code_or_type):
    url = server.url + "/v1/chat/completions"
    ok = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    key, raw, body = KEY, None, ok
    if case == "bad_json":
        raw = b'{"model": "demo", "messages": ['
    elif case == "n2":
        body = {**ok, "n": 2}
    elif case == "functions":
        body = {**ok, "functions": []}        # the legacy form of tools
    elif case == "top_p":
        body = {**ok, "top_p": 1.5}
    elif case == "no_key":
        key = "wrong"
    elif case == "model":
        body = {**ok, "model": "gpt-9"}
    elif case == "body":
        raw = json.dumps({**ok, "messages": [{"role": "user", "content": "x" * 30000}]}
                         ).encode()
    elif case == "prompt":
        body = {**ok, "messages": [{"role": "user", "content": "x" * 5000}]}
    got, answer = _http(url, body, key=key, raw=raw)
    assert got == status, answer
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert code_or_type in (error["code"], error["type"]), error


NOT_TAKEN = "the model's chat template does not take reasoning_effort"


@pytest.mark.parametrize("extra,why", [
    ({"reasoning_effort": "low"}, NOT_TAKEN),
    ({"chat_template_kwargs": {"reasoning_effort": "low"}}, NOT_TAKEN),
    ({"reasoning_effort": "Low"}, "reasoning_effort must be a short lowercase word"),
    ({"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "medium"}},
     "differ: give one"),
])
def test_reasoning_effort_is_refused_naming_it_for_the_demo_template(server, extra, why):
    """reasoning_effort is taken (top level as in OpenAI's API, or among
    chat_template_kwargs) and passed to a chat template that takes it (Qwen3.8's:
    engine/test_qwen38.py); the demo planner's template does not, so a value is a 400
    naming the parameter, never silently dropped; so is a value that is not a short
    lowercase word, or two that differ."""
    body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4, **extra}
    got, answer = _http(server.url + "/v1/chat/completions", body)
    assert got == 400, answer
    error = answer["error"]
    assert error["param"] == "reasoning_effort" and error["type"] == "invalid_request_error"
    assert why in error["message"], error
    got, answer = _http(server.url + "/v1/plans", {"task": "open the fridge",
                                                   "reasoning_effort": "low"})
    assert got == 400 and answer["error"]["param"] == "reasoning_effort", answer
    assert NOT_TAKEN in answer["error"]["message"], answer


def test_reasoning_effort_reaches_a_chat_template_that_takes_it(tmp_path):
    """A tiny model whose template takes reasoning_effort (as Qwen3.8's does; this one is
    ours): either form of the parameter renders into the prompt, and a value the template
    refuses is a 400 with the template's own message."""
    from effort_model import write_effort_checkpoint

    path = write_effort_checkpoint(tmp_path / "effort")
    server = Server("--model", str(path), "--served-model-name", "tiny", "--threads", "1")
    try:
        url = server.wait_ready().url + "/v1/chat/completions"
        body = {"model": "tiny", "messages": [{"role": "user", "content": "open it"}],
                "max_tokens": 2, "temperature": 0}
        got, plain = _http(url, body)
        assert got == 200, plain
        for extra in ({"reasoning_effort": "low"},
                      {"chat_template_kwargs": {"reasoning_effort": "low"}}):
            got, answer = _http(url, {**body, **extra})
            assert got == 200, answer
            assert answer["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]
        got, answer = _http(url, {**body, "reasoning_effort": "high"})
        assert got == 400 and answer["error"]["param"] == "reasoning_effort", answer
        assert "Unexpected reasoning effort high" in answer["error"]["message"], answer
    finally:
        server.stop()


@pytest.mark.parametrize("body,param", [
    ({"task": "open the fridge", "method": "warp"}, "method"),
    ({"task": "open the fridge", "max_new_tokens": 0}, "max_new_tokens"),
    ({"task": "open the fridge", "deadline_s": -1}, "deadline_s"),
    ({"task": "open the fridge", "seed": "x"}, "seed"),
    ({"task": "open the fridge", "sampling": {"temperature": -1}}, "sampling"),
    ({"task": "   "}, "task"),
    ({"task": "open the fridge", "context": "a\x00b"}, "context"),
    ({"task": "open the fridge", "colour": "red"}, "colour"),
    ({"context": "kitchen"}, "task"),
    ({"task": "open the fridge", "scene": "fridge"}, "scene"),
    ({"task": "open the fridge", "scene": ["fridge", ""]}, "scene[1]"),
    ({"task": "open the fridge", "reasoning_effort": "HIGH"}, "reasoning_effort"),
])
def test_a_bad_plan_request_names_its_parameter(server, body, param):
    for stream in (False, True):
        got, answer = _http(server.url + "/v1/plans", {**body, "stream": stream})
        assert got == 400, answer
        error = answer["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", error
        assert param in error["message"], error


def test_a_plan_request_carries_its_scene_list_and_one_too_long_is_a_400(server):
    body = {"task": "bring it to the sink", "scene": ["red cup|cup", "sink"]}
    status, result = _http(server.url + "/v1/plans", body)
    assert status == 200 and (result["success"] or result["error"]), result
    status, answer = _http(server.url + "/v1/plans",
                           {"task": ("pick up the blue box " * 95)[:1900]})
    assert status == 400 and "exceeds max_context" in answer["error"]["message"], answer
    assert "--max-context" in answer["error"]["message"]


def wait_for(predicate, timeout: float = TIMEOUT) -> bool:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


def _long_request(url: str, max_tokens: int = 400) -> int:
    body = {"model": "demo", "messages": [{"role": "user", "content": "write a note"}],
            "max_tokens": max_tokens, "temperature": 0,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "n", "schema": LONG}}}
    return _http(url + "/v1/chat/completions", body)[0]


def test_a_full_queue_answers_429_and_nothing_is_lost(server):
    """Two slots, queue depth 1: two running, one waiting, the rest refused at once. Each
    step waits for the server to say so (/health), not for a time: the refused ones are sent
    while the first two's 900 tokens run, however fast or loaded the machine."""
    def health() -> dict:
        return _http(server.url + "/health")[1]

    with ThreadPoolExecutor(7) as pool:
        running = [pool.submit(_long_request, server.url, 900) for _ in range(2)]
        assert wait_for(lambda: health()["running"] == 2 and health()["queue_depth"] == 0)
        assert health()["max_batch"] == 2
        waiting = pool.submit(_long_request, server.url)
        assert wait_for(lambda: health()["queue_depth"] == 1)
        refused = list(pool.map(lambda _: _long_request(server.url), range(4)))
        first, second = [r.result() for r in running], waiting.result()
    assert (first, second) == ([200, 200], 200), (first, second)
    # nothing lost; a late one is queued only if the first two finished before it came
    assert set(refused) <= {200, 429} and refused.count(429) >= 1, refused


def test_a_disconnect_mid_stream_frees_the_engine(server):
    before = server.metric("flash_planner_generated_tokens_total")
    cancelled = server.metric('flash_planner_finished_requests_total{reason="cancelled"}')
    body = {"model": "demo", "messages": [{"role": "user", "content": "write a note"}],
            "max_tokens": 900, "temperature": 0, "stream": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
                **LONG, "properties": {"note": {"type": "string", "minLength": 2400}}}}}}
    conn = socket.create_connection(("127.0.0.1", server.port), TIMEOUT)
    payload = json.dumps(body).encode()
    conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                 b"Authorization: Bearer " + KEY.encode() + b"\r\n"
                 b"Content-Type: application/json\r\nContent-Length: "
                 + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    received = b""
    while received.count(b"data: ") < 4:          # a few chunks: it is decoding
        received += conn.recv(4096)
    conn.close()
    deadline = time.monotonic() + TIMEOUT
    while server.metric('flash_planner_finished_requests_total{reason="cancelled"}') \
            == cancelled:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    generated = server.metric("flash_planner_generated_tokens_total") - before
    # finishing would take at least ~800 tokens (2400 characters of note); the cancel came
    # within a few cycles of the disconnect
    assert generated < 300, generated
    assert _http(server.url + "/health")[1]["busy"] is False
    assert _long_request(server.url, 40) == 200              # and it serves the next


def test_bounded_concurrent_clients_every_request_answered(server):
    """4 clients x 5 requests, queue depth 1: each gets 200 or 429, none is lost."""
    url = server.url + "/v1/chat/completions"
    body = {"model": "demo", "messages": [{"role": "user", "content": "open the fridge"}],
            "max_tokens": 16, "temperature": 0}

    def client_run(_):
        return [_http(url, body)[0] for _ in range(5)]

    with ThreadPoolExecutor(4) as pool:
        statuses = [s for run in pool.map(client_run, range(4)) for s in run]
    assert len(statuses) == 20 and set(statuses) <= {200, 429}, statuses
    assert statuses.count(200) >= 5


def _unhealthy(path) -> tuple[dict, str]:
    """A server on a model that cannot load: /health's 503 `error` body once it stops
    loading (a request's 503 repeats its reason; the server stays up), and the server's log."""
    server = Server("--model", str(path), "--threads", "1")
    try:
        deadline = time.monotonic() + TIMEOUT
        while (health := _http(server.url + "/health", key=None))[1]["status"] == "loading":
            assert server.proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        status, body = health
        assert status == 503 and body["status"] == "error", body
        status, answer = _http(server.url + "/v1/plans", {"task": "open the fridge"})
        assert status == 503 and answer["error"]["code"] == "not_ready", answer
        assert answer["error"]["message"] == f"the model failed to load: {body['error']}"
        assert server.proc.poll() is None              # still up, answering why
    finally:
        server.stop()
    log = server.proc.stdout.read()
    assert "Traceback" not in log, log
    return body, log


def test_a_model_that_fails_its_warm_up_is_unhealthy_with_the_reason(tmp_path):
    """NaN weights load but cannot decode: /health stays 503 `error` naming the model and
    the cause, a request's 503 says the same, and the log has one line, no traceback."""
    from nan_model import write_nan_demo

    path = write_nan_demo(tmp_path / "nan-demo")
    body, log = _unhealthy(path)
    assert body["error"].startswith(f"warm-up of {path} failed: the model produced "
                                    "non-finite logits (NaN or Inf)"), body
    assert [line for line in log.splitlines() if "warm-up of" in line] == \
        [f"ERROR flash_planner.server.app: loading the model failed: {body['error']}"], log


@pytest.mark.parametrize("how", ["truncated", "lying-header"])
def test_a_damaged_checkpoint_file_is_unhealthy_with_the_file_and_the_cause(tmp_path, how):
    """A model.safetensors cut short, or whose header lies about a tensor's size: /health
    503 `error` with the engine's one line (the file, then the cause), every request's 503
    repeats it, and the log has that line once, no traceback."""
    from damaged import damaged_demo

    path, line = damaged_demo(tmp_path / "target", how)
    body, log = _unhealthy(path)
    assert body["error"].startswith(line), body
    assert [entry for entry in log.splitlines() if str(path) in entry] == \
        [f"ERROR flash_planner.server.app: loading the model failed: {body['error']}"], log
