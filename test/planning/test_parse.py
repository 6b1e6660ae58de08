"""From model output text to a validated plan, or a precise error."""

from __future__ import annotations

import pytest

from flash_planner.planning.parse import PlanError, parse_plan
from flash_planner.planning.presets import default_skills_path
from flash_planner.planning.skills import SkillCatalog

PLAN = '{"plan": [{"skill": "navigate_to", "args": {"target": "kitchen"}}, ' \
       '{"skill": "pick", "args": {"object": "red cup"}}]}'
STEPS = [{"skill": "navigate_to", "args": {"target": "kitchen"}},
         {"skill": "pick", "args": {"object": "red cup"}}]


@pytest.fixture(scope="module")
def catalog():
    return SkillCatalog.from_yaml(default_skills_path())


@pytest.mark.parametrize("text,thinking", [
    (PLAN, ""),
    (f"<think>The cup is in the kitchen.</think>\n\n{PLAN}", "The cup is in the kitchen."),
    (f"The cup is in the kitchen.\n</think>\n{PLAN}", "The cup is in the kitchen."),
    (f"<think>\n\n</think>\n\n{PLAN}<|im_end|>", ""),
    (f"```json\n{PLAN}\n```", ""),
    (f"Here is the plan: {PLAN} Let me know if you need more.", ""),
], ids=["bare", "think", "think-opened-by-template", "empty-think", "fenced", "trailing"])
def test_valid_answers(catalog, text, thinking):
    steps, got_thinking = parse_plan(text, catalog)
    assert steps == STEPS
    assert got_thinking == thinking


@pytest.mark.parametrize("text,match", [
    ("<think>still thinking about the cup", "thinking never ended"),
    ("I cannot do that.", "not JSON"),
    ('{"plan": [{"skill": "pick", "args": {"object": "cup"}', "not valid JSON"),
    ('{"steps": []}', "'plan' is a required property"),
    ('{"plan": []}', "should be non-empty"),
    ('{"plan": [{"skill": "pick"}]}', r"plan\[0\]: 'args' is a required property"),
    ('{"plan": [{"skill": "fly", "args": {"to": "moon"}}]}', "step 1: unknown skill 'fly'"),
    ('{"plan": [{"skill": "pick", "args": {"object": "a"}}, {"skill": "place", '
     '"args": {"object": "a"}}]}', r"step 2 \(place\): missing argument 'location'"),
    ('{"plan": [{"skill": "pick", "args": {"object": "a", "hand": "left"}}]}',
     r"step 1 \(pick\): unexpected argument 'hand'"),
    ('{"plan": [{"skill": "wait", "args": {"seconds": "five"}}]}',
     r"step 1 \(wait\): argument 'seconds' must be number, got str"),
    ('{"plan": [{"skill": "wait", "args": {"seconds": -3}}]}',
     r"step 1 \(wait\): argument 'seconds'.*minimum"),
    ('{"plan": [{"skill": "pick", "args": {"object": "cup"}}], "note": 1}',
     "Additional properties"),
], ids=["unclosed-think", "prose", "broken-json", "no-plan", "empty-plan", "no-args",
        "unknown-skill", "missing-arg", "extra-arg", "wrong-type", "below-minimum",
        "extra-key"])
def test_invalid_answers_give_precise_errors(catalog, text, match):
    with pytest.raises(PlanError, match=match):
        parse_plan(text, catalog)


def test_truncated_output_says_so(catalog):
    with pytest.raises(PlanError, match="truncated at max_new_tokens"):
        parse_plan(PLAN[:40], catalog, truncated=True)
    with pytest.raises(PlanError, match="truncated at max_new_tokens before"):
        parse_plan("<think>a</think> The plan is", catalog, truncated=True)
