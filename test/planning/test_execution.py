"""The execution policy (planning/execution.py) without ROS: the order of steps, the gate
before anything is sent, approvals, replans and cancels, against a runner that records what
it is given (the robot's side; the same policy on real rclpy servers is
test/ros/test_node_execute.py)."""

from __future__ import annotations

import threading

import pytest

from flash_planner.planning.execution import (
    Approvals,
    Execution,
    ExecutionConfig,
    PlanFailed,
    StepOutcome,
    steps_of,
)
from flash_planner.planning.parse import PlanError
from flash_planner.planning.skills import SkillCatalog

CATALOG = SkillCatalog.from_dict({
    "workspace": {"frame": "map", "x": [-5, 5], "y": [-5, 5]},
    "skills": [
        {"name": "move", "description": "drive", "args": {"speed": {"type": "number"}},
         "limits": {"v": {"max": 1.0}},
         "action": {"type": "pkg/action/Move", "server": "/move", "goal": {"v": "{speed}"}}},
        {"name": "grip", "description": "grip", "args": {"what": {"type": "string"}},
         "approve": True,
         "action": {"type": "pkg/action/Grip", "server": "/grip", "goal": {"o": "{what}"}}},
        {"name": "note", "description": "plan-only", "args": {}}]})


class Recorder:
    """Runs each step as `ends` says (default: succeeded); keeps the goals it was sent."""

    def __init__(self, ends=(), away=()):
        self.ends, self.away, self.sent = list(ends), set(away), []

    def available(self, binding):
        return binding.server not in self.away

    def run(self, binding, goal, on_feedback, cancelled):
        self.sent.append((binding.skill, goal))
        on_feedback({"progress": 1.0})
        end = self.ends.pop(0) if self.ends else "succeeded"
        if end == "hang":
            cancelled.wait()
            return StepOutcome("canceled", "cancelled")
        if end == "gone":     # the server left the graph while the goal ran
            return StepOutcome("unavailable", f"{binding.server} left the graph",
                               ended=False)
        return StepOutcome(end, f"{end} by {binding.server}")


def _run(steps=None, runner=None, plans=(), config=None, task="", on_event=None):
    asked = []

    def replanner(task, context, scene, progress, cancelled):
        asked.append(progress)
        if not plans[len(asked) - 1:]:
            raise PlanFailed("the planner refused")
        return plans[len(asked) - 1]

    events = []
    execution = Execution("e1", CATALOG, runner or Recorder(), replanner, Approvals(),
                          config or ExecutionConfig(),
                          on_event or events.append)
    return execution.run(task=task, steps=steps), asked, events


MOVE = {"skill": "move", "args": {"speed": 0.5}}


def test_steps_run_in_order_with_their_goals():
    runner = Recorder()
    result, _, events = _run([MOVE, {"skill": "move", "args": {"speed": 0.25}}], runner)
    assert result.success and result.steps_done == 2
    assert runner.sent == [("move", {"v": 0.5}), ("move", {"v": 0.25})]
    assert [(e.step_index, e.state) for e in events] == [
        (0, "sent"), (0, "running"), (0, "succeeded"), (1, "sent"), (1, "running"),
        (1, "succeeded")]


@pytest.mark.parametrize("bad,message", [
    ({"skill": "move", "args": {"speed": 2.0}}, "step 1 (move): v = 2.0 is above its "
                                                 "limit 1.0"),
    ({"skill": "note", "args": {}}, "step 1 (note): the skill has no binding"),
])
def test_nothing_is_sent_when_any_step_fails_the_gate(bad, message):
    runner = Recorder()
    result, _, _ = _run([MOVE, bad], runner)
    assert not result.success and result.failed_state == "gate" and message in result.error
    assert runner.sent == []


def test_a_server_away_is_refused_before_anything_is_sent():
    runner = Recorder(away={"/grip"})
    result, _, _ = _run([MOVE, {"skill": "grip", "args": {"what": "cup"}}], runner)
    assert "action server /grip is not on the graph" in result.error and runner.sent == []


def test_a_failed_step_is_replanned_with_the_progress_section():
    runner = Recorder(ends=["succeeded", "aborted"])
    first = [MOVE, {"skill": "move", "args": {"speed": 0.75}}]
    second = [{"skill": "move", "args": {"speed": 0.75}}]
    result, asked, _ = _run(None, runner, plans=[first, second], task="drive twice")
    assert result.success and result.replans == 1 and result.steps_done == 2
    assert (result.failed_step, result.failed_state, result.error) == (-1, "", "")
    assert result.plans == [first, second]
    assert asked[0] == ""
    assert asked[1] == ('Done: move {"speed": 0.5}\nFailed: move {"speed": 0.75} (aborted: '
                        'aborted by /move)\nPlan the remaining steps.')


def test_replans_stop_at_the_bound_and_a_given_plan_is_not_replanned():
    runner = Recorder(ends=["aborted"] * 4)
    result, asked, _ = _run(None, runner, plans=[[MOVE]] * 4, task="drive",
                            config=ExecutionConfig(max_replans=2))
    assert (result.success, result.replans, len(runner.sent)) == (False, 2, 3)
    result, asked, _ = _run([MOVE], Recorder(ends=["aborted"]))
    assert result.replans == 0 and asked == [] and "is not replanned" in result.error


def test_no_plan_is_a_failure_naming_the_planner():
    result, _, _ = _run(None, plans=[], task="fly")
    assert result.failed_state == "no_plan" and "the planner refused" in result.error


