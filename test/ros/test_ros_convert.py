"""Conversions between messages and planning objects, against the real interface files."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from live import requires_ros

from flash_planner.planning.request import PlanResult, RequestError
from flash_planner.planning.service import PlanFeedback
from flash_planner.ros import convert
from flash_planner.ros.interface_spec import read_action, read_fields

IFACE = Path(__file__).resolve().parents[2] / "flash_planner_interfaces"
ACTION = read_action(IFACE / "action" / "Plan.action")
TELEMETRY = read_fields(IFACE / "msg" / "PlanTelemetry.msg")
PY = {"bool": bool, "string": str, "float32": float, "float64": float, "int32": int,
      "int32[]": list, "string[]": list}

FULL_TELEMETRY = {
    "request_id": "r1", "queue_wait_ms": 1.5, "total_latency_ms": 120.0, "prompt_tokens": 500,
    "new_tokens": 40, "prefill_ms": 30.0, "ttft_ms": 31.0, "decode_ms": 80.0, "total_ms": 111.0,
    "decode_tokens_per_s": 487.5, "cycles": 10, "drafted": 150, "accepted": 29,
    "mean_accepted": 2.9, "tokens_per_cycle": 3.9, "accept_hist": [1, 2, 3, 4],
    "phase_ms_per_cycle": {"draft": 1.25, "verify": 5.5, "accept": 0.1, "commit": 0.05,
                           "other": 0.4},
    "first_step_ms": 52.5, "prefix_hit": True, "prefix_tokens": 450, "prefix_restore_ms": 0.8,
    "images": 2, "image_tokens": 96, "vision_ms": 41.5, "image_age_ms": 120.25,
}


def _check_types(fields: dict, spec: list[tuple[str, str]], nested: dict | None = None):
    """Every key is a field of `spec`, with the Python type its generated setter wants."""
    types = dict((name, type_) for type_, name in spec)
    for key, value in fields.items():
        assert key in types, f"{key!r} is not a field (fields: {sorted(types)})"
        if isinstance(value, dict):
            _check_types(value, nested[types[key]])
        else:
            assert type(value) is PY[types[key]], (key, types[key], value)


def _ok_result() -> PlanResult:
    plan = [{"skill": "navigate_to", "args": {"target": "table"}}]
    return PlanResult("r1", "go to the table", True, plan=plan, raw_text="<think></think>{}",
                      finish_reason="eos", telemetry=dict(FULL_TELEMETRY))


def test_telemetry_fields_cover_the_message():
    fields = convert.telemetry_fields(FULL_TELEMETRY, "eos")
    _check_types(fields, TELEMETRY)
    assert set(fields) == {name for _, name in TELEMETRY} - {"stamp"}
    assert fields["tokens_per_s"] == 487.5 and fields["mean_accepted_length"] == 2.9
    assert fields["draft_ms_per_cycle"] == 1.25 and fields["verify_ms_per_cycle"] == 5.5
    assert fields["prompt_tokens"] == 500 and fields["finish_reason"] == "eos"
    assert fields["request_id"] == "r1" and fields["total_latency_ms"] == 120.0
    assert fields["first_step_ms"] == 52.5 and fields["prefix_hit"] is True
    assert fields["prefix_tokens"] == 450 and fields["prefix_restore_ms"] == 0.8
    assert (fields["images"], fields["image_tokens"]) == (2, 96)
    assert (fields["vision_ms"], fields["image_age_ms"]) == (41.5, 120.25)


def test_missing_telemetry_is_zero():
    fields = convert.telemetry_fields({"request_id": "x", "total_latency_ms": 3})
    _check_types(fields, TELEMETRY)
    assert fields["total_latency_ms"] == 3.0 and fields["ttft_ms"] == 0.0
    assert fields["cycles"] == 0 and fields["finish_reason"] == ""
    assert fields["draft_ms_per_cycle"] == 0.0
    assert fields["prefix_hit"] is False and fields["first_step_ms"] == 0.0
    assert fields["images"] == 0 and fields["image_age_ms"] == -1.0    # no camera frame


def test_result_fields_success_and_failure():
    nested = {"PlanTelemetry": TELEMETRY}
    ok = convert.result_fields(_ok_result())
    _check_types(ok, ACTION["result"], nested)
    assert [name for _, name in ACTION["result"]] == list(ok)
    assert json.loads(ok["plan_json"]) == {"plan": _ok_result().plan}
    assert ok["success"] and ok["error"] == ""
    bad = convert.result_fields(PlanResult("r2", "t", False, error="unknown skill 'fly'",
                                           raw_text="xyz", finish_reason="length"))
    _check_types(bad, ACTION["result"], nested)
    assert bad["plan_json"] == "" and bad["error"] == "unknown skill 'fly'"
    assert bad["raw_text"] == "xyz" and bad["telemetry"]["finish_reason"] == "length"


def test_feedback_fields():
    step = {"skill": "pick", "args": {"object": "cup"}}
    fb = PlanFeedback("r1", "pick", 12, 250, 2, steps=((1, step),))
    fields = convert.feedback_fields(fb)
    _check_types(fields, ACTION["feedback"])
    assert list(fields) == [name for _, name in ACTION["feedback"]]
    assert fields == {"delta_text": "pick", "tokens_so_far": 12, "tokens_per_s": 250.0,
                      "mean_accepted_length": 2.0, "step_indices": [1],
                      "steps_json": [json.dumps(step)]}


def test_goal_to_request_reads_every_goal_field():
    assert {name for _, name in ACTION["goal"]} == {"task", "context", "scene", "images",
                                                    "max_new_tokens", "enable_thinking",
                                                    "sampling", "seed"}
    goal = SimpleNamespace(task="pick up the cup", context="cup on table", max_new_tokens=0,
                           enable_thinking=False, sampling="", seed=0, scene=["red cup|cup"],
                           images=[])
    req = convert.goal_to_request(goal, "abc")
    assert (req.task, req.context, req.id) == ("pick up the cup", "cup on table", "abc")
    assert req.scene == ("red cup|cup",) and req.images == ()
    assert req.max_new_tokens is None and req.enable_thinking is False
    assert req.sampling is None and req.seed is None            # the node's defaults
    goal.max_new_tokens, goal.enable_thinking = 64, True
    goal.sampling, goal.seed = '{"thinking": "card", "answer": {"temperature": 0}}', 42
    req = convert.goal_to_request(goal, "abc")
    assert req.max_new_tokens == 64 and req.enable_thinking is True and req.seed == 42
    checked = req.checked(100, 100)
    assert checked.sampling == {"thinking": "card", "answer": {"temperature": 0}}
    goal.sampling = '{"temperature": 0.7'
    with pytest.raises(RequestError, match="sampling is not valid JSON"):
        convert.goal_to_request(goal, "abc").checked(100, 100)


def _image_msg(pixels, encoding, pad=0, override=None):
    """A sensor_msgs/Image's fields for RGB `pixels` [H, W, 3] in `encoding`, each row
    padded by `pad` bytes."""
    import numpy as np

    channels = {"rgb8": pixels, "bgr8": pixels[:, :, ::-1],
                "rgba8": np.concatenate([pixels, pixels[:, :, :1]], axis=2),
                "bgra8": np.concatenate([pixels[:, :, ::-1], pixels[:, :, :1]], axis=2),
                "mono8": pixels[:, :, :1]}[encoding]
    h, w, c = channels.shape
    rows = np.zeros((h, w * c + pad), np.uint8)
    rows[:, :w * c] = channels.reshape(h, w * c)
    fields = dict(height=h, width=w, encoding=encoding, step=w * c + pad,
                  data=rows.tobytes())
    return SimpleNamespace(**{**fields, **(override or {})})


@pytest.mark.parametrize("encoding", list(convert.ENCODINGS))
def test_a_camera_image_of_each_encoding_and_row_padding_becomes_its_rgb_pixels(encoding):
    import numpy as np

    rgb = np.random.default_rng(0).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    want = rgb if encoding != "mono8" else np.repeat(rgb[:, :, :1], 3, axis=2)
    for pad in (0, 3):
        got = convert.image_pixels(_image_msg(rgb, encoding, pad), "goal.images[0]")
        assert got.dtype == np.uint8 and np.array_equal(got, want)


@pytest.mark.parametrize("override, match", [
    ({"encoding": "yuv422"}, "goal.images\\[1\\].encoding 'yuv422' is not supported; "
                             "send one of rgb8"),
    ({"encoding": "16UC1"}, "encoding '16UC1' is not supported"),
    ({"width": 0, "height": 0, "step": 0, "data": b""}, "is 0 x 0 pixels: nothing to see"),
    ({"step": 20}, "step 20 is shorter than a row of 7 rgb8 pixels \\(21 bytes\\)"),
    ({"data": bytes(50)}, "data holds 50 bytes, 5 rows of 21 need 105"),
])
def test_a_bad_camera_image_is_refused_naming_the_goal_field(override, match):
    import numpy as np

    msg = _image_msg(np.zeros((5, 7, 3), np.uint8), "rgb8", override=override)
    with pytest.raises(RequestError, match=match) as caught:
        convert.image_pixels(msg, "goal.images[1]")
    assert caught.value.field == "goal.images[1]"
    goal = SimpleNamespace(task="t", context="", max_new_tokens=0, enable_thinking=False,
                           sampling="", seed=0, scene=[], images=[msg])
    with pytest.raises(RequestError, match="goal.images\\[0\\]"):
        convert.goal_to_request(goal, "abc")


def test_goal_request_id_is_the_uuid_hex():
    assert convert.goal_request_id(list(range(16))) == bytes(range(16)).hex()
    assert convert.goal_request_id(bytes([255] * 16)) == "ff" * 16


def test_plan_topic_json():
    ok = json.loads(convert.plan_topic_json(_ok_result()))
    assert ok["id"] == "r1" and ok["success"] is True and ok["plan"][0]["skill"] == "navigate_to"
    assert "error" not in ok and ok["telemetry"]["ttft_ms"] == 31.0
    assert ok["finish_reason"] == "eos"
    bad = json.loads(convert.plan_topic_json(PlanResult("r2", "t", False, error="boom")))
    assert bad["error"] == "boom" and "plan" not in bad and bad["success"] is False


def test_rejected_task():
    result = convert.rejected_task("message looks like JSON but is malformed", "{" * 500)
    assert not result.success and result.error.startswith("invalid request: message looks")
    assert len(result.task) == 203 and result.task.endswith("...")
    assert convert.rejected_task("bad utf-8", b"\xff\xfe").task == "\ufffd\ufffd"


@pytest.mark.parametrize("success, cancel, state", [
    (True, False, "succeed"), (True, True, "succeed"), (False, True, "canceled"),
    (False, False, "abort")])
def test_terminal_state(success, cancel, state):
    assert convert.terminal_state(success, cancel) == state
    assert state in convert.TERMINAL


def test_fill_sets_fields_and_nested_messages():
    msg = SimpleNamespace(success=False, telemetry=SimpleNamespace(ttft_ms=0.0))
    assert convert.fill(msg, {"success": True, "telemetry": {"ttft_ms": 2.0}}) is msg
    assert msg.success and msg.telemetry.ttft_ms == 2.0
    with pytest.raises(AttributeError, match="no field 'sucess'"):
        convert.fill(msg, {"sucess": True})


@requires_ros
def test_fill_on_generated_message_types():
    """The generated setters check types: every converted value has the field's type."""
    from flash_planner_interfaces.action import Plan
    from flash_planner_interfaces.msg import PlanTelemetry

    result = Plan.Result()
    convert.fill(result, convert.result_fields(_ok_result()))
    assert result.success and result.telemetry.cycles == 10
    assert result.telemetry.draft_ms_per_cycle == 1.25
    feedback = convert.fill(Plan.Feedback(),
                            convert.feedback_fields(PlanFeedback("r", "a", 1, 0.0, 0.0)))
    assert feedback.delta_text == "a"
    telemetry = convert.fill(PlanTelemetry(), convert.telemetry_fields({"new_tokens": 3}))
    assert telemetry.new_tokens == 3 and telemetry.ttft_ms == 0.0


