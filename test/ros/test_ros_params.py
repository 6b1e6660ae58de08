"""The parameter table: config/planner.yaml mirrors it, and build_configs turns it into configs."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from local_hub import LocalHub, Repo, hub_env

from flash_planner.ros import params
from flash_planner.ros.params import PARAMS, build_configs

REPO = Path(__file__).resolve().parents[2]
YAML = REPO / "config" / "planner.yaml"
QWEN3_4B = ("Qwen/Qwen3-4B", "z-lab/Qwen3-4B-DFlash-b16")


@pytest.fixture(scope="module", autouse=True)
def qwen3_4b_in_the_cache(tmp_path_factory, checkpoints):
    """The qwen3_4b preset's two repos (tiny stand-ins) in a Hugging Face cache of this
    module's own, fetched through huggingface_hub from a loopback Hub; returns the cache."""
    cache = tmp_path_factory.mktemp("hf") / "hub"
    repos = {name: Repo.from_dir(checkpoints("dense"), name) for name in QWEN3_4B}
    with LocalHub(repos) as hub, hub_env(cache, hub.endpoint):
        from flash_planner.planning import sources

        for name in QWEN3_4B:
            sources.resolve(name, allow_download=True)
    with hub_env(cache):
        yield cache


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        out.update(_flatten(value, f"{name}.") if isinstance(value, dict) else {name: value})
    return out


def test_yaml_covers_every_parameter_with_the_table_default():
    data = yaml.safe_load(YAML.read_text())
    assert list(data) == ["/**"] and list(data["/**"]) == ["ros__parameters"]
    values = _flatten(data["/**"]["ros__parameters"])
    assert sorted(values) == sorted(p.name for p in PARAMS)
    for p in PARAMS:
        # ROS parameters are strictly typed: 0 is not a valid value for a float parameter.
        assert type(values[p.name]) is type(p.default), p.name
        assert values[p.name] == p.default, p.name


def test_table_is_well_formed():
    names = [p.name for p in PARAMS]
    assert len(names) == len(set(names))
    groups = {n.split(".")[0] for n in names if "." in n}
    assert groups == {"model", "engine", "speculative", "planner", "execution", "diagnostics",
                      "qos"}
    for p in PARAMS:
        assert p.description and type(p.default) in (bool, int, float, str), p.name
        assert params.check(p, p.default) == p.default  # defaults pass their own checks
        if p.range is not None:
            assert type(p.default) in (int, float) and p.range[0] <= p.range[1], p.name
    dynamic = {p.name for p in PARAMS if not p.read_only}
    assert dynamic == {"diagnostics.ttft_budget_ms", "diagnostics.latency_budget_ms"}


def test_preset_gives_the_preset_engine_config():
    engine, planner, skills = build_configs({"model.preset": "qwen3_4b"})
    assert "/models--Qwen--Qwen3-4B/snapshots/" in engine.model_path
    assert "/models--z-lab--Qwen3-4B-DFlash-b16/snapshots/" in engine.drafter_path
    assert (engine.dtype, engine.kv_dtype, engine.max_context) == ("bf16", "bf16", 8192)
    assert engine.block_size == 16 and engine.window == 128 and engine.window_seed
    assert planner.policy == "queue" and planner.queue_depth == 4 and planner.deadline_s is None
    assert skills.name == "skills.yaml" and skills.is_file()