def test_an_approval_decides_and_a_timeout_refuses():
    grip = [{"skill": "grip", "args": {"what": "cup"}}]
    approvals = Approvals()
    runner = Recorder()
    execution = Execution("e2", CATALOG, runner, None, approvals,
                          ExecutionConfig(approval_timeout_s=30))
    answer = threading.Thread(target=lambda: (
        _until(lambda: approvals.waiting()), approvals.answer("", 0, True)))
    answer.start()
    assert execution.run(steps=grip).success
    answer.join()
    assert runner.sent == [("grip", {"o": "cup"})]
    assert approvals.answer("e2", 0, True)[0] is False           # no longer waiting
    runner = Recorder()
    execution = Execution("e3", CATALOG, runner, None, Approvals(),
                          ExecutionConfig(approval_timeout_s=0.05))
    result = execution.run(steps=grip)
    assert result.failed_state == "denied" and "no approval within 0.05 s" in result.error
    assert runner.sent == []


def test_a_cancel_ends_the_running_step_and_sends_nothing_more():
    runner = Recorder(ends=["hang"])
    execution = Execution("e4", CATALOG, runner, None, Approvals(), ExecutionConfig())
    thread = threading.Thread(target=lambda: (_until(lambda: runner.sent), execution.cancel()))
    thread.start()
    result = execution.run(steps=[MOVE, MOVE])
    thread.join()
    assert result.failed_state == "canceled" and len(runner.sent) == 1


def test_a_dry_run_sends_nothing_and_reports_every_goal():
    runner, records = Recorder(), []
    execution = Execution("e5", CATALOG, runner, None, Approvals(),
                          ExecutionConfig(dry_run=True), on_dry_run=records.append)
    assert execution.run(steps=[MOVE]).success
    assert runner.sent == [] and records[0]["goal"] == {"v": 0.5}
    assert records[0]["server"] == "/move"


def test_a_plan_given_as_json_is_validated():
    assert steps_of('[{"skill": "move", "args": {"speed": 0.5}}]', CATALOG) == [MOVE]
    with pytest.raises(PlanError, match="not valid JSON"):
        steps_of("[{", CATALOG)
    with pytest.raises(PlanError, match="fly"):
        steps_of('{"plan": [{"skill": "fly", "args": {}}]}', CATALOG)


def _until(predicate) -> None:
    while not predicate():
        threading.Event().wait(0.01)


def test_a_plan_the_gate_refuses_is_replanned_with_the_refusal_as_its_reason():
    runner = Recorder()
    fast = [MOVE, {"skill": "move", "args": {"speed": 3.0}}]
    result, asked, _ = _run(None, runner, plans=[fast, [MOVE]], task="drive")
    assert result.success and result.replans == 1 and runner.sent == [("move", {"v": 0.5})]
    assert asked[1].startswith('Done: nothing\nFailed: move {"speed": 3.0} (gate: refused by '
                               "the safety gate, nothing sent: step 1 (move): v = 3.0 is "
                               "above its limit 1.0)")


@pytest.mark.parametrize("end", ["unconfirmed", "gone"])
def test_a_step_whose_end_is_not_confirmed_ends_the_run_unreplanned(end):
    runner = Recorder(ends=[end])
    result, asked, _ = _run(None, runner, plans=[[MOVE], [MOVE]], task="drive")
    assert not result.success and result.replans == 0 and len(asked) == 1
    assert result.failed_state == ("unconfirmed" if end == "unconfirmed" else "unavailable")
    assert len(runner.sent) == 1


def test_an_approval_for_another_plans_step_is_refused():
    grip = [{"skill": "grip", "args": {"what": "knife"}}]
    approvals, runner = Approvals(), Recorder(ends=["aborted"])
    plans = [[{"skill": "grip", "args": {"what": "cup"}}], grip]
    answers = []

    def operator():
        _until(lambda: approvals.waiting())
        answers.append(approvals.answer("e6", 0, True, plan_index=0))   # plan 0: the cup
        _until(lambda: [w for w in approvals.waiting() if w[1] == 1])
        answers.append(approvals.answer("e6", 0, True, plan_index=0))   # retried: refused
        answers.append(approvals.answer("e6", 0, False, plan_index=1))

    def replanner(task, context, scene, progress, cancelled):
        return plans.pop(0)

    thread = threading.Thread(target=operator)
    thread.start()
    result = Execution("e6", CATALOG, runner, replanner, approvals,
                       ExecutionConfig(approval_timeout_s=30)).run(task="grip")
    thread.join()
    assert [a[0] for a in answers] == [True, False, True]
    assert "waiting: e6 plan 1 step 0 (grip)" in answers[1][1]
    assert result.failed_state == "denied" and runner.sent == [("grip", {"o": "cup"})]


def test_a_cancel_wins_over_an_approval_that_comes_with_it():
    approvals, runner = Approvals(), Recorder()
    execution = Execution("e7", CATALOG, runner, None, approvals,
                          ExecutionConfig(approval_timeout_s=30))

    def both():
        _until(lambda: approvals.waiting())
        with approvals._cond:         # the two land before the waiting run wakes
            execution.cancel()
            approvals._answers[("e7", 0, 0)] = True
            approvals._cond.notify_all()

    thread = threading.Thread(target=both)
    thread.start()
    result = execution.run(steps=[{"skill": "grip", "args": {"what": "cup"}}])
    thread.join()
    assert result.failed_state == "canceled" and runner.sent == []


def test_a_dry_run_reports_servers_that_are_away_instead_of_refusing():
    runner, records, events = Recorder(away={"/grip"}), [], []
    execution = Execution("e8", CATALOG, runner, None, Approvals(),
                          ExecutionConfig(dry_run=True), events.append, records.append)
    assert execution.run(steps=[MOVE, {"skill": "grip", "args": {"what": "cup"}}]).success
    assert [r["server_available"] for r in records] == [True, False]
    assert "action server /grip is not on the graph now" in events[1].detail
    assert runner.sent == []
