"""Grounded arguments (planning/grounding.py): the values the grammar's pattern admits, the
check `parse_plan` applies without the grammar, and the catalog field that asks for them."""

from __future__ import annotations

import itertools
import random
import re

import pytest

from flash_planner.planning.grounding import MAX_WORDS, NOT_NAME, RequestWords, quoted_texts
from flash_planner.planning.parse import PlanError, parse_plan
from flash_planner.planning.skills import CatalogError, SkillCatalog

TASK = "Bring the red Cup from the kitchen table to shelf 2, then go to Anna's desk."
SCENE = "The cup is in the sink; the robot's charger is by the door."


def runs(words):
    return [(i, j) for i in range(len(words))
            for j in range(i + 1, min(len(words), i + MAX_WORDS) + 1)]


def test_the_pattern_admits_the_phrases_of_the_request_and_nothing_the_check_refuses():
    words = RequestWords.of(TASK, SCENE)
    pattern = re.compile(words.pattern)
    every = []
    for part, (starts, ends, stops) in zip((words.task, words.context), words.marks):
        for i, j in runs(part):
            run = " ".join(part[i:j])
            every.append(run)
            phrase = starts[i] and ends[j - 1] and not any(stops[i:j - 1])
            inner = {w.lower() for w in part[i + 1:j - 1]}
            assert not (phrase and inner & NOT_NAME - {"the", "a", "an", "of"}), run
            assert not (starts[i] and part[i].lower() in NOT_NAME)
            assert bool(pattern.fullmatch(run)) == phrase, run
            assert bool(pattern.fullmatch(run.lower())) == phrase, run
            assert words.contains(run) == (run.lower() not in ("the", "a", "an")), run
    # near misses, crossings and mutations: whatever the pattern admits, the check accepts
    rng = random.Random(0)
    vocab = sorted({w for w in words.task + words.context} | {"spoon", "cupboard", "THE"})
    probes = [" ".join(rng.choices(vocab, k=rng.randint(1, 4))) for _ in range(3000)]
    probes += [r[:-1] for r in every] + [r.upper() for r in every] + ["", " ", "2 then go"]
    admitted = [p for p in probes if pattern.fullmatch(p)]
    assert len(admitted) > 20
    assert all(words.contains(p) for p in admitted)
    for name in ("red Cup", "red cup", "kitchen table", "shelf 2", "Anna's desk", "cup",
                 "robot's charger", "door", "sink", "Bring the red Cup"):
        assert pattern.fullmatch(name), name
    for name in ("the red cup", "red", "kitchen", "Anna's", "robot's", "then", "from",
                 "shelf 2 then go", "cup from", "table to shelf 2", "cup from the kitchen table"):
        assert not pattern.fullmatch(name), name


def test_the_pattern_holds_whole_names_as_the_json_schema_spec_reads_it():
    # by the spec a `pattern` may match anywhere in the string (jsonschema searches for it;
    # llama.cpp's llama-server gives up on an unanchored one): only its anchors hold names
    from jsonschema import Draft202012Validator

    words = RequestWords.of(TASK, SCENE)
    check = Draft202012Validator({"type": "string", "pattern": words.pattern})
    for name in ("red Cup", "red cup", "kitchen table", "shelf 2", "sink", "robot's charger"):
        assert check.is_valid(name), name
        for around in (f"xx {name} yy", f"the {name}", f"{name} then go", f"{name}!",
                       f"{name}|spoon", f"{name}\n{name}"):
            assert not check.is_valid(around), around
    assert re.fullmatch(r"\^\(.*\)\$", words.pattern) and words.pattern[1] != "^"


@pytest.mark.parametrize("task, context, names, not_names", [
    ("can you fetch the hard kettle and put it on the rear cart?", "",
     ["hard kettle", "kettle", "rear cart", "cart"], ["hard", "rear", "the hard kettle", "it"]),
    ("Put drum 15 into the rubber compartment.", "The rubber compartment is standing open",
     ["drum 15", "rubber compartment"], ["drum", "rubber", "compartment is"]),
    ("Can you carry the soda can to the den?", "", ["soda can", "den"], ["soda", "the den"]),
    ("pick the cup up, put the cup back", "the cup belongs on the desk",
     ["cup"], ["cup up", "cup back", "cup belongs"]),
    ("put the soda can back on the shelf", "", ["soda can", "shelf"],
     ["soda", "soda can back", "soda can back on the shelf"]),
    ("bring me a cup of tea from the kitchen", "", ["cup of tea", "cup", "tea", "kitchen"],
     ["cup of", "tea from the kitchen", "me"]),
    ("Get drawer 2 open!", "", ["drawer 2"], ["drawer", "drawer 2 open"]),
    ("say 'I am bringing the ladder'. Then head to the ceckbacha stockroom", "",
     ["ceckbacha stockroom"], ["ceckbacha", "then", "I", "ladder"]),
    ("bring the cheese from the clipboard corner to the bag corner", "",
     ["cheese", "clipboard corner", "bag corner"], ["from", "clipboard", "bag"]),
    # a word before an article is a verb, not a name's end; a quoted text is to be said
    ("go and grab the damp yogurt, then say \"the dirty bag has arrived\"", "",
     ["damp yogurt"], ["grab", "dirty bag", "dirty bag has arrived", "say the"]),
    ("say 'the cup is on Anna's desk' and close the lid", "the lid: Bob's",
     ["lid", "Bob's"], ["cup", "Anna's desk", "desk"]),
])
def test_a_name_is_a_whole_phrase_of_the_request(task, context, names, not_names):
    pattern = re.compile(RequestWords.of(task, context).pattern)
    for name in names:
        assert pattern.fullmatch(name), name
    for name in not_names:
        assert not pattern.fullmatch(name), name


