"""Several ~/plan goals at once on real rclpy: engine.max_batch goals decode together, each
with its own feedback, steps, result and cancel; beyond the slots, the queue and its limit.

Nothing here rests on timings. Whether goals overlap is decided by a gate on the planner's
decoding cycles (`CycleGate`): while it is closed the scheduler runs no cycle (it comes back
for the next), so the test first sees every goal in flight, then lets them decode. Plans come
from the embedded demo model; the admission test uses the tiny model that never ends by
itself (conftest.endless_dir), so its goals stay in flight until cancelled.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
from live import ENDLESS_TOKENS, MISSING, TIMEOUT, requires_ros, result_of, values_of, wait_for

from flash_planner.planning.presets import default_skills_path
from flash_planner.planning.skills import SkillCatalog

if MISSING is None:
    from action_msgs.msg import GoalStatus

pytestmark = requires_ros
TASKS = ("bring the red cup from the kitchen table to the sink", "open the fridge",
         "open the drawer", "pick up the red cup and place it on the kitchen table")
LONGEST = 0   # the index of the task whose plan takes the most cycles (cancelled below)


class CycleGate:
    """Holds the planner's decoding cycles while `open` is clear: the batch's step is
    skipped, and the scheduler loops back to it (admitting new requests meanwhile)."""

    def __init__(self, monkeypatch, service):
        self.open = threading.Event()
        self.service = service
        step = service.batch.step

        def gated() -> None:
            if self.open.is_set():
                step()
            else:
                time.sleep(0.002)   # no cycle now; not a wait on any outcome

        monkeypatch.setattr(service.batch, "step", gated)


@pytest.fixture
def gate(monkeypatch):
    """A factory of closed gates on a harness's planner; every gate opens at teardown (before
    the harness stops the planner, which needs cycles to end what is in flight)."""
    made = []

    def make(h) -> CycleGate:
        made.append(CycleGate(monkeypatch, h.node._planner))
        return made[-1]

    yield make
    for g in made:
        g.open.set()


class Goal:
    """One goal of a test: its handle, the feedback it received, its first feedback."""

    def __init__(self, h, task: str, events: list, lock: threading.Lock, index: int):
        self.h, self.task, self.feedback, self.first = h, task, [], threading.Event()

        def on_feedback(msg) -> None:
            with lock:
                if not self.first.is_set():
                    events.append(("feedback", index))
                self.feedback.append(msg.feedback)
            self.first.set()

        self.handle = h.goal(task=task, on_feedback=on_feedback)
        self.id = bytes(self.handle.goal_id.uuid).hex()
        self.result_future = self.handle.get_result_async()

        def on_result(_) -> None:
            with lock:
                events.append(("result", index))

        self.result_future.add_done_callback(on_result)

    def response(self):
        return result_of(self.result_future)

    def text(self, result) -> str:
        """The goal's feedback text, once every message up to its result has arrived (read
        from the topic: the client's callback may miss the last, `Harness.feedback_of`)."""
        def counts() -> list[int]:
            return [f.tokens_so_far for f in self.h.feedback_of(self.handle)]

        assert wait_for(lambda: counts()[-1:] == [result.telemetry.new_tokens], 30), (
            self.task, result.error, result.telemetry.new_tokens, counts())
        return "".join(f.delta_text for f in self.h.feedback_of(self.handle))

    def streamed_steps(self) -> list:
        return [(i, json.loads(s)) for f in self.h.feedback_of(self.handle)
                for i, s in zip(f.step_indices, f.steps_json)]


def _four_goals(h) -> tuple[list[Goal], list]:
    events: list = []
    lock = threading.Lock()
    goals = [Goal(h, task, events, lock, i) for i, task in enumerate(TASKS)]
    service = h.node._planner
    assert wait_for(lambda: service.running == len(TASKS)), \
        f"never all in flight: {service.load_report()}"
    return goals, events


def _succeeded_with_its_own_plan(goal: Goal, skills: set[str]):
    response = goal.response()
    result = response.result
    assert response.status == GoalStatus.STATUS_SUCCEEDED, (goal.task, result.error)
    assert result.success and result.telemetry.request_id == goal.id
    steps = json.loads(result.plan_json)["plan"]
    assert steps and {step["skill"] for step in steps} <= skills
    # its feedback carried its own text only, and its steps as they closed, in order
    assert goal.text(result) == result.raw_text, goal.task
    assert goal.streamed_steps() == list(enumerate(steps)), goal.task
    return result


def test_four_goals_decode_at_once_each_with_its_own_feedback_and_result(harness, gate):
    h = harness(**{"engine.max_batch": 4})
    h.bring_up()
    skills = set(SkillCatalog.from_yaml(default_skills_path()).names)
    g = gate(h)
    goals, events = _four_goals(h)
    # all four in flight at once, none decoded yet: /diagnostics says so
    n = len(h.statuses())
    assert wait_for(lambda: any(values_of(s).get("requests running") == "4"
                                for s in h.statuses()[n:]))
    values = next(values_of(s) for s in h.statuses()[n:]
                  if values_of(s).get("requests running") == "4")
    assert (values["requests queued"], values["max batch"]) == ("0", "4")
    assert not any(goal.feedback for goal in goals)
    g.open.set()
    results = [_succeeded_with_its_own_plan(goal, skills) for goal in goals]
    # they decoded together: each goal's first feedback came before any goal's result
    # (the batch prefills every newcomer in its first cycle; a plan takes many cycles)
    assert wait_for(lambda: [kind for kind, _ in events].count("result") == len(goals), 30)
    first_result = next(i for i, (kind, _) in enumerate(events) if kind == "result")
    assert sorted(i for kind, i in events[:first_result] if kind == "feedback") == [0, 1, 2, 3]
    # ... and each result is its own task's: the plan it gets alone (greedy decoding)
    for goal, result in zip(goals, results):
        status, alone = h.plan(task=goal.task)
        assert status == GoalStatus.STATUS_SUCCEEDED, alone.error
        assert (alone.raw_text, alone.plan_json) == (result.raw_text, result.plan_json)
    # the batch's tokens per second showed on /diagnostics while they decoded
    assert wait_for(lambda: any(float(values_of(s)["batch tokens per s"]) > 0
                                for s in h.statuses()[n:]))