def test_error_line():
    assert convert.error_line(ValueError("model.path: missing\nmore")) == "model.path: missing"
    assert convert.error_line(RuntimeError("CUDA out of memory")) == \
        "RuntimeError: CUDA out of memory"
    assert convert.error_line(KeyError()) == "KeyError"


def test_a_plan_bt_cpp_cannot_hold_keeps_its_json_and_logs_why(caplog):
    """An argument BT.CPP would read as a blackboard entry ({x}) cannot be a port value:
    the result still carries the plan as JSON, its bt_xml is empty, and the log says why."""
    from flash_planner.planning.presets import default_skills_path
    from flash_planner.planning.skills import SkillCatalog

    catalog = SkillCatalog.from_yaml(default_skills_path())
    skill, arg = next((s, a.name) for s in catalog.skills for a in s.args
                      if a.type == "string")
    plan = [{"skill": skill.name, "args": {arg: "{x}"}}]
    with caplog.at_level("WARNING"):
        fields = convert.result_fields(PlanResult("r3", "t", True, plan=plan), catalog)
    assert json.loads(fields["plan_json"]) == {"plan": plan} and fields["bt_xml"] == ""
    assert "blackboard" in caplog.text and "r3" in caplog.text
    good = [{"skill": skill.name, "args": {arg: "cup"}}]
    assert convert.result_fields(PlanResult("r4", "t", True, plan=good), catalog)["bt_xml"]
