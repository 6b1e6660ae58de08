"""Grounded arguments (planning/grounding.py): the values the grammar's pattern admits, the
check `parse_plan` applies without the grammar, and the catalog field that asks for them."""

from __future__ import annotations

import itertools
import random
import re

import pytest

from flash_planner.planning.grounding import MAX_WORDS, RequestWords
from flash_planner.planning.parse import PlanError, parse_plan
from flash_planner.planning.skills import CatalogError, SkillCatalog

TASK = "Bring the red Cup from the kitchen table to shelf 2, then go to Anna's desk."
SCENE = "The cup is in the sink; the robot's charger is by the door."


def runs(words):
    return [" ".join(words[i:j]) for i in range(len(words))
            for j in range(i + 1, min(len(words), i + MAX_WORDS) + 1)]


def test_the_pattern_admits_every_short_run_and_nothing_the_check_refuses():
    words = RequestWords.of(TASK, SCENE)
    pattern = re.compile(words.pattern)
    every = runs(words.task) + runs(words.context)
    for run in every:
        lower = run.lower()
        if lower in ("the", "a", "an"):
            assert not pattern.fullmatch(run) and not words.contains(run)
            continue
        assert pattern.fullmatch(run) and pattern.fullmatch(lower), run
        assert words.contains(run) and words.contains(lower), run
    # near misses, crossings and mutations: whatever the pattern admits, the check accepts
    rng = random.Random(0)
    vocab = sorted({w for w in words.task + words.context} | {"spoon", "cupboard", "THE"})
    probes = [" ".join(rng.choices(vocab, k=rng.randint(1, 4))) for _ in range(3000)]
    probes += [r[:-1] for r in every] + [r.upper() for r in every] + ["", " ", "2 then go"]
    admitted = [p for p in probes if pattern.fullmatch(p)]
    assert len(admitted) > 50
    assert all(words.contains(p) for p in admitted)
    assert not pattern.fullmatch("table to shelf 2 then go to")        # 7 words
    assert not pattern.fullmatch("kitchen table to shelf 2 then go to anna's")


def test_the_check_reads_words_modulo_case_punctuation_and_one_article():
    words = RequestWords.of(TASK, SCENE)
    for value in ("red cup", "The Red Cup", "the kitchen table", "shelf 2", "anna's desk",
                  "charger", "shelf 2, then", "a red cup", "table to shelf 2 then go to"):
        assert words.contains(value), value
    for value in ("", "the", "blue cup", "red cups", "cup kitchen", "kitchen  sink",
                  "desk the cup", "sink door"):
        assert not words.contains(value), value
    # a run never crosses from the task into the scene
    assert not words.contains("anna's desk the cup")
    assert RequestWords.of("?!").pattern is None
    assert RequestWords.of("the").pattern is None        # an article alone names nothing


def test_parse_plan_with_the_request_rejects_a_name_it_never_mentioned():
    catalog = SkillCatalog.from_dict({"skills": [
        {"name": "pick", "args": {"object": {"type": "string", "grounded": True}}},
        {"name": "say", "args": {"text": "string"}}]})
    plan = '{"plan": [{"skill": "say", "args": {"text": "on my way"}}, ' \
           '{"skill": "pick", "args": {"object": "%s"}}]}'
    words = RequestWords.of(TASK, SCENE)
    assert parse_plan(plan % "the red cup", catalog, words=words)[0][1]["args"] == \
        {"object": "the red cup"}
    with pytest.raises(PlanError, match=r"^step 2 \(pick\): argument 'object' is 'silver "
                                        r"spoon', which the task and scene never mention$"):
        parse_plan(plan % "silver spoon", catalog, words=words)
    # without the request (a plan read back from a log, say) the names are not checked
    assert parse_plan(plan % "silver spoon", catalog)[0][1]["args"]["object"] == "silver spoon"


@pytest.mark.parametrize("spec, message", [
    ({"type": "integer", "grounded": True}, "'grounded' applies to string arguments"),
    ({"type": "string", "enum": ["a", "b"], "grounded": True}, "without an enum"),
    ({"type": "string", "grounded": "yes"}, "'grounded' must be true or false, got 'yes'"),
])
def test_a_grounded_field_that_cannot_hold_is_a_catalog_error(spec, message):
    with pytest.raises(CatalogError, match=re.escape(message)):
        SkillCatalog.from_dict({"skills": [{"name": "pick", "args": {"object": spec}}]})


def test_the_prompt_does_not_change_when_arguments_are_grounded():
    from flash_planner.planning.prompt import system_prompt
    plain, grounded = (SkillCatalog.from_dict({"skills": [
        {"name": "pick", "args": {"object": {"type": "string", "grounded": g}}}]})
        for g in (False, True))
    assert system_prompt(plain) == system_prompt(grounded)
    assert grounded.has_grounded and not plain.has_grounded


def test_runs_are_bounded_in_number_and_length():
    words = RequestWords.of(" ".join(f"w{i}" for i in range(40)))
    admitted = [" ".join(c) for n in range(1, MAX_WORDS + 2)
                for c in itertools.islice(itertools.combinations(words.task, n), 200)]
    pattern = re.compile(words.pattern)
    for value in admitted:
        contiguous = value in " ".join(words.task) and len(value.split()) <= MAX_WORDS
        assert bool(pattern.fullmatch(value)) == contiguous, value