def test_path_and_overrides_on_top_of_a_preset(hybrid_dir, tmp_path):
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    skills = tmp_path / "skills.yaml"
    skills.write_text("skills: []\n")
    engine, planner, skills_path = build_configs({
        "model.preset": "qwen3_6_27b", "model.path": str(hybrid_dir),
        "model.drafter_path": str(drafter), "model.dtype": "fp32", "model.device": "cpu",
        "engine.max_context": 1024, "engine.kv_dtype": "fp8", "speculative.block_size": 8,
        "speculative.window": 32, "speculative.window_seed": False,
        "speculative.enabled": False, "speculative.method": "mtp",
        "speculative.mtp_steps": 5, "planner.queue_policy": "preempt",
        "planner.deadline_s": 2, "planner.max_new_tokens": 100,
        "planner.skills_file": str(skills), "planner.enable_thinking": False,
        "planner.reasoning_effort": "low"})
    assert engine.model_path == str(hybrid_dir) and engine.drafter_path == str(drafter)
    assert (engine.dtype, engine.kv_dtype, engine.device) == ("fp32", "fp8", "cpu")
    assert (engine.max_context, engine.block_size, engine.window) == (1024, 8, 32)
    assert not engine.window_seed and (engine.method, engine.mtp_steps) == ("mtp", 5)
    assert not planner.speculative and planner.policy == "preempt"
    assert planner.deadline_s == 2.0 and planner.max_new_tokens == 100
    assert not planner.enable_thinking and skills_path == skills
    assert planner.reasoning_effort == "low"


def test_defaults_use_the_demo_preset():
    engine, _, _ = build_configs({})
    assert engine.model_path.endswith("assets/demo/target")
    assert engine.drafter_path.endswith("assets/demo/drafter")


def test_path_alone_uses_engine_defaults(hybrid_dir):
    engine, _, _ = build_configs({"model.path": str(hybrid_dir), "model.preset": ""})
    assert engine.model_path == str(hybrid_dir) and engine.drafter_path is None
    assert (engine.dtype, engine.max_context, engine.block_size) == ("auto", 4096, None)


def test_large_block_raises_max_block(hybrid_dir):
    engine, _, _ = build_configs({"model.path": str(hybrid_dir), "speculative.block_size": 32})
    assert engine.block_size == 32 and engine.max_block >= 32


def test_no_model_is_a_clear_error():
    with pytest.raises(ValueError, match=r"set model\.preset .* or model\.path"):
        build_configs({"model.preset": ""})


@pytest.mark.parametrize("values, name", [
    ({"model.preset": "no_such_preset"}, "model.preset"),
    ({"model.path": "/nonexistent/model"}, "model.path"),
    ({"model.preset": "qwen3_4b", "model.drafter_path": "/nonexistent"}, "model.drafter_path"),
    ({"model.preset": "qwen3_4b", "model.dtype": "int4"}, "model.dtype"),
    ({"model.preset": "qwen3_4b", "model.device": "tpu"}, "model.device"),
    ({"model.preset": "qwen3_4b", "engine.kv_dtype": "int8"}, "engine.kv_dtype"),
    ({"model.preset": "qwen3_4b", "engine.dense_backend": "vulkan"}, "engine.dense_backend"),
    ({"model.preset": "qwen3_4b", "engine.prefill_chunk": 0}, "engine.prefill_chunk"),
    ({"model.preset": "qwen3_4b", "speculative.block_size": 1}, "speculative.block_size"),
    ({"model.preset": "qwen3_4b", "speculative.enabled": 1}, "speculative.enabled"),
    ({"model.preset": "qwen3_4b", "speculative.method": "eagle"}, "speculative.method"),
    ({"model.preset": "qwen3_4b", "speculative.mtp_steps": 16}, "speculative.mtp_steps"),
    ({"model.preset": "qwen3_4b", "planner.queue_policy": "lifo"}, "planner.queue_policy"),
    ({"model.preset": "qwen3_4b", "planner.queue_depth": 0}, "planner.queue_depth"),
    ({"model.preset": "qwen3_4b", "planner.deadline_s": -1.0}, "planner.deadline_s"),
    ({"model.preset": "qwen3_4b", "planner.max_new_tokens": 9000}, "planner.max_new_tokens"),
    ({"model.preset": "qwen3_4b", "planner.skills_file": "/nonexistent.yaml"},
     "planner.skills_file"),
    ({"model.preset": "qwen3_4b", "planner.max_task_chars": "2000"}, "planner.max_task_chars"),
    ({"model.preset": "qwen3_4b", "diagnostics.window": 0}, "diagnostics.window"),
])
def test_errors_name_the_parameter(values, name):
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        build_configs(values)


