"""Messages <-> planning objects, as plain field dicts (no rclpy, no generated types here).

The node builds the ROS message and calls `fill(msg, fields)`; every key produced here is a
field of flash_planner_interfaces' Plan.action / PlanTelemetry.msg (a test reads the
.action/.msg files to check it). Values are converted to the field's Python type (int for
int32, float for float32/float64, str for string) because generated setters check types.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

import numpy as np

from ..planning.bt import xml_or_why
from ..planning.request import PlanRequest, PlanResult, RequestError

if TYPE_CHECKING:  # the service module pulls in the engine (torch); only its type is needed
    from ..planning.service import PlanFeedback

# PlanTelemetry field -> (telemetry dict key, type). `stamp` is set by the node's clock and
# `finish_reason` comes from the result, not the telemetry dict.
TELEMETRY_MAP: dict[str, tuple[str, type]] = {
    "request_id": ("request_id", str),
    "queue_wait_ms": ("queue_wait_ms", float),
    "ttft_ms": ("ttft_ms", float),
    "decode_ms": ("decode_ms", float),
    "total_latency_ms": ("total_latency_ms", float),
    "prompt_tokens": ("prompt_tokens", int),
    "new_tokens": ("new_tokens", int),
    "tokens_per_s": ("decode_tokens_per_s", float),
    "cycles": ("cycles", int),
    "mean_accepted_length": ("mean_accepted", float),
    "tokens_per_cycle": ("tokens_per_cycle", float),
    "first_step_ms": ("first_step_ms", float),
    "prefix_hit": ("prefix_hit", bool),
    "prefix_tokens": ("prefix_tokens", int),
    "prefix_restore_ms": ("prefix_restore_ms", float),
    "images": ("images", int),
    "image_tokens": ("image_tokens", int),
    "vision_ms": ("vision_ms", float),
}
# sensor_msgs/Image encodings a goal or the image topic may use: channels, and where R, G
# and B are among them
ENCODINGS = {"rgb8": (3, [0, 1, 2]), "bgr8": (3, [2, 1, 0]), "rgba8": (4, [0, 1, 2]),
             "bgra8": (4, [2, 1, 0]), "mono8": (1, [0, 0, 0])}
PHASE_FIELDS = {"draft_ms_per_cycle": "draft", "verify_ms_per_cycle": "verify"}
TERMINAL = ("succeed", "canceled", "abort")  # ServerGoalHandle method names


def fill(msg: Any, fields: dict[str, Any]) -> Any:
    """Set `fields` on `msg` (nested dicts fill nested messages); returns `msg`."""
    for name, value in fields.items():
        if not hasattr(msg, name):
            raise AttributeError(f"{type(msg).__name__} has no field '{name}'")
        if isinstance(value, dict):
            fill(getattr(msg, name), value)
        else:
            setattr(msg, name, value)
    return msg


def goal_request_id(uuid: Any) -> str:
    """The planner request id of an action goal: the hex of its 16-byte goal UUID."""
    return bytes(bytearray(int(b) for b in uuid)).hex()


def image_pixels(msg: Any, where: str) -> np.ndarray:
    """A sensor_msgs/Image as RGB pixels uint8 [H, W, 3], or RequestError naming `where`
    and what is wrong (encoding, size, row step, data length)."""
    encoding = str(msg.encoding)
    if encoding.lower() not in ENCODINGS:
        raise RequestError(f"{where}.encoding {encoding!r} is not supported; send one of "
                           f"{', '.join(ENCODINGS)}", where)
    channels, rgb = ENCODINGS[encoding.lower()]
    height, width, step = int(msg.height), int(msg.width), int(msg.step)
    if height < 1 or width < 1:
        raise RequestError(f"{where} is {width} x {height} pixels: nothing to see", where)
    if step < width * channels:
        raise RequestError(f"{where}.step {step} is shorter than a row of {width} {encoding} "
                           f"pixels ({width * channels} bytes)", where)
    data = np.frombuffer(msg.data, np.uint8)
    if data.size < step * height:
        raise RequestError(f"{where}.data holds {data.size} bytes, {height} rows of {step} "
                           f"need {step * height}", where)
    rows = data[:step * height].reshape(height, step)[:, :width * channels]
    return np.ascontiguousarray(rows.reshape(height, width, channels)[:, :, rgb])


def goal_to_request(goal: Any, request_id: str) -> PlanRequest:
    """A Plan goal (task, context, scene, images, max_new_tokens, enable_thinking, sampling,
    seed) as a PlanRequest; "" and 0 mean the node's defaults. RequestError names an image
    that cannot be read."""
    from ..planning.images import ImageSource

    images = tuple(ImageSource(image_pixels(m, f"goal.images[{i}]"), f"goal.images[{i}]")
                   for i, m in enumerate(goal.images))
    return PlanRequest(task=goal.task, context=goal.context, scene=tuple(goal.scene),
                       images=images, id=request_id,
                       max_new_tokens=int(goal.max_new_tokens) or None,
                       enable_thinking=bool(goal.enable_thinking),
                       sampling=str(goal.sampling) or None, seed=int(goal.seed) or None)


def telemetry_fields(telemetry: dict[str, Any], finish_reason: str = "") -> dict[str, Any]:
    """PlanTelemetry fields (all but `stamp`) from a result's telemetry dict; missing -> 0/""."""
    out: dict[str, Any] = {}
    for field, (key, kind) in TELEMETRY_MAP.items():
        value = telemetry.get(key)
        out[field] = kind(value) if value is not None else kind()
    phases = telemetry.get("phase_ms_per_cycle") or {}
    for field, phase in PHASE_FIELDS.items():
        out[field] = float(phases.get(phase, 0.0))
    out["image_age_ms"] = float(telemetry.get("image_age_ms", -1.0))
    out["finish_reason"] = str(finish_reason)
    return out


