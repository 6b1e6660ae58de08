"""The lifecycle node's own logic on stand-in ROS modules (conftest.fake_ros) and tiny models.

Transitions, parameters, topics, the action's goal/cancel/execute callbacks and diagnostics
run for real here; only rclpy's plumbing is replaced. test_node_runtime.py repeats the
important paths on real rclpy where ROS 2 is installed.
"""

from __future__ import annotations

import json
import threading

import pytest

from flash_planner.ros.node import planner_node_class

TIMEOUT = 60
UUID = tuple(range(16))
GOAL_ID = bytes(UUID).hex()


@pytest.fixture
def make_node(fake_ros):
    nodes = []

    def make(**overrides):
        values = {"model.device": "cpu", "model.dtype": "fp32", "autostart": False,
                  "engine.max_context": 2048, **overrides}
        node = planner_node_class()(
            parameter_overrides=[fake_ros.Parameter(k, v) for k, v in values.items()])
        nodes.append(node)
        return node

    yield make
    for node in nodes:
        node.stop_planner()


@pytest.fixture
def active(make_node, hybrid_dir):
    def make(**overrides):
        node = make_node(**{"model.path": str(hybrid_dir), **overrides})
        assert node.trigger_configure().name == "SUCCESS", node.logger.lines
        assert node.trigger_activate().name == "SUCCESS", node.logger.lines
        return node

    return make


def _wait_messages(pub, count: int) -> list:
    for _ in range(int(TIMEOUT / 0.05)):
        if len(pub.messages) >= count:
            return pub.messages
        pub.event.wait(0.05)
    raise AssertionError(f"{pub.topic}: {len(pub.messages)} messages, wanted {count}")


def _goal(fake_ros, task="pick up the cup", max_new_tokens=8):
    return fake_ros.Plan.Goal(task=task, context="", max_new_tokens=max_new_tokens,
                              enable_thinking=False)


def test_configure_without_a_model_fails_and_diagnostics_say_error(make_node):
    node = make_node(**{"model.preset": ""})
    assert node.trigger_configure().name == "FAILURE"
    errors = [text for level, text in node.logger.lines if level == "error"]
    assert len(errors) == 1 and "set model.preset" in errors[0] and "model.path" in errors[0]
    (stat,) = node.updater.run()
    assert stat.level == b"\x02" and stat.message.startswith("model failed to load: no model")
    assert node.updater.hwid == "flash_planner"


def test_rejected_override_fails_configure_naming_it(make_node, hybrid_dir):
    node = make_node(**{"model.path": str(hybrid_dir), "planner.queue_depth": 0})
    assert node.trigger_configure().name == "FAILURE"
    (stat,) = node.updater.run()
    assert stat.level == b"\x02" and "planner.queue_depth" in stat.message


def test_parameters_are_declared_with_descriptors(make_node):
    node = make_node()
    assert node.descriptors["model.path"].read_only
    assert not node.descriptors["diagnostics.ttft_budget_ms"].read_only
    assert node.params["engine.max_context"] == 2048 and node.params["planner.deadline_s"] == 0.0


def test_autostart_configures_and_activates_once(make_node, hybrid_dir):
    node = make_node(**{"model.path": str(hybrid_dir), "autostart": True})
    (timer,) = node.timers
    timer.callback()
    assert timer.cancelled and node.action_server.name == "/flash_planner/plan"
    (stat,) = node.updater.run()
    assert (stat.level, stat.message) == (b"\x00", "no requests yet")
    assert node.trigger_deactivate().name == "SUCCESS"


