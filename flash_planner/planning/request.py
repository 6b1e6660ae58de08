"""Plan requests and results, and every check a request passes before it is queued.

`RequestRules.checked` is the one call that decides whether a request may be planned here: its
text and scene (`PlanRequest.checked`, which needs no torch, so `flash-planner plan ""`
answers at once), its numbers and flags, its sampling over the planner's default, its
reasoning effort and the chat template's variables, and its images read into the vision
tower's patches. It returns the checked request or raises the RequestError naming the first
field that is wrong; the service only queues, batches and resolves what passed.
"""

from __future__ import annotations

import dataclasses
import json
import unicodedata
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..engine.inputs.chat import (
    TemplateError,
    TemplateVariableError,
    check_reasoning_effort,
    check_template_vars,
)
from ..engine.methods import METHODS
from .finite import finite_number, loads
from .request_error import RequestError

if TYPE_CHECKING:
    from .images import ImageLimits

# The service's default text limits (PlannerConfig); here, so that a request is checked
# before anything imports torch (`flash-planner plan ""` answers at once).
MAX_TASK_CHARS = 2000
MAX_CONTEXT_CHARS = 4000
# A scene list (the objects and places perception reports): names per request, characters
# per entry (a name and its `|` short forms). Every name is shown in the prompt.
MAX_SCENE_NAMES = 256
MAX_SCENE_ENTRY_CHARS = 120

REQUEST_FIELDS = ("id", "task", "context", "scene", "images", "max_new_tokens",
                  "enable_thinking", "deadline_s", "speculative", "method", "sampling", "seed",
                  "reasoning_effort", "progress")


def _check_text(value: Any, name: str, limit: int, required: bool) -> str:
    """The text rule every task and context passes (docs/reliability.md, "Text a request may
    carry"):
    bytes must be UTF-8; CR LF and CR become LF; U+FFFD (what ROS makes of invalid UTF-8),
    lone surrogates, NUL and every other control character but LF and tab are refused."""
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RequestError(f"{name} is not valid UTF-8 (byte {exc.start})", name) from None
    if not isinstance(value, str):
        raise RequestError(f"{name} must be a string, got {type(value).__name__}", name)
    value = value.replace("\r\n", "\n").replace("\r", "\n")
    if required and not value.strip():
        raise RequestError(f"{name} is empty", name)
    if len(value) > limit:
        raise RequestError(f"{name} is {len(value)} characters, the limit is {limit}",
                           name)
    for at, char in enumerate(value):
        if char == "\ufffd":
            raise RequestError(f"{name} holds U+FFFD at character {at}: the sender's text "
                               "was not valid UTF-8", name)
        category = unicodedata.category(char)
        if category in ("Cc", "Cs") and char not in "\n\t":
            kind = "a lone surrogate" if category == "Cs" else "the control character"
            raise RequestError(f"{name} contains {kind} U+{ord(char):04X} at character {at}",
                               name)
    return value


def check_scene(scene: Any) -> tuple[str, ...]:
    """The scene list as a tuple of entries, each a name with optional short forms after `|`
    ("coke can|coke"), or RequestError naming the entry. Each entry passes the text rule; an
    empty list is no list."""
    if isinstance(scene, (str, bytes)) or not isinstance(scene, (list, tuple)):
        raise RequestError(f"scene must be a list of names, got {type(scene).__name__}",
                           "scene")
    if len(scene) > MAX_SCENE_NAMES:
        raise RequestError(f"scene lists {len(scene)} names, the limit is {MAX_SCENE_NAMES}",
                           "scene")
    entries = []
    for i, entry in enumerate(scene):
        where = f"scene[{i}]"
        entry = _check_text(entry, where, MAX_SCENE_ENTRY_CHARS, required=True)
        if "\n" in entry or "\t" in entry:
            raise RequestError(f"{where} holds a line break or tab: one name per entry",
                               where)
        parts = [part.strip() for part in entry.split("|")]
        bad = next((p for p in parts if not any(c.isalnum() for c in p)), None)
        if bad is not None:
            raise RequestError(f"{where} {entry!r}: '|' separates a name from its short "
                               f"forms, and each needs a letter or digit (got {bad!r})",
                               where)
        entries.append("|".join(parts))
    return tuple(entries)


def sampling_spec(value: Any, where: str) -> Any:
    """A sampling spec as given, with a JSON object sent as text (an action goal's string,
    a node parameter) parsed into a dict; RequestError names `where` when it is not JSON."""
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            return loads(value)
        except ValueError as exc:
            raise RequestError(f"{where} is not valid JSON: {exc}", where) from None
    return value