def test_every_reference_name_of_the_corpus_is_a_phrase_of_its_request():
    from flash_planner.train.corpus import heldout_sets, make_corpus

    sets = heldout_sets(0, 150)
    sets["train"] = make_corpus(0, n_train=600, n_heldout=0)[0]
    for name, examples in sets.items():
        for ex in examples:
            words = RequestWords.of(ex.task, ex.context)
            for step in ex.plan:
                for key in ("target", "object", "location"):
                    value = step["args"].get(key)
                    assert value is None or re.fullmatch(words.pattern, value), (name, ex)
                # a say step says the text the task quotes, when it quotes one
                said = step["args"].get("text")
                assert said is None or not words.quotes or said in words.quotes, (name, ex)


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


@pytest.mark.parametrize("task, quotes", [
    ('Say "I am bringing the cactus". Then drive to row 1.', ("I am bringing the cactus",)),
    ("tell them 'the cup is Anna's' and “back soon”", ("the cup is Anna's", "back soon")),
    ('say " hi " twice: " hi "', ("hi",)),                     # outer blanks, each once
    ('say "" and go', ()),                                      # an empty quote is none
    ("say hello, then go to the dock", ()),                     # unquoted
    ("Anna's cup and Bob's mug", ()),                           # apostrophes are not quotes
])
def test_the_texts_a_task_quotes(task, quotes):
    assert quoted_texts(task) == quotes
    assert RequestWords.of(task, 'the sign says "exit"').quotes == quotes   # the task's alone


def test_a_quoted_text_is_said_word_for_word():
    catalog = SkillCatalog.from_dict({"skills": [
        {"name": "go", "args": {"target": {"type": "string", "grounded": True}}},
        {"name": "say", "args": {"text": {"type": "string", "grounded": "quote"}}}]})
    plan = '{"plan": [{"skill": "go", "args": {"target": "deck"}}, ' \
           '{"skill": "say", "args": {"text": "%s"}}]}'
    quoted = RequestWords.of('Speak the words "the kettle cactus is in cell 18", then go to '
                             'the deck')
    assert parse_plan(plan % "the kettle cactus is in cell 18", catalog, words=quoted)[0][1] \
        == {"skill": "say", "args": {"text": "the kettle cactus is in cell 18"}}
    for said in ("the kettle cargetus is in cell 18", "The kettle cactus is in cell 18",
                 "the kettle cactus is in cell 18 the kettle cactus", "deck"):
        with pytest.raises(PlanError, match=re.escape(
                f"step 2 (say): argument 'text' is {said!r}, which is none of the texts the "
                "task quotes (the kettle cactus is in cell 18)")):
            parse_plan(plan % said, catalog, words=quoted)
    # a task that quotes nothing leaves the text free; without the request it is not checked
    unquoted = RequestWords.of("say good morning, then go to the deck")
    assert parse_plan(plan % "good morning", catalog, words=unquoted)[0][1]["args"] == \
        {"text": "good morning"}
    assert parse_plan(plan % "anything", catalog)[0][1]["args"] == {"text": "anything"}
    # the request's schema: the quoted texts as an enum, else a plain string
    say = catalog.get("say")
    assert say.args_schema(quoted)["properties"]["text"] == \
        {"type": "string", "enum": ["the kettle cactus is in cell 18"]}
    assert say.args_schema(unquoted)["properties"]["text"] == {"type": "string"}
    # a quote is no name: a request with nothing else to name keeps its say skill alone
    only = catalog.plan_schema(RequestWords.of('"hello"'))["properties"]["plan"]["items"]
    assert [s["properties"]["skill"]["const"] for s in only["oneOf"]] == ["say"]


@pytest.mark.parametrize("spec, message", [
    ({"type": "integer", "grounded": True}, "'grounded' applies to string arguments"),
    ({"type": "string", "enum": ["a", "b"], "grounded": True}, "without an enum"),
    ({"type": "string", "grounded": "yes"},
     "'grounded' must be true, false, scene or quote, got 'yes'"),
    ({"type": "integer", "grounded": "quote"}, "'grounded' applies to string arguments"),
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
    # every w-word may end a name ("of" follows it): short runs from one to another are names
    words = RequestWords.of(" of ".join(f"w{i}" for i in range(40)))
    admitted = [" ".join(c) for n in range(1, MAX_WORDS + 2)
                for c in itertools.islice(itertools.combinations(words.task, n), 200)]
    pattern = re.compile(words.pattern)
    text = f" {' '.join(words.task)} "
    for value in admitted:
        contiguous = f" {value} " in text and len(value.split()) <= MAX_WORDS
        name = contiguous and "of" not in (value.split()[0], value.split()[-1])
        assert bool(pattern.fullmatch(value)) == name, value