def plan_as_bt(result: PlanResult, catalog) -> str:
    """A successful plan as a BehaviorTree.CPP tree, or "" (no catalog, a failed plan, or
    a plan BT.CPP cannot hold: an argument it would read as a blackboard entry, logged)."""
    if not result.success or catalog is None:
        return ""
    xml, why = xml_or_why(result.plan, catalog)
    if why:
        logging.getLogger(__name__).warning("plan %s given without bt_xml: %s",
                                            result.request_id, why)
    return xml


def result_fields(result: PlanResult, catalog=None) -> dict[str, Any]:
    """Plan result fields: success, plan_json, bt_xml (with the catalog the plan was made
    from: the plan as a BehaviorTree.CPP tree), error, raw_text and nested telemetry."""
    return {
        "success": bool(result.success),
        "plan_json": json.dumps({"plan": result.plan}) if result.success else "",
        "bt_xml": plan_as_bt(result, catalog),
        "error": "" if result.success else str(result.error),
        "raw_text": str(result.raw_text),
        "telemetry": telemetry_fields(result.telemetry, result.finish_reason),
    }


def feedback_fields(feedback: PlanFeedback) -> dict[str, Any]:
    """Plan feedback fields from the service's streaming feedback."""
    return {
        "delta_text": str(feedback.delta_text),
        "tokens_so_far": int(feedback.tokens_so_far),
        "tokens_per_s": float(feedback.tokens_per_s),
        "mean_accepted_length": float(feedback.mean_accepted),
        "step_indices": [int(i) for i, _ in feedback.steps],
        "steps_json": [json.dumps(step) for _, step in feedback.steps],
    }


def plan_topic_json(result: PlanResult) -> str:
    """The `~/plan` topic message: id, task, success, plan or error, finish_reason, telemetry."""
    return json.dumps(result.as_dict(raw_text=False), default=str)


class NotServing(RuntimeError):
    """The node cannot take requests now; the message says why and what to do."""


def not_serving_reason(phase: str, node_name: str) -> str:
    """Why a request is refused while the node is in lifecycle `phase` (not active)."""
    fix = {"unconfigured": "configure and activate it", "inactive": "activate it"}
    action = fix.get(phase)
    how = f": {action} (ros2 lifecycle set {node_name} ...)" if action else ""
    return f"the planner node is {phase}, not serving requests{how}"


def refused(error: str, text: str | bytes = "", request_id: str = "",
            limit: int = 200) -> PlanResult:
    """The failed result of a request the node did not hand to the planner."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    task = text if len(text) <= limit else text[:limit] + "..."
    return PlanResult(request_id, task, success=False, error=error)


def rejected_task(error: str, text: str | bytes = "", limit: int = 200) -> PlanResult:
    """The failed result published for a `~/task` message that is not a request."""
    return refused(f"invalid request: {error}", text, limit=limit)


def terminal_state(success: bool, cancel_requested: bool) -> str:
    """Which ServerGoalHandle method ends a goal: succeed, canceled or abort.

    A failure after a cancel request is a cancel; any other failure (no valid plan,
    preempted, rejected, engine error) aborts, with the error in the result.
    """
    if success:
        return "succeed"
    return "canceled" if cancel_requested else "abort"


def error_line(exc: BaseException) -> str:
    """One line for a log: the message of a ValueError/OSError or a failed warm-up (which
    names the model and the cause itself), else `Type: message`."""
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else ""
    names_itself = getattr(exc, "names_itself", False)      # planning.warmup.WarmUpError
    if (isinstance(exc, (ValueError, OSError)) or names_itself) and text:
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
