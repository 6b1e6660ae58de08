"""The node's lifecycle on real rclpy: transitions, requests outside active, bad parameters."""

from __future__ import annotations

import threading

import pytest
from live import MISSING, requires_ros, result_of, values_of, wait_for

from flash_planner.ros import params

if MISSING is None:
    from action_msgs.msg import GoalStatus
    from diagnostic_msgs.msg import DiagnosticStatus
    from lifecycle_msgs.msg import State, Transition
    from lifecycle_msgs.srv import ChangeState, GetState
    from std_msgs.msg import String

pytestmark = requires_ros


def _worker_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == "flash-planner-worker"]


def test_full_lifecycle_and_configure_again_after_cleanup(harness):
    h = harness()
    h.transition("configure", "activate", "deactivate", "cleanup")
    h.bring_up()   # configure + activate again: nothing declared or created twice
    status, result = h.plan()
    assert status == GoalStatus.STATUS_SUCCEEDED, result.error
    h.transition("shutdown")
    assert not _worker_threads()
    status, result = h.plan()
    assert status == GoalStatus.STATUS_ABORTED
    assert result.error == "the planner node is finalized, not serving requests"


def test_requests_outside_active_are_refused_with_the_reason(harness):
    h = harness()
    status, result = h.plan()
    assert status == GoalStatus.STATUS_ABORTED
    assert result.error.startswith("the planner node is unconfigured, not serving requests: "
                                   "configure and activate it (ros2 lifecycle set")
    h.transition("configure")
    status, result = h.plan()
    assert status == GoalStatus.STATUS_ABORTED and "is inactive" in result.error
    assert "activate it (ros2 lifecycle set /flash_planner" in result.error
    assert wait_for(lambda: h.task_pub.get_subscription_count() > 0, 30)
    h.task_pub.publish(String(data='{"id": "early", "task": "open the fridge"}'))
    assert wait_for(lambda: any(p["id"] == "early" for p in h.plans))
    early = next(p for p in h.plans if p["id"] == "early")
    assert not early["success"] and "is inactive" in early["error"]
    h.transition("activate")
    assert h.plan()[0] == GoalStatus.STATUS_SUCCEEDED
    h.transition("deactivate")
    status, result = h.plan()
    assert status == GoalStatus.STATUS_ABORTED and "is inactive" in result.error


def test_change_state_service_drives_the_lifecycle(harness):
    """What `ros2 lifecycle set` and `ros2 lifecycle get` call."""
    h = harness()
    change = h.client_node.create_client(ChangeState, "/flash_planner/change_state")
    get = h.client_node.create_client(GetState, "/flash_planner/get_state")
    assert change.wait_for_service(timeout_sec=30) and get.wait_for_service(timeout_sec=30)
    for transition in (Transition.TRANSITION_CONFIGURE, Transition.TRANSITION_ACTIVATE):
        request = ChangeState.Request()
        request.transition.id = transition
        assert result_of(change.call_async(request)).success
    state = result_of(get.call_async(GetState.Request())).current_state
    assert state.id == State.PRIMARY_STATE_ACTIVE and state.label == "active"
    assert h.plan()[0] == GoalStatus.STATUS_SUCCEEDED


def test_autostart_reaches_active_and_serves(harness):
    h = harness(autostart=True)
    assert wait_for(lambda: any(values_of(s).get("state") == "active" for s in h.statuses()))
    assert h.plan()[0] == GoalStatus.STATUS_SUCCEEDED


def test_deactivate_ends_a_running_goal_and_stops_the_worker(endless):
    h = endless()
    handle = h.running_goal()
    assert _worker_threads()
    h.transition("deactivate")
    response = result_of(handle.get_result_async())
    assert response.status == GoalStatus.STATUS_ABORTED
    assert response.result.error == "the planner node was deactivated"
    assert not _worker_threads()
    h.transition("cleanup")


def _damaged_demo(how: str):
    """Node overrides for a demo target copy with its model.safetensors damaged `how`, and
    the line /diagnostics must carry (damaged.py)."""
    def make(tmp_path) -> tuple[dict, str]:
        from damaged import damaged_demo

        path, line = damaged_demo(tmp_path / "target", how)
        return {"model.path": str(path), "model.drafter_path": ""}, line
    return make


