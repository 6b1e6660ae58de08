"""The bad-input table's request rows against the node on real rclpy, as Plan goals (a
configure that fails on a broken model is test_node_lifecycle's).

Each refused goal ends ABORTED with the row's error; each answered one ends with a plan or
the reason there is none; after each the node plans the reference task as before.
"""

from __future__ import annotations

import json
import re

import pytest
import soak
from bad_inputs import REFERENCE_TASK, ROWS
from live import requires_ros

from flash_planner.planning.presets import default_skills_path
from flash_planner.planning.skills import SkillCatalog

pytestmark = requires_ros
GOAL_ROWS = [r for r in ROWS if r.goal]


def _skills() -> list[str]:
    return SkillCatalog.from_yaml(default_skills_path()).names


@pytest.fixture(scope="module")
def node(ros_context):
    from live import Harness

    h = Harness(ros_context)
    h.bring_up()
    yield h
    h.close()


@pytest.fixture(scope="module")
def reference(node):
    from action_msgs.msg import GoalStatus

    status, result = node.plan(task=REFERENCE_TASK)
    assert status == GoalStatus.STATUS_SUCCEEDED, result.error
    return result


@pytest.mark.parametrize("row", GOAL_ROWS, ids=[r.id for r in GOAL_ROWS])
def test_bad_goal_row(node, reference, row):
    from action_msgs.msg import GoalStatus

    status, result = node.plan(task=row.task, scene=list(row.scene))
    if row.expect:
        assert status == GoalStatus.STATUS_ABORTED and not result.success
        assert re.search(row.expect, result.error), result.error
    else:
        expected = GoalStatus.STATUS_SUCCEEDED if result.success else GoalStatus.STATUS_ABORTED
        plan = json.loads(result.plan_json)["plan"] if result.success else None
        assert status == expected
        assert soak.answer_problem(result.success, plan, result.error,
                                   result.telemetry.finish_reason, _skills()) is None
    status, after = node.plan(task=REFERENCE_TASK)
    assert status == GoalStatus.STATUS_SUCCEEDED
    assert (after.plan_json, after.raw_text) == (reference.plan_json, reference.raw_text)