@dataclass(frozen=True)
class PlanRequest:
    task: str
    context: str = ""
    # the scene's objects and places (perception): names, each optionally with short forms
    # after `|`; what `grounded: scene` arguments are taken from
    scene: tuple[str, ...] = ()
    # camera images for a vision-language target, shown before the task: as a front door
    # received them (planning/images.ImageSource, encoded bytes, data URLs, RGB arrays);
    # once the service has checked them, their patches (engine/images.ImagePatches)
    images: tuple[Any, ...] = ()
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    max_new_tokens: int | None = None      # None: the service's default
    enable_thinking: bool | None = None    # None: the service's default
    deadline_s: float | None = None        # None: the service's default
    speculative: bool | None = None        # None: the service's default (A/B, soak)
    method: str | None = None              # auto | dflash | mtp | none; None: the engine's
    # sampling: None (the service's), a mode (greedy | model | card), a mapping of settings
    # (both phases, or per phase under "thinking" / "answer"), or an engine Sampling
    sampling: Any = None
    seed: int | None = None                # makes a sampled request reproducible
    # passed to chat templates that take it (Qwen3.8's: xhigh, medium, low); a short
    # lowercase word; None: the service's default
    reasoning_effort: str | None = None
    # a replan's section (prompt.progress_section: the steps done, the failed step and why),
    # shown after the task; "" the first time
    progress: str = ""

    def checked(self, max_task_chars: int, max_context_chars: int) -> PlanRequest:
        """This request with validated text fields, or RequestError."""
        task = _check_text(self.task, "task", max_task_chars, required=True)
        context = _check_text(self.context, "context", max_context_chars, required=False)
        progress = _check_text(self.progress, "progress", max_context_chars, required=False)
        scene = check_scene(self.scene)
        sampling = sampling_spec(self.sampling, "sampling")
        if not isinstance(self.id, str) or not self.id.strip():
            raise RequestError("id must be a non-empty string", "id")
        if self.max_new_tokens is not None and (
                not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0):
            raise RequestError(f"max_new_tokens must be a positive integer, "
                               f"got {self.max_new_tokens!r}", "max_new_tokens")
        if self.deadline_s is not None and (
                not finite_number(self.deadline_s) or self.deadline_s <= 0):
            raise RequestError(f"deadline_s must be a positive number, got {self.deadline_s!r}",
                               "deadline_s")
        for name in ("enable_thinking", "speculative"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise RequestError(f"{name} must be true or false", name)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(
                self.seed, int) or not 0 <= self.seed < 2**63):
            raise RequestError(f"seed must be an integer in [0, 2**63), got {self.seed!r}",
                               "seed")
        from ..engine.loop.sampling import Sampling  # torch: only once the text has passed

        if sampling is not None and not isinstance(sampling, (str, dict, Sampling)):
            raise RequestError("sampling must be a mode name (greedy, model, card) or an "
                               f"object of settings, got {type(sampling).__name__}", "sampling")
        if self.method is not None and self.method not in METHODS:
            raise RequestError(f"method must be one of {', '.join(METHODS)}, "
                               f"got {self.method!r}", "method")
        try:
            check_reasoning_effort(self.reasoning_effort)
        except ValueError as exc:
            raise RequestError(str(exc), "reasoning_effort") from None
        return dataclasses.replace(self, task=task.strip(), context=context.strip(),
                                   scene=scene, sampling=sampling, progress=progress.strip())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PlanRequest:
        unknown = sorted(set(data) - set(REQUEST_FIELDS))
        if unknown:
            raise RequestError(f"unknown request field(s) {unknown}; known: "
                               f"{list(REQUEST_FIELDS)}", unknown[0])
        if "task" not in data:
            raise RequestError("the request has no 'task'", "task")
        kwargs = {k: data[k] for k in REQUEST_FIELDS if k in data and data[k] is not None}
        if "id" in kwargs:
            kwargs["id"] = str(kwargs["id"])
        return cls(**kwargs)

    @classmethod
    def from_text(cls, text: str | bytes) -> PlanRequest:
        """A `~/task` message: plain task text, or a JSON object {"id", "task", "context",
        "scene", "images" (data URLs), ...} (`REQUEST_FIELDS`)."""
        if isinstance(text, bytes):
            text = _check_text(text, "message", len(text) + 1, required=False)
        if text.lstrip().startswith("{"):
            try:
                data = loads(text)
            except json.JSONDecodeError as exc:
                raise RequestError(f"message looks like JSON but is malformed: {exc.msg} at "
                                   f"column {exc.colno}") from None
            except ValueError as exc:          # NaN, Infinity: finite.loads' refusal
                raise RequestError(f"message: {exc}") from None
            if not isinstance(data, dict):
                raise RequestError("a JSON request must be an object")
            return cls.from_dict(data)
        return cls(task=text)