def _bound_to_a_missing_type(tmp_path):
    catalog = tmp_path / "skills.yaml"
    catalog.write_text("skills:\n  - name: go\n    args: {}\n    action: {type: "
                       "nav2_msgs/action/NavigateToPose, server: /navigate_to_pose}\n")
    return ({"planner.skills_file": str(catalog)},
            "skill go: action type nav2_msgs/action/NavigateToPose is not installed here")


@pytest.mark.parametrize("overrides", [
    lambda _: ({"model.preset": ""}, "no model"),  # nor a model.path
    _damaged_demo("truncated"),                    # the file, then `truncated: the header...`
    _damaged_demo("lying-header"),                 # `the header lies about tensor ...`
    _bound_to_a_missing_type,                      # a binding's type, before the model
], ids=["no-model", "truncated-safetensors", "lying-safetensors-header", "binding-type"])
def test_failed_configure_reports_error_and_the_node_keeps_answering(harness, tmp_path,
                                                                      overrides):
    """Configure fails with one line naming what is wrong (for a damaged checkpoint: the
    file and the cause), which /diagnostics carry as ERROR `model failed to load: ...`."""
    settings, line = overrides(tmp_path)
    h = harness(**settings)
    from rclpy.lifecycle import TransitionCallbackReturn

    assert h.node.trigger_configure() == TransitionCallbackReturn.FAILURE
    expected = f"model failed to load: {line}"
    assert wait_for(lambda: any(s.level == DiagnosticStatus.ERROR
                                and s.message.startswith(expected) for s in h.statuses()))
    message = next(s.message for s in h.statuses() if s.message.startswith(expected))
    assert "\n" not in message and "not a readable safetensors" not in message, message
    status, result = h.plan()
    assert status == GoalStatus.STATUS_ABORTED and "is unconfigured" in result.error
    assert h.node.trigger_configure() == TransitionCallbackReturn.FAILURE  # again: same


def test_a_model_that_fails_its_warm_up_fails_configure_naming_it(harness, tmp_path):
    """NaN weights load but cannot decode: configure fails at the warm-up, /diagnostics say
    ERROR naming the model and the cause in one line, and the node keeps answering."""
    from nan_model import write_nan_demo
    from rclpy.lifecycle import TransitionCallbackReturn

    path = write_nan_demo(tmp_path / "nan-demo")
    h = harness(**{"model.path": str(path), "model.drafter_path": ""})
    assert h.node.trigger_configure() == TransitionCallbackReturn.FAILURE
    assert h.node.phase == "unconfigured"
    expected = (f"model failed to load: warm-up of {path} failed: the model produced "
                "non-finite logits (NaN or Inf) at position ")
    assert wait_for(lambda: any(s.level == DiagnosticStatus.ERROR
                                and s.message.startswith(expected) for s in h.statuses()))
    message = next(s.message for s in h.statuses() if s.message.startswith(expected))
    assert "\n" not in message and "its weights hold NaN or Inf" in message, message
    status, result = h.plan()
    assert status == GoalStatus.STATUS_ABORTED and "is unconfigured" in result.error
    assert h.node.trigger_configure() == TransitionCallbackReturn.FAILURE  # again: same


@pytest.mark.parametrize("name, value, why", [
    ("planner.queue_depth", "four", "type"),
    ("planner.queue_depth", 0, "range"),
    ("planner.deadline_s", 3, "type"),            # an int for a float parameter
    ("diagnostics.ttft_budget_ms", 0.0, "range"),
], ids=["str-for-int", "int-out-of-range", "int-for-float", "float-out-of-range"])
def test_bad_override_fails_configure_naming_the_parameter(harness, name, value, why):
    from rclpy.lifecycle import TransitionCallbackReturn

    h = harness(**{name: value})
    assert h.node.get_parameter(name).value == params.BY_NAME[name].default  # kept
    assert h.node.trigger_configure() == TransitionCallbackReturn.FAILURE
    assert wait_for(lambda: any(s.level == DiagnosticStatus.ERROR and name in s.message
                                for s in h.statuses()))
    status, result = h.plan()  # still answering, with the reason
    assert status == GoalStatus.STATUS_ABORTED and "is unconfigured" in result.error
