"""Images through the planner's front doors (planning/images.py): `plan --image`, the service,
`/v1/plans` and `/v1/chat/completions` (the `openai` client, in-process uvicorn), each
reaching the engine as the same embeddings; bad images refused naming their field while the
service keeps serving; a text-only model refusing naming itself. The ROS doors (a goal's
`sensor_msgs/Image`, the image topic) are tested in test/ros/test_node_images.py."""

from __future__ import annotations

import base64
import io
import json
import socket
import struct
import threading
import time
import urllib.request
import zlib
from contextlib import closing

import numpy as np
import pytest
import torch

from flash_planner.engine.inputs.images import to_patches
from flash_planner.planning.images import ImageLimits, ImageSource, request_images
from flash_planner.planning.presets import default_skills_path
from flash_planner.planning.request import PlanRequest, RequestError
from flash_planner.planning.service import PlannerConfig, PlannerService
from flash_planner.planning.skills import SkillCatalog

TIMEOUT = 120
PIXELS = np.random.default_rng(11).integers(0, 256, (40, 24, 3), dtype=np.uint8)


def _png(pixels: np.ndarray = PIXELS) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height (its pixel data is empty)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(
            ">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2,
                                                             0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


def _data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


@pytest.fixture(scope="module")
def engine(vl_chat_dir, make_engine):
    return make_engine(vl_chat_dir, max_context=1024)


@pytest.fixture(scope="module")
def reference(engine):
    """PIXELS' embeddings, straight from the tower."""
    image = to_patches(PIXELS, engine.vision.image_config)
    with torch.inference_mode():
        return engine.vision.tower(image.patches, [image.grid]).clone()


@pytest.fixture(scope="module")
def service(engine):
    service = PlannerService(engine, SkillCatalog.from_yaml(default_skills_path()),
                             PlannerConfig(max_new_tokens=6, enable_thinking=False))
    service.start()
    yield service
    service.stop()


def _plan(service, images, **kwargs):
    return service.plan(PlanRequest("put the cup left of the plate in the sink",
                                    images=tuple(images), **kwargs), timeout=TIMEOUT)


def test_a_plan_with_an_image_keeps_the_cached_system_prefix_and_reports_its_image(
        service, embedded, reference):
    tokens = to_patches(PIXELS, service.engine.vision.image_config).tokens
    first = _plan(service, [ImageSource(PIXELS, "images[0]")])
    again = _plan(service, [ImageSource(_png(), "images[0]")])
    text = _plan(service, [])
    for result in (first, again):
        assert result.finish_reason == "length", result.error       # it decoded
        t = result.telemetry
        assert (t["images"], t["image_tokens"]) == (1, tokens) and t["vision_ms"] > 0
        assert t["prompt_tokens"] == text.telemetry["prompt_tokens"] + tokens + 2
        # the system prompt with the catalog: one cached prefix for text and image requests
        assert t["prefix_tokens"] == text.telemetry["prefix_tokens"] > 0
    assert again.telemetry["prefix_hit"] is True and text.telemetry["prefix_hit"] is True
    assert again.telemetry["image_cache_hits"] == 1        # the same frame, sent again
    assert "images" not in text.telemetry
    assert embedded and all(torch.equal(e, reference) for e in embedded)


def _free_port() -> int:
    with closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def http(service):
    """`serve`'s app on the module's service, on loopback in this process."""
    import uvicorn

    from flash_planner.server.app import ServerState, create_app

    port = _free_port()
    state = ServerState(model_name="vl")
    server = uvicorn.Server(uvicorn.Config(create_app(state, lambda: service), port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + TIMEOUT
    while state.service is None:
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.02)
    yield url
    server.should_exit = True
    thread.join(10)


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_every_front_door_hands_the_engine_the_same_embeddings(
        service, http, embedded, reference, vl_chat_dir, tmp_path, capsys):
    from openai import OpenAI

    from flash_planner.cli import main

    png = _png()
    file = tmp_path / "frame.png"
    file.write_bytes(png)
    doors = {}

    def door(name, run):
        embedded.clear()
        run()
        doors[name] = list(embedded)

    door("service, RGB pixels (a camera frame)",
         lambda: _plan(service, [ImageSource(PIXELS, "images[0]")]))
    door("service, PNG bytes", lambda: _plan(service, [png]))
    door("/v1/plans, a data URL", lambda: _post(
        http + "/v1/plans", {"task": "put the cup in the sink", "images": [_data_url(png)],
                             "max_new_tokens": 4}))
    client = OpenAI(base_url=http + "/v1", api_key="none", timeout=TIMEOUT, max_retries=0)
    door("/v1/chat/completions, an image_url part", lambda: client.chat.completions.create(
        model="vl", max_tokens=4, temperature=0, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": _data_url(png)}},
            {"type": "text", "text": "what is on the table?"}]}]))
    door("flash-planner plan --image", lambda: main([
        "plan", "put the cup in the sink", "--model", str(vl_chat_dir), "--image", str(file),
        "--device", "cpu", "--dtype", "fp32", "--max-new-tokens", "4", "--no-thinking",
        "--json"]))
    cli = json.loads(capsys.readouterr().out)
    assert cli["telemetry"]["images"] == 1, cli
    for name, seen in doors.items():
        assert seen and all(torch.equal(e, reference) for e in seen), name
    status, plan = _post(http + "/v1/plans", {"task": "go", "images": [_data_url(png)]})
    assert status == 200 and plan["telemetry"]["images"] == 1


