"""Every ROS parameter of the planner node in one table, and its conversion to configs.

The table is the single source: the node declares from it (`declare`), config/planner.yaml
mirrors it (a test checks names, defaults and types), and `build_configs` turns the values
into an `EngineConfig`, a `PlannerConfig` and the skill catalog path. Only the latency
budgets are dynamic; everything else is read-only and applied at configure. No rclpy here at
import time: `descriptor` and `declare` import rcl_interfaces when they are called.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

Value = bool | int | float | str
DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
MAX_BLOCK = 16  # the engine's default verify-block capacity; raised for larger blocks


@dataclass(frozen=True)
class Param:
    """One parameter: dotted name, default (its type is the ROS type), description, limits."""

    name: str
    default: Value
    description: str
    read_only: bool = True
    range: tuple[float, float] | None = None  # inclusive
    choices: tuple[str, ...] = ()


def _p(name: str, default: Value, description: str, **kw: Any) -> Param:
    return Param(name, default, description, **kw)


PARAMS: tuple[Param, ...] = (
    _p("autostart", True, "Configure and activate once at startup."),
    # model
    _p("model.preset", "demo", "Model preset in config/models (demo, qwen3_6_27b, ...); "
       "'' = model.path only."),
    _p("model.path", "", "Target checkpoint directory or Hugging Face repo id (org/name"
       "[@revision]); overrides the preset's target."),
    _p("model.drafter_path", "", "DFlash drafter directory or repo id; overrides the preset's "
       "drafter."),
    _p("model.allow_download", False, "Fetch a repo id missing from the Hugging Face cache at "
       "configure; false (a robot's default): cache only, fetch ahead with "
       "`flash-planner fetch`."),
    _p("model.dtype", "auto", "Weight dtype; auto = the preset's, else bf16 on CUDA, fp32 on CPU.",
       choices=("auto", "fp32", "bf16", "fp16")),
    _p("model.device", "auto", "auto, cpu, cuda or cuda:N."),
    _p("model.weights", "auto", "Linear weights: auto = the preset's, else as stored (fp8, "
       "nvfp4, int4 checkpoints load unmodified); bf16 = full precision (a quantized "
       "checkpoint is dequantized); fp8 / nvfp4 / int4 = quantize a full-precision checkpoint "
       "while it loads.", choices=("auto", "bf16", "fp8", "nvfp4", "int4")),
    # engine
    _p("engine.max_context", 0, "Prompt + generated tokens (sizes the KV cache); 0 = preset's.",
       range=(0, 1 << 20)),
    _p("engine.prefill_chunk", 256, "Prompt tokens per prefill forward.", range=(1, 65536)),
    _p("engine.kv_dtype", "auto", "KV cache dtype; auto = the preset's, else the weight dtype.",
       choices=("auto", "fp32", "bf16", "fp16", "fp8")),
    _p("engine.prefix_cache", True, "Keep the system prompt's prefilled state (KV, GDN, "
       "proposer seeds) and restore it per request instead of prefilling it again."),
    _p("engine.prefix_cache_entries", 2, "Prefix snapshots kept (least recently used dropped).",
       range=(1, 64)),
    _p("engine.dense_backend", "torch", "Dense segments: torch, onnxruntime, tensorrt, or auto "
       "(TensorRT on CUDA when installed); an unavailable one falls back to torch (logged).",
       choices=("torch", "onnxruntime", "tensorrt", "auto")),
    _p("engine.compile", "auto", "Decode and verify as compiled static-shape graphs (CUDA "
       "graphs on a GPU, torch.compile on a CPU), compiled at configure and cached on disk: "
       "on, off, or auto = the preset's (auto: on on CUDA).", choices=("auto", "on", "off")),
    _p("engine.threads", 0, "torch CPU threads of the node's process; 0 = the preset's "
       "(auto: 1 with a GPU, else half the usable cores, or OMP_NUM_THREADS when set).",
       range=(0, 1024)),
    _p("engine.max_batch", 0, "Requests decoded at once, one verify per cycle for all of "
       "them (so as many ~/plan goals run at once; more wait in the planner.queue_depth "
       "queue); 0 = the preset's (auto: 8).", range=(0, 256)),
    # speculative decoding
    _p("speculative.enabled", True, "Speculative decoding when a proposer is loaded."),
    _p("speculative.method", "", "Proposer: dflash (drafter), mtp (the checkpoint's head), "
       "auto (each cycle to the faster of those loaded), none; '' = the preset's (auto).",
       choices=("", "auto", "dflash", "mtp", "none")),
    _p("speculative.mtp_steps", 0, "MTP drafts per cycle; 0 = the preset's (3).",
       range=(0, 15)),
    _p("speculative.block_size", 0, "Verify block (anchor + drafts); 0 = preset's/drafter's.",
       range=(0, 64)),
    _p("speculative.window", 0, "Drafter context window in tokens; 0 = the preset's (128).",
       range=(0, 65536)),
    _p("speculative.window_seed", True, "Seed the drafter window from the prompt's tail."),
    _p("speculative.relaxed_thinking", False, "Relaxed acceptance inside <think> (or preset)."),
    _p("speculative.relaxed_topk", 3, "Relaxed acceptance: draft within the target's top-k.",
       range=(1, 64)),
    _p("speculative.relaxed_delta", 1.0, "Relaxed acceptance: max logit gap to the top token.",
       range=(0.0, 100.0)),
    # planner
    _p("planner.skills_file", "", "Skill catalog YAML; '' = the installed config/skills.yaml."),
    _p("planner.enable_thinking", True, "Thinking phase for ~/task requests that do not say."),
    _p("planner.reasoning_effort", "", "Reasoning effort for chat templates that take one "
       "(Qwen3.8's: xhigh, medium, low) for ~/task requests that do not say; '' = the "
       "preset's (else the template's default)."),
    _p("planner.sampling", "", "How requests that do not say sample: '' = the preset's; greedy; "
       "model (the checkpoint's generation_config.json); card (the Qwen3 cards' values per "
       "phase); or a JSON object of settings for both phases or per phase ('thinking', "
       "'answer'), e.g. {\"thinking\": \"card\", \"answer\": {\"temperature\": 0}}."),
    _p("planner.backend", "", "Where plans are made: '' = the preset's (local); local; remote "
       "(an OpenAI-compatible server: vLLM, SGLang, another robot's flash-planner serve); "
       "remote_or_local (the remote, this engine when it fails or is late).",
       choices=("", "local", "remote", "remote_or_local")),
    _p("planner.remote_url", "", "The remote's base URL, e.g. http://gpu-box:8000/v1."),
    _p("planner.remote_model", "", "The model id the remote serves."),
    _p("planner.remote_key_env", "FLASH_PLANNER_REMOTE_KEY", "Name of the environment "
       "variable holding the remote's API key (the key itself is never a parameter)."),
    _p("planner.remote_connect_timeout_s", 2.0, "Connecting to the remote, seconds.",
       range=(0.01, 600.0)),
    _p("planner.remote_timeout_s", 30.0, "The longest silence inside the remote's stream.",
       range=(0.01, 3600.0)),
    _p("planner.remote_reserve_s", 1.0, "remote_or_local with a deadline: seconds of it kept "
       "for the local engine.", range=(0.0, 600.0)),
    _p("planner.constrain", True, "Decode the answer under the skill catalog's plan grammar "
       "(every answer parses); false = validate only afterwards."),
    _p("planner.answer_reserve", 160, "Constrained: tokens of max_new_tokens kept for the "
       "answer; thinking is closed (</think>) when it would use them.", range=(1, 131072)),
    _p("planner.max_string_tokens", 64, "Constrained: the most tokens inside one string of "
       "the answer (a name, a spoken text, a refusal's reason); a string that reaches it is "
       "closed there, so a model looping inside one still answers valid JSON.",
       range=(1, 131072)),
    _p("planner.max_new_tokens", 512, "Default bound on generated tokens.", range=(1, 131072)),
    _p("planner.max_task_chars", 2000, "Longest task text accepted.", range=(1, 1_000_000)),
    _p("planner.max_context_chars", 4000, "Longest context text accepted.",
       range=(1, 1_000_000)),
    _p("planner.image_topic", "", "A sensor_msgs/Image topic (a camera) whose latest frame "
       "is attached to every request, after a goal's own images; '' = none."),
    _p("planner.image_max_age_s", 2.0, "The image topic's frame may be at most this old when "
       "a request arrives (else the request is refused, naming its age); 0 = any age.",
       range=(0.0, 3600.0)),
    _p("planner.max_images", 4, "Images per request at most (a goal's and the topic's).",
       range=(1, 64)),
    _p("planner.max_image_pixels", 4096 * 4096, "Pixels of one image as sent at most "
       "(checked before it is decoded; the model sees it resized to its own budget).",
       range=(1, 1 << 30)),
    _p("planner.max_image_bytes", 8 << 20, "Bytes of one encoded image (PNG, JPEG) at most.",
       range=(1, 1 << 30)),
    _p("planner.queue_policy", "queue", "While busy: queue, preempt the running request, or "
       "reject.", choices=("queue", "preempt", "reject")),
    _p("planner.queue_depth", 4, "Requests waiting at most; more are rejected.",
       range=(1, 1024)),
    _p("planner.deadline_s", 0.0, "Per-request deadline from submission; 0 = none.",
       range=(0.0, 3600.0)),
    _p("planner.feedback_period_ms", 50.0, "Plan action feedback at most this often (text "
       "merged in between), and ExecutePlan's relayed server feedback (the latest kept; "
       "state changes at once); 0 = every speculative cycle, every server message.",
       range=(0.0, 10000.0)),
    # execution (docs/ros.md, "Running plans on the robot")
    _p("execution.enabled", True, "Serve ~/execute and ~/approve: plans run on the servers "
       "the skill catalog binds; false = an execute goal is refused, naming this parameter."),
    _p("execution.max_replans", 2, "Replans after a failed step at most, for goals that do "
       "not say.", range=(0, 10)),
    _p("execution.approval_timeout_s", 60.0, "How long a step marked approve waits for "
       "~/approve; then it is refused.", range=(0.1, 86400.0)),
    _p("execution.check_period_s", 2.0, "How often the bound servers are looked up on the "
       "graph; a skill whose server is missing is left out of the plan grammar.",
       range=(0.1, 600.0)),
    _p("execution.dry_run", False, "Every execution publishes its goals on ~/dry_run and "
       "sends none."),
    _p("execution.from_task_topic", False, "Plan and execute each ~/task message (as an "
       "execute goal would); false = ~/task only plans."),
    # diagnostics
    _p("diagnostics.ttft_budget_ms", 500.0, "p95 TTFT budget: WARN above, ERROR above 2x.",
       read_only=False, range=(1.0, 1e6)),
    _p("diagnostics.latency_budget_ms", 5000.0, "p95 end-to-end latency budget: WARN above, "
       "ERROR above 2x.", read_only=False, range=(1.0, 1e7)),
    _p("diagnostics.window", 50, "Requests in the rolling latency window.", range=(1, 10000)),
    _p("diagnostics.period_s", 1.0, "Diagnostics publishing period.", range=(0.1, 60.0)),
    _p("diagnostics.hardware_id", "", "hardware_id of the /diagnostics status; '' = host name."),
    # QoS
    _p("qos.plan_depth", 10, "~/plan history depth (reliable, transient local).",
       range=(1, 1000)),
    _p("qos.task_depth", 10, "~/task history depth (reliable).", range=(1, 1000)),
    _p("qos.telemetry_depth", 10, "~/telemetry history depth (reliable).", range=(1, 1000)),
)
BY_NAME = {p.name: p for p in PARAMS}


def defaults() -> dict[str, Value]:
    """Parameter name -> default value."""
    return {p.name: p.default for p in PARAMS}


def check(param: Param, value: Any) -> Value:
    """`value` for `param`, type-, range- and choice-checked; ValueError names the parameter."""
    kind = type(param.default)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if type(value) is not kind:
        raise ValueError(f"{param.name} must be a {kind.__name__}, got {value!r}")
    if param.range is not None and not param.range[0] <= value <= param.range[1]:
        raise ValueError(f"{param.name} must be within {param.range[0]}..{param.range[1]}, "
                         f"got {value!r}")
    if param.choices and value not in param.choices:
        raise ValueError(f"{param.name} must be one of {', '.join(param.choices)}, "
                         f"got {value!r}")
    return value


def validated(values: dict[str, Any]) -> dict[str, Value]:
    """Defaults overlaid with `values`, each checked; unknown names are an error."""
    unknown = sorted(set(values) - set(BY_NAME))
    if unknown:
        raise ValueError(f"unknown parameter(s) {unknown}")
    merged = {**defaults(), **values}
    return {name: check(BY_NAME[name], value) for name, value in merged.items()}


def _model(v: dict[str, Value]):
    """The model preset the model.* parameters describe."""
    from ..planning import sources
    from ..planning.presets import ModelPreset, resolve_model

    if not v["model.preset"] and not v["model.path"]:
        raise ValueError("no model: set model.preset (a config/models preset, e.g. demo) or "
                         "model.path (a checkpoint directory)")
    path = v["model.path"]
    if path and sources.parse(path) is None:
        path = str(Path(path).expanduser())
        if not Path(path).is_dir():
            raise ValueError(f"model.path: directory {path} does not exist (nor is it a "
                             "Hugging Face repo id, org/name)")
    try:
        preset = resolve_model(v["model.preset"]) if v["model.preset"] else None
    except ValueError as exc:
        raise ValueError(f"model.preset: {exc}") from None
    if preset is None:
        preset = ModelPreset(name=Path(path).name, target_path=path)
    elif path:  # another target: the preset's drafter was made for the preset's target
        preset = replace(preset, target_path=path, drafter_path=None)
    drafter = v["model.drafter_path"]
    if drafter and sources.parse(drafter) is None:
        drafter = str(Path(drafter).expanduser())
        if not Path(drafter).is_dir():
            raise ValueError(f"model.drafter_path: directory {drafter} does not exist (nor is "
                             "it a Hugging Face repo id, org/name)")
    if drafter:
        preset = replace(preset, drafter_path=drafter)
    return preset


def _backend(v: dict[str, Value], preset) -> dict[str, Any]:
    """PlannerConfig's backend fields from the planner.* parameters (else the preset's)."""
    from ..planning.remote import RemoteConfig

    backend = v["planner.backend"] or preset.backend
    if backend == "local":
        return {"backend": "local"}
    url = v["planner.remote_url"] or preset.remote_url
    model = v["planner.remote_model"] or preset.remote_model
    try:
        remote = RemoteConfig(url, model, v["planner.remote_key_env"],
                              v["planner.remote_connect_timeout_s"],
                              v["planner.remote_timeout_s"])
    except ValueError as exc:
        raise ValueError(f"planner.backend {backend} needs planner.remote_url and "
                         f"planner.remote_model (or the preset's): {exc}") from None
    return {"backend": backend, "remote": remote,
            "remote_reserve_s": v["planner.remote_reserve_s"]}


def build_configs(values: dict[str, Any]):
    """(EngineConfig, PlannerConfig, skills path) from parameter values (missing = default).

    Zero / "auto" values defer to the model preset. Raises ValueError naming the parameter.
    """
    from ..planning.images import ImageLimits
    from ..planning.presets import default_skills_path
    from ..planning.request import sampling_spec
    from ..planning.service import PlannerConfig

    v = validated(values)
    if not DEVICE.match(v["model.device"]):
        raise ValueError(f"model.device must be auto, cpu, cuda or cuda:N, "
                         f"got {v['model.device']!r}")
    block = v["speculative.block_size"] or None
    if block == 1:
        raise ValueError("speculative.block_size must be 0 (the drafter's) or 2..64, got 1")
    preset = _model(v)
    try:
        engine = preset.engine_config(
            allow_download=v["model.allow_download"],
            dtype=None if v["model.dtype"] == "auto" else v["model.dtype"],
            kv_dtype=None if v["engine.kv_dtype"] == "auto" else v["engine.kv_dtype"],
            device=v["model.device"], max_context=v["engine.max_context"] or None,
            weights=None if v["model.weights"] == "auto" else v["model.weights"],
            prefill_chunk=v["engine.prefill_chunk"], block_size=block,
            max_block=max(MAX_BLOCK, block or preset.block_size or 0),
            window=v["speculative.window"] or None, window_seed=v["speculative.window_seed"],
            method=v["speculative.method"] or None, mtp_steps=v["speculative.mtp_steps"] or None,
            dense_backend=v["engine.dense_backend"], prefix_cache=v["engine.prefix_cache"],
            prefix_cache_entries=v["engine.prefix_cache_entries"],
            compile=None if v["engine.compile"] == "auto" else v["engine.compile"],
            threads=v["engine.threads"] or None, max_batch=v["engine.max_batch"] or None)
    except ValueError as exc:
        raise ValueError(f"model/engine parameters: {exc}") from None
    if v["planner.max_new_tokens"] >= engine.max_context:
        raise ValueError(f"planner.max_new_tokens ({v['planner.max_new_tokens']}) must be below "
                         f"the context of {engine.max_context} tokens (engine.max_context)")
    planner = PlannerConfig(
        queue_depth=v["planner.queue_depth"], policy=v["planner.queue_policy"],
        max_task_chars=v["planner.max_task_chars"],
        max_context_chars=v["planner.max_context_chars"],
        images=ImageLimits(max_images=v["planner.max_images"],
                           max_pixels=v["planner.max_image_pixels"],
                           max_bytes=v["planner.max_image_bytes"]),
        max_new_tokens=v["planner.max_new_tokens"], enable_thinking=v["planner.enable_thinking"],
        reasoning_effort=v["planner.reasoning_effort"] or preset.reasoning_effort,
        constrain=v["planner.constrain"], answer_reserve=v["planner.answer_reserve"],
        max_string_tokens=v["planner.max_string_tokens"],
        deadline_s=v["planner.deadline_s"] or None, speculative=v["speculative.enabled"],
        relaxed_thinking=v["speculative.relaxed_thinking"] or preset.relaxed_thinking,
        refusal_hint=preset.refusal_hint, recovery=preset.recovery,
        sampling=sampling_spec(v["planner.sampling"], "planner.sampling") or preset.sampling,
        **_backend(v, preset),
        relaxed_topk=v["speculative.relaxed_topk"], relaxed_delta=v["speculative.relaxed_delta"])
    skills = v["planner.skills_file"]
    skills_path = Path(skills).expanduser() if skills else default_skills_path()
    if not skills_path.is_file():
        raise ValueError(f"planner.skills_file: {skills_path} is not a file")
    return engine, planner, skills_path


def max_batch_bound(values: dict[str, Any]) -> int:
    """The most requests the engine may decode at once under these parameter values, known
    before configure resolves it: engine.max_batch, else the model preset's, else auto's
    choice for model.device (the larger one when that is auto). Sizes the node's executor;
    a preset that cannot be read counts as auto (configure reports it)."""
    from ..planning.presets import auto_max_batch, resolve_model

    v = {**defaults(), **values}
    if v["engine.max_batch"]:
        return v["engine.max_batch"]
    try:
        preset = resolve_model(v["model.preset"]) if v["model.preset"] else None
    except Exception:  # an unknown or unreadable preset: configure says so, with the reason
        preset = None
    if preset is not None and preset.max_batch:
        return preset.max_batch
    return auto_max_batch(v["model.device"])


def descriptor(param: Param):
    """The rcl_interfaces ParameterDescriptor of `param` (description, read_only, range)."""
    from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor

    desc = ParameterDescriptor(description=param.description, read_only=param.read_only)
    if param.choices:
        desc.additional_constraints = "one of: " + ", ".join(param.choices)
    if param.range is not None and isinstance(param.default, float):
        lo, hi = (float(x) for x in param.range)
        desc.floating_point_range = [FloatingPointRange(from_value=lo, to_value=hi, step=0.0)]
    elif param.range is not None:
        lo, hi = (int(x) for x in param.range)
        desc.integer_range = [IntegerRange(from_value=lo, to_value=hi, step=1)]
    return desc


def declare(node) -> list[str]:
    """Declare every parameter on `node`; returns one message per rejected override.

    A rejected override (wrong type, out of range) leaves the default in place and is
    reported, so the node stays up and configure can fail with the reason.
    """
    errors = []
    for param in PARAMS:
        try:
            node.declare_parameter(param.name, param.default, descriptor(param))
        except Exception as exc:  # rclpy's InvalidParameter{Type,Value}Exception and kin
            hint = ""
            if "'BOOL'" in str(exc) and {"on", "off"} & set(param.choices or ()):
                hint = (f" (ROS reads a bare on or off as a boolean: quote it, "
                        f"-p \"{param.name}:='on'\" or {param.name.split('.')[-1]}: \"on\" "
                        "in a parameter file)")
            errors.append(f"{param.name}: {exc}{hint}")
            node.declare_parameter(param.name, param.default, descriptor(param),
                                   ignore_override=True)
    return errors


def read(node) -> dict[str, Value]:
    """Current values of every parameter declared by `declare`."""
    return {p.name: node.get_parameter(p.name).value for p in PARAMS}
