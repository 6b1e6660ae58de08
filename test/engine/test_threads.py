"""The engine's torch threads: chosen at load from `threads` (0 = auto), never torch's
default of every core, and reported."""

from __future__ import annotations

import pytest
import torch

from flash_planner.engine import threads as threads_mod
from flash_planner.engine.config import ConfigError, EngineConfig
from flash_planner.engine.engine import Engine
from flash_planner.engine.threads import apply_threads, choose_threads
from flash_planner.planning.presets import ModelPreset

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture(autouse=True)
def keep_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("cores,expected", [(1, 1), (2, 1), (3, 1), (8, 4), (14, 7)])
def test_auto_on_a_cpu_is_half_the_usable_cores(monkeypatch, cores, expected):
    monkeypatch.setattr(threads_mod, "usable_cores", lambda: cores)
    assert choose_threads(0, CPU) == (expected, f"auto: half of {cores} usable cores")


def test_auto_on_a_gpu_is_one_and_a_setting_or_omp_num_threads_wins(monkeypatch):
    monkeypatch.setattr(threads_mod, "usable_cores", lambda: 16)
    assert choose_threads(0, CUDA)[0] == 1
    assert choose_threads(3, CUDA) == (3, "engine.threads")
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert choose_threads(0, CPU) == (5, "auto: OMP_NUM_THREADS")
    assert choose_threads(0, CUDA) == (5, "auto: OMP_NUM_THREADS")
    assert choose_threads(2, CPU) == (2, "engine.threads")       # the setting over the env
    monkeypatch.setenv("OMP_NUM_THREADS", "lots")                 # not a count: auto's rule
    assert choose_threads(0, CPU) == (8, "auto: half of 16 usable cores")


def test_apply_sets_torch_and_reports_what_is_in_effect():
    other = 2 if torch.get_num_threads() != 2 else 3
    applied = apply_threads(other, CPU)
    assert torch.get_num_threads() == other == applied.intra_op
    assert applied.inter_op == torch.get_num_interop_threads()
    assert str(applied) == f"{other} intra-op, {applied.inter_op} inter-op (engine.threads)"


@pytest.mark.parametrize("bad", [-1, 1.5, "2", True])
def test_a_bad_thread_count_is_refused_by_name(bad):
    with pytest.raises(ConfigError, match="threads must be a non-negative integer"):
        EngineConfig(model_path="x", threads=bad)


def test_the_engine_sets_its_threads_at_load_from_the_preset_or_an_override():
    torch.set_num_threads(2)
    preset = ModelPreset.load("demo")
    engine = Engine.load(preset.engine_config(device="cpu", dtype="fp32", threads=1))
    assert torch.get_num_threads() == 1 and engine.threads.intra_op == 1
    assert engine.threads.why == "engine.threads"
    assert preset.threads == 0 and preset.engine_config().threads == 0     # auto by default