@pytest.mark.parametrize("images, field, match", [
    ([_png()[:300]], "images[0]", "images\\[0\\]: not a readable image \\(.*truncated"),
    ([_png_header(0, 0)], "images[0]", "images\\[0\\]: not a readable image"),
    ([_png_header(10000, 10000)], "images[0]",
     "images\\[0\\]: the image is 10000 x 10000 pixels, the limit is 16777216 pixels"),
    ([_png()] * 5, "images", "images: 5 images, the limit is 4 per request"),
    ([PIXELS, "data:image/png;base64,@@@"], "images[1]",
     "images\\[1\\]: the data URL's base64 is malformed"),
    (["data:text/plain;base64,aGk="], "images[0]", "must be data:image/<type>;base64"),
    (["http://127.0.0.1:9/frame.png"], "images[0]", "image URLs are not fetched here"),
    (["frame.png"], "images[0]", "an image must be a data URL"),
    ([np.zeros((4, 4), np.uint8)], "images[0]", "must be uint8 \\[H, W, 3\\]"),
    ([3], "images[0]", "an image must be bytes, a data URL or RGB pixels, got int"),
    ("frame.png", "images", "images must be a list, got str"),
])
def test_a_bad_image_is_refused_naming_its_field_and_the_service_keeps_serving(
        service, images, field, match):
    ticket = service.submit(PlanRequest("put the cup in the sink", images=images))
    result = ticket.result(TIMEOUT)
    assert result.rejected and not result.success
    assert ticket.invalid_field == field
    assert result.error.startswith("invalid request: ")
    import re

    assert re.search(match, result.error), result.error
    assert _plan(service, [PIXELS]).finish_reason == "length"        # still serving


def test_the_byte_limit_and_fetching_urls_only_where_allowed(engine, tmp_path):
    import http.server

    png = _png()
    with pytest.raises(RequestError, match="images\\[0\\]: the image is .* bytes, the limit"):
        request_images([png], engine, ImageLimits(max_bytes=len(png) - 1))
    with pytest.raises(RequestError, match="the image is about .* bytes, the limit"):
        request_images([_data_url(png)], engine, ImageLimits(max_bytes=100))
    (tmp_path / "frame.png").write_bytes(png)

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(tmp_path), **kwargs)

        def log_message(self, *args):
            pass

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}"
        got = request_images([url + "/frame.png"], engine, ImageLimits(allow_urls=True))
        assert torch.equal(got[0].patches,
                           to_patches(PIXELS, engine.vision.image_config).patches)
        with pytest.raises(RequestError, match="fetching .*/missing.png failed"):
            request_images([url + "/missing.png"], engine, ImageLimits(allow_urls=True))
        with pytest.raises(RequestError, match="not fetched here"):
            request_images([url + "/frame.png"], engine, ImageLimits())
        server.shutdown()


def test_the_text_only_demo_refuses_an_image_naming_itself(tmp_path, capsys):
    from flash_planner.cli import main

    file = tmp_path / "frame.png"
    file.write_bytes(_png())
    assert main(["plan", "bring the red cup to the sink", "--image", str(file),
                 "--max-new-tokens", "8"]) == 2
    err = capsys.readouterr().err
    assert "invalid request: images: " in err and "is a text-only model (no vision tower)" \
        in err, err
    assert main(["plan", "go", "--image", str(tmp_path / "missing.png")]) == 2
    assert "--image " in capsys.readouterr().err


def test_a_remote_backend_leaves_images_to_the_local_engine(engine):
    """The remote takes text only: `remote_or_local` plans a request with images here without
    asking it; `remote` alone refuses one naming the field."""
    from flash_planner.planning.remote import RemoteConfig

    remote = RemoteConfig(url=f"http://127.0.0.1:{_free_port()}/v1", model="m",
                          connect_timeout_s=0.2)
    catalog = SkillCatalog.from_yaml(default_skills_path())
    both = PlannerService(engine, catalog, PlannerConfig(
        max_new_tokens=6, enable_thinking=False, backend="remote_or_local", remote=remote))
    both.start()
    try:
        result = _plan(both, [PIXELS])
        assert result.finish_reason == "length" and result.telemetry["backend"] == "local"
        assert "remote_error" not in result.telemetry and result.telemetry["images"] == 1
        text = _plan(both, [])                 # text goes to the (absent) remote first
        assert "remote_error" in text.telemetry
    finally:
        both.stop()
    only = PlannerService(engine, catalog, PlannerConfig(backend="remote", remote=remote))
    ticket = only.submit(PlanRequest("put the cup in the sink", images=(PIXELS,)))
    result = ticket.result(TIMEOUT)
    assert result.rejected and ticket.invalid_field == "images"
    assert "the remote backend (planner.backend remote) does not take images" in result.error