def test_feedback_is_published_and_read_deep_enough_for_every_goal_at_once(harness,
                                                                         monkeypatch):
    """A feedback message holds only the text since the last, and one topic carries every
    goal's: the server publishes it 1000 deep, and the harness's client reads it so (at
    rclpy's default of 10 a goal's last message was lost under load, once in several runs of
    the test above). Discovery does not report a history depth, so the servers' are read
    where the node makes them: ~/plan's, and ~/execute's (a step's events are few, but a lost
    one is a state a client never sees)."""
    import rclpy.action

    from flash_planner.ros.action_server import FEEDBACK_DEPTH

    made, real = [], rclpy.action.ActionServer

    def recording(*args, **kwargs):
        made.append((args[1].__name__, kwargs.get("feedback_pub_qos_profile")))
        return real(*args, **kwargs)

    monkeypatch.setattr(rclpy.action, "ActionServer", recording)
    h = harness(**{"engine.max_batch": 4})
    h.bring_up()
    assert {name: qos.depth if qos else None for name, qos in made} == {
        "Plan": FEEDBACK_DEPTH, "ExecutePlan": FEEDBACK_DEPTH}
    status, result = h.plan(task="open the fridge")      # and it serves through it
    assert status == GoalStatus.STATUS_SUCCEEDED, result.error


def test_cancelling_one_of_four_goals_leaves_the_others_decoding(harness, gate):
    h = harness(**{"engine.max_batch": 4})
    h.bring_up()
    skills = set(SkillCatalog.from_yaml(default_skills_path()).names)
    g = gate(h)
    goals, _ = _four_goals(h)
    target = goals[LONGEST]
    # hold the cycles again right after the target's first feedback (its prefill token; the
    # cycle under way finishes): it is decoding, and far from its plan's end
    action = h.node._action
    publish = action._feedback

    def feedback(goal_handle, fb) -> None:
        if fb.request_id == target.id:
            g.open.clear()
        publish(goal_handle, fb)

    action._feedback = feedback
    g.open.set()
    assert target.first.wait(TIMEOUT)
    cancel = result_of(target.handle.cancel_goal_async())
    assert len(cancel.goals_canceling) == 1
    action._feedback = publish
    g.open.set()
    response = target.response()
    assert response.status == GoalStatus.STATUS_CANCELED, response.result.error
    result = response.result
    assert "cancel" in result.error and result.telemetry.finish_reason == "cancelled"
    assert result.telemetry.request_id == target.id
    assert result.telemetry.new_tokens > 0 and target.text(result) == result.raw_text
    others = [goal for goal in goals if goal is not target]
    for goal in others:
        _succeeded_with_its_own_plan(goal, skills)
    assert wait_for(lambda: any(values_of(s).get("requests cancelled") == "1"
                                and values_of(s).get("requests ok") == "3"
                                for s in h.statuses()))


def test_beyond_the_slots_goals_queue_then_are_refused(endless):
    h = endless(**{"engine.max_batch": 2, "planner.queue_depth": 1})
    service = h.node._planner
    running = [h.running_goal(), h.running_goal()]   # both decode: each gave feedback
    started = threading.Event()
    queued = h.goal(max_new_tokens=ENDLESS_TOKENS, thinking=False,
                    on_feedback=lambda _: started.set())
    assert wait_for(lambda: service.queue_depth == 1)
    n = len(h.statuses())
    assert wait_for(lambda: any(values_of(s).get("requests queued") == "1"
                                for s in h.statuses()[n:]))
    values = next(values_of(s) for s in h.statuses()[n:]
                  if values_of(s).get("requests queued") == "1")
    assert (values["requests running"], values["max batch"]) == ("2", "2")
    assert values["queue depth"] == "1"
    status, result = h.plan(max_new_tokens=8, thinking=False)
    assert status == GoalStatus.STATUS_ABORTED
    assert result.error == "queue full (1 requests waiting, 2 running)"
    assert not started.is_set()                       # queued: no feedback yet
    # a slot frees: the queued goal starts, the other running one goes on
    result_of(running[0].cancel_goal_async())
    assert result_of(running[0].get_result_async()).status == GoalStatus.STATUS_CANCELED
    assert started.wait(TIMEOUT)
    assert service.running == 2 and service.queue_depth == 0
    for handle in (running[1], queued):
        result_of(handle.cancel_goal_async())
        response = result_of(handle.get_result_async())
        assert response.status == GoalStatus.STATUS_CANCELED
        assert 0 < response.result.telemetry.new_tokens < ENDLESS_TOKENS


def test_reject_policy_refuses_a_goal_when_every_slot_is_taken(endless):
    h = endless(**{"engine.max_batch": 2, "planner.queue_policy": "reject"})
    running = [h.running_goal(), h.running_goal()]
    status, result = h.plan(max_new_tokens=8, thinking=False)
    assert status == GoalStatus.STATUS_ABORTED
    first = bytes(running[0].goal_id.uuid).hex()
    assert result.error == (f"busy with request {first} and every other slot "
                            "(max_batch 2; queue policy 'reject')")
    for handle in running:
        result_of(handle.cancel_goal_async())
        assert result_of(handle.get_result_async()).status == GoalStatus.STATUS_CANCELED