def test_unknown_parameter_is_refused():
    with pytest.raises(ValueError, match="unknown parameter"):
        build_configs({"model.preset": "qwen3_4b", "model.presett": "x"})


def test_sampling_comes_from_the_parameter_or_the_preset():
    _, planner, _ = build_configs({"planner.sampling": '{"thinking": "card"}'})
    assert planner.sampling == {"thinking": "card"}
    _, planner, _ = build_configs({"model.preset": "qwen3_4b"})
    assert planner.sampling == {"thinking": "card", "answer": {"temperature": 0}}
    assert build_configs({})[1].sampling == "model"                   # the demo preset's
    with pytest.raises(ValueError, match="planner.sampling is not valid JSON"):
        build_configs({"planner.sampling": '{"temperature": '})
    with pytest.raises(ValueError, match="planner.sampling: temperature must be a number"):
        build_configs({"planner.sampling": '{"temperature": -2}'})
    with pytest.raises(ValueError, match="relaxed thinking acceptance is defined for greedy"):
        build_configs({"planner.sampling": "card", "speculative.relaxed_thinking": True})


def test_dense_backend_reaches_the_engine_config():
    for backend in ("torch", "onnxruntime", "tensorrt", "auto"):
        engine, _, _ = build_configs({"model.preset": "qwen3_4b",
                                      "engine.dense_backend": backend})
        assert engine.dense_backend == backend


def test_constrain_and_the_presets_refusal_hint_reach_the_planner_config(hybrid_dir):
    _, planner, _ = build_configs({})
    assert planner.constrain is True and planner.refusal_hint is True    # the demo preset
    _, planner, _ = build_configs({"planner.constrain": False, "model.preset": "",
                                   "model.path": str(hybrid_dir)})
    assert planner.constrain is False and planner.refusal_hint is True


def test_max_batch_reaches_the_engine_config():
    engine, _, _ = build_configs({"engine.max_batch": 4})
    assert engine.max_batch == 4
    engine, _, _ = build_configs({})
    assert engine.max_batch == 0                       # auto: resolved per device at load
    with pytest.raises(ValueError, match=r"engine\.max_batch"):
        build_configs({"engine.max_batch": -1})


def test_max_batch_bound_is_known_before_configure(monkeypatch):
    from dataclasses import replace

    from flash_planner.engine.config import AUTO_MAX_BATCH
    from flash_planner.planning import presets

    bound = params.max_batch_bound
    assert bound({"engine.max_batch": 3}) == 3
    assert bound({"model.device": "cpu"}) == AUTO_MAX_BATCH[0]      # the demo preset: auto
    assert bound({"model.device": "cuda:1"}) == AUTO_MAX_BATCH[1]
    assert bound({}) == max(AUTO_MAX_BATCH)                          # device auto
    assert bound({"model.preset": "no_such_preset", "model.device": "cpu"}) == \
        AUTO_MAX_BATCH[0]
    demo = presets.ModelPreset.load("demo")
    monkeypatch.setattr(presets.ModelPreset, "load",
                        classmethod(lambda cls, name: replace(demo, max_batch=5)))
    assert bound({"model.device": "cpu"}) == 5                       # the preset's
    assert bound({"engine.max_batch": 2}) == 2                       # the parameter first


def test_the_executor_has_a_thread_per_goal_in_flight_and_spares(monkeypatch):
    from flash_planner.ros import node

    monkeypatch.setattr(node.os, "cpu_count", lambda: 2)
    values = {**params.defaults(), "engine.max_batch": 6, "planner.queue_depth": 10}
    assert node.executor_threads(values) == 6 + 10 + node.SPARE_THREADS + node.EXECUTION_THREADS
    monkeypatch.setattr(node.os, "cpu_count", lambda: 64)
    assert node.executor_threads(values) == 64
