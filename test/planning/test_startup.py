"""A start-up's progress and its stop (planning/startup.py): what /diagnostics reads while
the node configures, and a cancel that ends a real engine load at its next progress line."""

from __future__ import annotations

import pytest

from flash_planner.engine.config import EngineConfig
from flash_planner.engine.engine import Engine
from flash_planner.engine.progress import ProgressLine
from flash_planner.planning.startup import StartupCancelled, StartupProgress


def test_lines_are_passed_on_and_counted():
    logged: list[str] = []
    startup = StartupProgress(logged.append)
    assert dict(startup.values())["startup phase"] == "loading the model"
    startup("loading weights")
    startup(ProgressLine("compiled the target's 1-row forward (1/5, 2.0 s)", "compiling", 1,
                         5))
    values = dict(startup.values())
    assert logged == ["loading weights", "compiled the target's 1-row forward (1/5, 2.0 s)"]
    assert values["startup phase"] == "compiling" and values["startup steps"] == "1 of 5"
    assert values["startup"] == logged[-1] and float(values["startup seconds"]) >= 0
    startup.enter("warming up the planner")
    values = dict(startup.values())
    assert values["startup phase"] == "warming up the planner"
    assert "startup steps" not in values


def test_a_cancel_raises_at_the_next_line_and_at_a_check():
    startup = StartupProgress(lambda line: None)
    startup("one")
    startup.cancel()
    assert startup.cancelled
    with pytest.raises(StartupCancelled):
        startup("two")
    with pytest.raises(StartupCancelled):
        startup.check()
    with pytest.raises(StartupCancelled):
        startup.enter("warming up the planner")


def test_a_cancelled_start_ends_the_engine_load_before_compiling(checkpoints, tmp_path,
                                                                  graphs_obtained):
    """The compiled engine's load announces its graphs before the first: a start cancelled
    by then raises there, and nothing is compiled."""
    obtained = graphs_obtained()
    lines: list[str] = []
    startup = StartupProgress(lines.append)

    def cancel_at_compile(line: str) -> None:
        if "compiling" in line:
            startup.cancel()
        startup(line)

    config = EngineConfig(model_path=str(checkpoints("hybrid")), device="cpu", dtype="fp32",
                          max_context=256, compile="on", compile_cache=str(tmp_path),
                          max_batch=1)
    with pytest.raises(StartupCancelled):
        Engine.load(config, progress=cancel_at_compile)
    assert obtained == [] and not any("compiled the" in line for line in lines)