def test_topics_qos_and_published_results(active, fake_ros):
    node = active()
    plan, telemetry = node.publisher("~/plan"), node.publisher("~/telemetry")
    assert plan.msg_type is fake_ros.String
    assert (plan.qos.depth, plan.qos.durability, plan.qos.reliability) == (
        10, "transient_local", "reliable")
    assert telemetry.qos.reliability == "reliable" and not hasattr(telemetry.qos, "durability")
    (sub,) = node.subscriptions
    assert sub.topic == "~/task" and sub.qos.depth == 10

    sub.callback(fake_ros.String(data=json.dumps({"id": "t1", "task": "pick up the cup",
                                                  "max_new_tokens": 8})))
    (msg,) = _wait_messages(plan, 1)
    out = json.loads(msg.data)
    assert out["id"] == "t1" and out["success"] is False and out["error"]
    assert out["telemetry"]["new_tokens"] > 0
    (tele,) = _wait_messages(telemetry, 1)
    assert tele.request_id == "t1" and tele.new_tokens == out["telemetry"]["new_tokens"]
    assert tele.stamp.sec == 1 and tele.finish_reason in ("length", "eos")

    sub.callback(fake_ros.String(data="{not json"))   # handled at once, on this thread
    bad = json.loads(plan.messages[-1].data)
    assert bad["success"] is False and "malformed" in bad["error"]
    assert any(level == "warning" and "malformed" in text for level, text in node.logger.lines)

    (stat,) = node.updater.run()
    values = dict(stat.values)
    assert values["state"] == "active" and values["requests failed"] == "2"
    assert values["window samples"] == "1" and "malformed" in values["last error"]
    assert stat.level in (b"\x00", b"\x01", b"\x02")


def test_action_goal_streams_feedback_and_aborts_without_a_valid_plan(active, fake_ros):
    node = active()
    server = node.action_server
    assert server.goal_callback(_goal(fake_ros)).name == "ACCEPT"
    handle = fake_ros.GoalHandle(fake_ros.Plan, _goal(fake_ros), uuid=UUID)
    server.handle_accepted_callback(handle)
    assert handle.executed
    result = server.execute_callback(handle)
    assert handle.state == "aborted"
    assert not result.success and result.error and result.plan_json == ""
    assert result.telemetry.request_id == GOAL_ID and result.telemetry.stamp.sec == 1
    assert result.telemetry.new_tokens > 0 and result.raw_text
    assert handle.feedback and handle.feedback[-1].tokens_so_far == result.telemetry.new_tokens
    out = json.loads(_wait_messages(node.publisher("~/plan"), 1)[-1].data)
    assert out["id"] == GOAL_ID and out["error"] == result.error


def _run_goal(server, handle) -> dict:
    box: dict = {}
    thread = threading.Thread(target=lambda: box.update(result=server.execute_callback(handle)))
    thread.start()
    box["thread"] = thread
    return box


def test_action_cancel_while_running(active, endless_dir, fake_ros):
    node = active(**{"model.path": str(endless_dir), "engine.max_context": 8192})
    server = node.action_server
    handle = fake_ros.GoalHandle(fake_ros.Plan, _goal(fake_ros, max_new_tokens=4000))
    box = _run_goal(server, handle)
    assert handle.first_feedback.wait(TIMEOUT)
    assert server.cancel_callback(handle).name == "ACCEPT"
    handle.cancel.set()
    box["thread"].join(TIMEOUT)
    result = box["result"]
    assert handle.state == "canceled" and not result.success and "cancel" in result.error
    assert result.telemetry.finish_reason == "cancelled"
    assert 0 < result.telemetry.new_tokens < 4000


def test_goal_cancelled_before_it_started(active, fake_ros):
    node = active()
    handle = fake_ros.GoalHandle(fake_ros.Plan, _goal(fake_ros))
    handle.cancel.set()
    result = node.action_server.execute_callback(handle)
    assert handle.state == "canceled" and result.error == "cancelled before it started"
    assert not handle.feedback


def test_deactivate_ends_running_goals_then_cleanup_frees_the_model(active, endless_dir,
                                                                     fake_ros):
    node = active(**{"model.path": str(endless_dir), "engine.max_context": 8192})
    server, (sub,) = node.action_server, node.subscriptions
    handle = fake_ros.GoalHandle(fake_ros.Plan, _goal(fake_ros, max_new_tokens=4000))
    box = _run_goal(server, handle)
    assert handle.first_feedback.wait(TIMEOUT)
    assert node.trigger_deactivate().name == "SUCCESS"
    box["thread"].join(TIMEOUT)
    assert handle.state == "aborted" and "stopped" in box["result"].error
    assert server.destroyed and sub.destroyed
    assert all(p.destroyed for p in node.publishers)
    (stat,) = node.updater.run()
    assert stat.message == "inactive: not serving requests"
    assert node.trigger_cleanup().name == "SUCCESS"
    assert node._engine is None and node._planner is None
    # configure and activate again: nothing is declared or created twice
    assert node.trigger_configure().name == "SUCCESS"
    assert node.trigger_activate().name == "SUCCESS"
    assert node.action_server is not server and not node.action_server.destroyed
    assert node.trigger_deactivate().name == "SUCCESS"
