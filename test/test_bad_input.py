"""The bad-input table's request rows against the planner service on the demo planner.

Each row gets exactly one result with the documented error (or, for text the catalog cannot
express, an answer that is a valid plan or says why there is none), and the service then
plans the reference task exactly as a fresh one does. The node's version of the same rows
is ros/test_node_bad_input.py; the load-time rows are named in docs/reliability.md's table.
"""

from __future__ import annotations

import re

import pytest
import soak
from bad_inputs import REFERENCE_TASK, ROWS

from flash_planner.engine.engine import Engine
from flash_planner.planning.presets import ModelPreset, default_skills_path
from flash_planner.planning.request import PlanRequest
from flash_planner.planning.service import PlannerConfig, PlannerService
from flash_planner.planning.skills import SkillCatalog

TIMEOUT = 120


@pytest.fixture(scope="module")
def service():
    engine = Engine.load(ModelPreset.load("demo").engine_config(device="cpu", dtype="fp32"))
    service = PlannerService(engine, SkillCatalog.from_yaml(default_skills_path()),
                             PlannerConfig())
    service.results = []
    service.on_result = service.results.append
    service.start()
    yield service
    service.stop()


@pytest.fixture(scope="module")
def reference(service):
    result = service.plan(PlanRequest(REFERENCE_TASK), timeout=TIMEOUT)
    assert result.success, result.error
    return result


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_bad_request_row(service, reference, row):
    before = len(service.results)
    result = service.plan(PlanRequest(row.task, scene=row.scene, id=f"row-{row.id}"),
                          timeout=TIMEOUT)
    if row.expect:
        assert not result.success and re.search(row.expect, result.error), result.error
    else:
        assert soak.answer_problem(result.success, result.plan, result.error,
                                   result.finish_reason, service.catalog.names) is None
    after = service.plan(PlanRequest(REFERENCE_TASK), timeout=TIMEOUT)
    assert after.raw_text == reference.raw_text and after.plan == reference.plan
    mine = [r for r in service.results[before:] if r.request_id == f"row-{row.id}"]
    assert len(mine) == 1   # exactly one terminal outcome
