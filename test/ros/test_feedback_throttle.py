"""FeedbackThrottle: at most one Plan feedback per period, nothing lost in between;
StepEventThrottle: ExecutePlan's state changes all at once, a server's feedback at most once
per period (the latest kept)."""

from __future__ import annotations

from flash_planner.planning.execution import StepEvent
from flash_planner.planning.service import PlanFeedback
from flash_planner.ros.action_server import FeedbackThrottle
from flash_planner.ros.execute_feedback import StepEventThrottle


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _fb(text: str, tokens: int) -> PlanFeedback:
    return PlanFeedback("r1", text, tokens, float(tokens), 1.5)


def test_first_goes_out_at_once_then_one_per_period_merging_text():
    clock, sent = Clock(), []
    throttle = FeedbackThrottle(sent.append, 0.05, clock)
    throttle.put(_fb("a", 1))
    assert [f.delta_text for f in sent] == ["a"]
    clock.now = 0.01
    throttle.put(_fb("b", 3))
    clock.now = 0.02
    throttle.put(_fb("c", 5))
    assert len(sent) == 1                       # held back, merged
    clock.now = 0.06
    throttle.put(_fb("d", 7))
    assert [f.delta_text for f in sent] == ["a", "bcd"]
    assert sent[-1].tokens_so_far == 7          # the latest counters
    clock.now = 0.07
    throttle.put(_fb("e", 9))
    throttle.flush()
    throttle.flush()                            # nothing left: no empty message
    assert [f.delta_text for f in sent] == ["a", "bcd", "e"]
    assert "".join(f.delta_text for f in sent) == "abcde"


def test_zero_period_publishes_every_feedback():
    clock, sent = Clock(), []
    throttle = FeedbackThrottle(sent.append, 0.0, clock)
    for i, text in enumerate("xyz"):
        throttle.put(_fb(text, i + 1))
    throttle.flush()
    assert [f.delta_text for f in sent] == ["x", "y", "z"]


def test_a_closed_step_goes_out_at_once_with_what_was_held_back():
    clock, sent = Clock(), []
    throttle = FeedbackThrottle(sent.append, 1.0, clock)
    throttle.put(_fb("a", 1))
    clock.now = 0.01
    throttle.put(PlanFeedback("r1", "b", 3, 3.0, 1.5, steps=((0, {"skill": "x"}),)))
    clock.now = 0.02
    throttle.put(_fb("c", 5))
    clock.now = 0.03
    throttle.put(PlanFeedback("r1", "d", 7, 7.0, 1.5, steps=((1, {"skill": "y"}),)))
    assert [(f.delta_text, f.steps) for f in sent] == [
        ("a", ()), ("b", ((0, {"skill": "x"}),)), ("cd", ((1, {"skill": "y"}),))]


def _ev(state: str, step: int = 0, message=None, plan: int = 0) -> StepEvent:
    return StepEvent(plan, step, "navigate_to", state, "", message)


def _seen(sent: list[StepEvent]) -> list[tuple]:
    return [(e.plan_index, e.step_index, e.state, e.message) for e in sent]


def test_step_states_go_out_at_once_and_server_feedback_is_coalesced_to_the_latest():
    clock, sent = Clock(), []
    throttle = StepEventThrottle(sent.append, 0.05, clock)
    throttle.put(_ev("sent"))
    throttle.put(_ev("running", message=5))         # the first after a change: at once
    for i, t in enumerate((0.01, 0.02, 0.03)):
        clock.now = t
        throttle.put(_ev("running", message=4 - i))  # held, each replacing the last
    assert _seen(sent) == [(0, 0, "sent", None), (0, 0, "running", 5)]
    clock.now = 0.06
    throttle.put(_ev("running", message=1))          # the period is over: the latest goes
    clock.now = 0.07
    throttle.put(_ev("running", message=0))          # held ...
    throttle.put(_ev("succeeded"))                   # ... and flushed before the change
    throttle.put(_ev("sent", step=1))
    assert _seen(sent)[2:] == [(0, 0, "running", 1), (0, 0, "running", 0),
                               (0, 0, "succeeded", None), (0, 1, "sent", None)]


def test_a_finished_steps_feedback_is_dropped():
    clock, sent = Clock(), []
    throttle = StepEventThrottle(sent.append, 1.0, clock)
    throttle.put(_ev("sent"))
    throttle.put(_ev("failed"))
    throttle.put(_ev("running", message="late"))     # rclpy: feedback after the result
    throttle.put(_ev("replanning", step=-1, plan=1))
    throttle.put(_ev("sent", plan=1))
    throttle.put(_ev("running", message="old plan's step, later still"))
    throttle.put(_ev("running", plan=1, message="now"))
    clock.now = 0.1
    throttle.put(_ev("running", plan=1, message="held"))
    throttle.close()                                 # what is held goes out, then nothing
    throttle.put(_ev("running", plan=1, message="after the result"))
    throttle.put(_ev("succeeded", plan=1))
    assert [(e.plan_index, e.state, e.message) for e in sent] == [
        (0, "sent", None), (0, "failed", None), (1, "replanning", None), (1, "sent", None),
        (1, "running", "now"), (1, "running", "held")]


def test_zero_period_relays_every_server_feedback():
    clock, sent = Clock(), []
    throttle = StepEventThrottle(sent.append, 0.0, clock)
    throttle.put(_ev("sent"))
    for i in range(3):
        throttle.put(_ev("running", message=i))
    assert [e.message for e in sent] == [None, 0, 1, 2]
