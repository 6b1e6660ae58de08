"""The bad-input table against the node on real rclpy: every request row as a Plan goal, and
a configure that fails on a broken model (model.* parameters are read-only: the fix is a
restart with the right path).

Each refused goal ends ABORTED with the row's error; each answered one ends with a plan or
the reason there is none; after each the node plans the reference task as before.
"""

from __future__ import annotations

import re
import shutil

import pytest
from bad_inputs import REFERENCE_TASK, ROWS
from live import requires_ros, wait_for

from flash_planner.planning.presets import asset_path

pytestmark = requires_ros
GOAL_ROWS = [r for r in ROWS if r.goal]


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

    status, result = node.plan(task=row.task)
    if row.expect:
        assert status == GoalStatus.STATUS_ABORTED and not result.success
        assert re.search(row.expect, result.error), result.error
    elif result.success:
        assert status == GoalStatus.STATUS_SUCCEEDED and result.plan_json
    else:
        assert status == GoalStatus.STATUS_ABORTED and result.error
        assert not result.error.startswith("internal error"), result.error
    status, after = node.plan(task=REFERENCE_TASK)
    assert status == GoalStatus.STATUS_SUCCEEDED
    assert (after.plan_json, after.raw_text) == (reference.plan_json, reference.raw_text)


def test_configure_fails_on_a_truncated_model_and_the_node_keeps_answering(harness, tmp_path):
    from action_msgs.msg import GoalStatus
    from diagnostic_msgs.msg import DiagnosticStatus
    from rclpy.lifecycle import TransitionCallbackReturn

    broken = tmp_path / "target"
    shutil.copytree(asset_path("@assets/demo/target"), broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4096])
    h = harness(**{"model.path": str(broken), "model.drafter_path": ""})
    assert h.node.trigger_configure() == TransitionCallbackReturn.FAILURE
    assert wait_for(lambda: any(s.level == DiagnosticStatus.ERROR
                                and "model.safetensors: not a readable safetensors" in s.message
                                for s in h.statuses()))
    status, result = h.plan()
    assert status == GoalStatus.STATUS_ABORTED and "is unconfigured" in result.error
    assert h.node.trigger_configure() == TransitionCallbackReturn.FAILURE  # retry: same error
