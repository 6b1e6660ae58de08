"""100 requests of bench/soak.py's mix through the planner service on the demo planner.

Every request must end exactly once and as its kind requires (plans identical to the task's
reference, cancels/preempts/deadlines ended by their interrupt or finished, bad text refused,
injected text answered), within one cycle of its interrupt, without memory growth, and the
reference task must plan the same before and after. ros/test_node_soak.py runs the same mix
against the real node.
"""

from __future__ import annotations

import soak

from flash_planner.engine.engine import Engine
from flash_planner.planning.presets import ModelPreset, default_skills_path
from flash_planner.planning.service import PlannerConfig, PlannerService
from flash_planner.planning.skills import SkillCatalog

N = 100


def test_soak_100_requests_through_the_service():
    engine = Engine.load(ModelPreset.load("demo").engine_config(device="cpu", dtype="fp32"))
    service = PlannerService(engine, SkillCatalog.from_yaml(default_skills_path()),
                             PlannerConfig(policy="preempt"))
    service.start()
    try:
        report = soak.run(soak.ServiceDriver(service), N, seed=1)
    finally:
        service.stop()
    print(report)
    assert report["requests"] == N and soak.failures(report) == []
    measured = report["interrupts_measured"]
    assert measured["cancel"] >= 10 and measured["preempt"] >= 5 and measured["deadline"] >= 5
    assert max(report["cycles_after_interrupt_max"].values()) <= 1, report
    assert report["rss_growth_pct"] < 5.0, report