@dataclass(frozen=True)
class RequestRules:
    """What a plan request must satisfy on one planner; the service builds it once, from its
    config and engine, and every door's request passes `checked` before it is queued."""
    max_task_chars: int
    max_context_chars: int
    # the planner's own sampling (an engine Sampling) and the checkpoint's
    # generation_config.json, which a request's sampling spec is resolved over
    base_sampling: Any
    generation_defaults: Any
    relaxed_thinking: bool                # defined for greedy decoding only
    enable_thinking: bool                 # a request's default
    backend: str                          # a remote-only planner leaves templates to the remote
    tokenizer: Any                        # the local model's: its template takes the variables
    engine: Any                           # the local engine, whose vision tower reads images
    image_limits: ImageLimits

    def checked(self, request: PlanRequest) -> tuple[PlanRequest, float | None]:
        """(the request checked: its text stripped, its sampling resolved, its images read
        into patches; the age in ms of its oldest camera frame, None when none says), or
        RequestError naming the first field that is wrong."""
        request = request.checked(self.max_task_chars, self.max_context_chars)
        if request.reasoning_effort is not None and self.backend != "remote":
            thinking = (self.enable_thinking if request.enable_thinking is None
                        else request.enable_thinking)
            try:
                check_template_vars(self.tokenizer,
                                    {"reasoning_effort": request.reasoning_effort}, thinking)
            except TemplateVariableError as exc:
                raise RequestError(str(exc), "reasoning_effort") from None
            except TemplateError as exc:
                raise RequestError(f"reasoning_effort {request.reasoning_effort!r}: {exc}",
                                   "reasoning_effort") from None
        from ..engine.loop.sampling import resolve_sampling  # torch: once the text has passed

        try:
            sampling = resolve_sampling(request.sampling, self.base_sampling,
                                        self.generation_defaults, "sampling"
                                        ).with_seed(request.seed)
        except ValueError as exc:
            raise RequestError(str(exc), "sampling") from None
        if self.relaxed_thinking and not sampling.greedy:
            raise RequestError("this request samples, and relaxed thinking acceptance "
                               "(speculative.relaxed_thinking) is defined for greedy decoding "
                               "only: send temperature 0 or turn relaxed thinking off",
                               "sampling")
        request = dataclasses.replace(request, sampling=sampling)
        if not request.images:
            return request, None
        if self.backend == "remote":
            raise RequestError("images: the remote backend (planner.backend remote) does "
                               "not take images; plan them with backend local or "
                               "remote_or_local", "images")
        from .images import oldest_ms, request_images  # numpy, PIL, torch: images only

        age = oldest_ms(request.images)
        images = request_images(request.images, self.engine, self.image_limits)
        return dataclasses.replace(request, images=images), age


@dataclass
class PlanResult:
    request_id: str
    task: str
    success: bool
    plan: list[dict[str, Any]] | None = None
    error: str = ""
    refusal: str = ""        # the model's reason when it refused (docs/cli.md, "Refusals")
    raw_text: str = ""
    thinking: str = ""
    finish_reason: str = ""
    telemetry: dict[str, Any] = field(default_factory=dict)
    # refused before decoding for what the request asked (bad input, or more than the
    # context holds): the caller's to fix (the CLI exits 2, the server answers 400)
    rejected: bool = False

    def as_dict(self, raw_text: bool = True) -> dict[str, Any]:
        """The result as JSON-ready data: id, task, success, plan or error (and refusal),
        (raw_text), finish_reason, telemetry. The one serialisation the CLI and the ROS
        topic share."""
        out: dict[str, Any] = {"id": self.request_id, "task": self.task,
                               "success": self.success}
        if self.success:
            out["plan"] = self.plan
        else:
            out["error"] = self.error
            if self.refusal:
                out["refusal"] = self.refusal
        if raw_text:
            out["raw_text"] = self.raw_text
        out.update(finish_reason=self.finish_reason, telemetry=self.telemetry)
        return out
