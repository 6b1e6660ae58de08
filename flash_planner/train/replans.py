"""Replan examples: a step of a plan failed on the robot, and the prompt's progress section
(`planning.prompt.progress_section`, the one the executor writes) says what was done and
what failed, with the server's reason. The answer is the rest of the plan from the failed
step on: the failed step retried, then the steps after it, never the steps already done.

Made from the default corpus' examples of two or more steps (a one-step plan that failed is
the same task again): the failed step drawn uniformly, its reason from the servers' and
states' pool below, in the words ros/step_clients.py writes. Held out: the same built from
held-out set (a), so neither the tasks' combinations nor their failures were trained on.
"""

from __future__ import annotations

import random
from dataclasses import replace

from ..planning.prompt import progress_section
from .corpus import Example, heldout_sets, rng_for, training_mix

# skill -> the server that runs it in these examples
SERVERS = {"navigate_to": "/navigate_to_pose", "pick": "/manipulate", "place": "/manipulate",
           "open": "/manipulate", "close": "/manipulate", "say": "/speak", "wait": "/wait"}
# (state, what the server said); "{server}" is the step's
REASONS = {
    "navigate_to": [("aborted", "aborted by {server}: no valid path to the goal (error_code "
                     "104)"),
                    ("aborted", "aborted by {server}: the goal is blocked (error_code 105)"),
                    ("timed_out", "{server} gave no result within 120 s (cancel sent; the "
                     "server ended the goal)")],
    "pick": [("aborted", "aborted by {server}: the gripper slipped"),
             ("aborted", "{server} reported success false: nothing there to grasp"),
             ("timed_out", "{server} gave no result within 60 s (cancel sent; the server "
              "ended the goal)")],
    "place": [("aborted", "aborted by {server}: the target surface is occupied"),
              ("aborted", "{server} reported success false: the object fell")],
    "open": [("aborted", "aborted by {server}: the handle is out of reach"),
             ("rejected", "{server} rejected the goal")],
    "close": [("aborted", "aborted by {server}: something blocks the door")],
    "say": [("aborted", "{server} reported success false: the speaker is muted"),
            ("unavailable", "{server} is not on the graph; nothing sent")],
    "wait": [("rejected", "{server} rejected the goal")],
}


def replan_thinking(failed: dict, rest: list[dict], reason: str) -> str:
    skills = ", ".join(s["skill"] for s in rest[1:])
    return (f"The {failed['skill']} step failed ({reason.split(':')[0]}). Try it again"
            + (f", then {skills}." if skills else "."))


def replan_example(example: Example, rng: random.Random) -> Example:
    """`example` (a plan of two or more steps) as a replan after one of its steps failed."""
    plan = example.plan
    k = rng.randrange(len(plan))
    failed = plan[k]
    state, said = rng.choice(REASONS[failed["skill"]])
    reason = f"{state}: {said.format(server=SERVERS[failed['skill']])}"
    rest = plan[k:]
    thinking = (None if example.thinking is None
                else replan_thinking(failed, rest, reason))
    return replace(example, progress=progress_section(plan[:k], failed, reason), plan=rest,
                   thinking=thinking, family=f"replan:{example.family}")


def _replannable(examples: list[Example]) -> list[Example]:
    return [ex for ex in examples if not ex.refusal and len(ex.plan) >= 2]


def training_examples(seed: int, n: int) -> list[Example]:
    """n replan examples from training tasks (a draw of their own)."""
    rng = rng_for(seed, "train-replans")
    pool = _replannable(training_mix(rng, 2 * n))
    return [replan_example(rng.choice(pool), rng) for _ in range(n)]


def heldout_examples(seed: int = 0, n: int = 500) -> list[Example]:
    """n replan examples from held-out set (a)'s tasks."""
    rng = rng_for(seed, "heldout-replans")
    pool = _replannable(heldout_sets(seed, 4 * n)["world"])
    return [replan_example(ex, rng) for ex in rng.sample(pool, min(n, len(pool)))]
