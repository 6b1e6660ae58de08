"""FeedbackThrottle: at most one Plan feedback per period, nothing lost in between."""

from __future__ import annotations

from flash_planner.planning.service import PlanFeedback
from flash_planner.ros.action_server import FeedbackThrottle


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
