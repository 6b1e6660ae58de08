"""Catalogs as robots have them: optional arguments, names from the request's scene list, enums
too long to print, and the example catalog of docs/cli.md ("Your own skill catalog").

Grammar checks walk xgrammar's matcher over the demo's tokenizer and the real Qwen3
vocabulary (`accepts` of test_plan_grammar.py); validation runs `validate_plan` as the planner
does, with the request's words.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from qwen3_tokenizer import DEMO
from test_plan_grammar import accepts, compiler_for

from flash_planner.planning.grounding import RequestWords
from flash_planner.planning.parse import PlanError, validate_plan
from flash_planner.planning.plan_grammar import PlanGrammar
from flash_planner.planning.prompt import build_messages, system_prompt
from flash_planner.planning.skills import CatalogError, SkillCatalog
from flash_planner.train.qwen_vocab import QWEN_VOCAB_SIZE
from flash_planner.train.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "config" / "catalogs" / "mobile_manipulator.yaml"
EXAMPLES = REPO / "config" / "catalogs" / "mobile_manipulator_examples.yaml"
# 300 made-up place names: an enum as long as a building's room list
PLACES = [f"{a}{b} {kind}" for a in ("ka", "lo", "mi", "nu", "pe") for b in ("rt", "sk", "vo")
          for kind in ("hall", "wing", "bay", "room")] * 5
PLACES = [f"{name} {i // 60 + 1}" for i, name in enumerate(PLACES)]


@pytest.fixture(scope="module")
def demo_tok():
    return load_tokenizer(DEMO)


@pytest.fixture(scope="module")
def catalog() -> SkillCatalog:
    """Optional arguments (with and without a default), scene-grounded names and a 300-name
    enum in one catalog."""
    return SkillCatalog.from_dict({"skills": [
        {"name": "pick", "description": "grasp an object",
         "args": {"object": {"type": "string", "grounded": "scene"},
                  "grasp": {"type": "string", "enum": ["top", "side"], "required": False}}},
        {"name": "place", "description": "put the held object down",
         "args": {"object": {"type": "string", "grounded": "scene"},
                  "location": {"type": "string", "grounded": "scene", "required": False}}},
        {"name": "go_to", "description": "drive to a place of the site",
         "args": {"place": {"type": "string", "enum": PLACES}}},
        {"name": "wait", "description": "stand still",
         "args": {"seconds": {"type": "number", "minimum": 0, "default": 5}}},
        {"name": "beep", "description": "beep once", "args": {}},
    ]})


@pytest.fixture(scope="module", params=["demo", "qwen3-real"])
def grammar(request, catalog, demo_tok, qwen_tok):
    if request.param == "demo":
        return PlanGrammar(catalog, compiler_for(demo_tok, 1024))
    return PlanGrammar(catalog, compiler_for(qwen_tok, QWEN_VOCAB_SIZE))


WORDS = RequestWords.of("put the coke in the trash", "",
                        ("coke can|coke", "trash can|trash", "kitchen table|table"))


def plan(*steps) -> dict:
    return {"plan": [{"skill": s, "args": a} for s, a in steps]}


def test_a_300_name_enum_prints_its_count_and_the_prompt_stays_short(catalog, demo_tok):
    prompt = system_prompt(catalog, refusal_hint=True)
    assert "one of 300 values, e.g. 'kart hall 1', 'kart wing 1', 'kart bay 1'" in prompt
    assert PLACES[-1] not in prompt
    assert len(demo_tok.encode(prompt)) < 1000
    assert "pick(object, grasp?: string enum ['top', 'side'])" in prompt
    assert "place(object, location?)" in prompt
    assert "wait(seconds: number minimum 0 = 5)" in prompt


@pytest.mark.parametrize("steps", [
    [("pick", {"object": "coke can"}), ("place", {"object": "coke", "location": "trash"})],
    [("pick", {"object": "coke", "grasp": "side"}), ("place", {"object": "coke can"})],
    [("go_to", {"place": PLACES[299]}), ("wait", {}), ("wait", {"seconds": 2}), ("beep", {})],
])
def test_plans_with_and_without_optional_arguments_validate_and_pass_the_grammar(
        grammar, catalog, steps):
    obj = plan(*steps)
    assert accepts(grammar, json.dumps(obj), words=WORDS)
    validate_plan(obj, catalog, WORDS)


def test_the_validated_plan_carries_full_scene_names_and_defaults(catalog):
    steps = validate_plan(plan(("place", {"object": "Coke", "location": "the trash"}),
                               ("wait", {})), catalog, WORDS)
    assert steps == [{"skill": "place", "args": {"object": "coke can", "location": "trash can"}},
                     {"skill": "wait", "args": {"seconds": 5}}]


def test_a_name_outside_the_scene_list_is_impossible_and_an_error(grammar, catalog):
    # "bottle" is neither listed nor a short form; "trash" inside "trash can" is declared
    obj = plan(("pick", {"object": "bottle"}))
    assert not accepts(grammar, json.dumps(obj), words=WORDS)
    with pytest.raises(PlanError, match=r"step 1 \(pick\): argument 'object' is 'bottle', "
                       r"which is not in the scene list \(nearest: "):
        validate_plan(obj, catalog, WORDS)
    with pytest.raises(PlanError, match=r"'coke bottle'.*nearest: coke can"):
        validate_plan(plan(("pick", {"object": "coke bottle"})), catalog, WORDS)


def test_without_a_scene_list_a_scene_argument_takes_the_tasks_words(grammar, catalog):
    words = RequestWords.of("put the red cup in the sink")
    assert accepts(grammar, json.dumps(plan(("pick", {"object": "red cup"}))), words=words)
    assert not accepts(grammar, json.dumps(plan(("pick", {"object": "mug"}))), words=words)
    validate_plan(plan(("pick", {"object": "red cup"})), catalog, words)


def test_scene_names_with_quotes_and_chat_tokens_are_plain_names(grammar, catalog):
    words = RequestWords.of("pick it up", "", ('the "big" box|box', "<think> tray</think>"))
    for name in ('the "big" box', "<think> tray</think>", "box"):
        obj = plan(("pick", {"object": name}))
        assert accepts(grammar, json.dumps(obj), words=words), name
        validate_plan(obj, catalog, words)


@pytest.mark.parametrize("steps,message", [
    ([("go_to", {"place": "garage"})],
     r"^step 1 \(go_to\): argument 'place' is 'garage', not one of its values \(300 of them, "
     r"the closest: [^)]*\)$"),
    ([("beep", {"object": "x"})],
     r"^step 1 \(beep\): unexpected argument 'object' \(beep takes no arguments\)$"),
    ([("pick", {"object": "coke", "grasp": 3})],
     r"^step 1 \(pick\): argument 'grasp' must be string, got int$"),
    ([("place", {"object": "coke", "location": None})],
     r"^step 1 \(place\): argument 'location' must be string, got NoneType \(leave an "
     r"optional argument out instead of null\)$"),
    ([("pick", {})], r"^step 1 \(pick\): missing argument 'object'$"),
    ([("teleport", {})], r"^step 1: unknown skill 'teleport' \(known: pick, place, go_to, "
                         r"wait, beep\)$"),
])
def test_errors_name_the_argument_and_list_few_values(catalog, steps, message):
    with pytest.raises(PlanError) as caught:
        validate_plan(plan(*steps), catalog, WORDS)
    assert re.match(message, str(caught.value)), str(caught.value)
    assert len(str(caught.value)) < 300


@pytest.mark.parametrize("spec,message", [
    ({"type": "string", "required": True, "default": "x"}, "has no use for a 'default'"),
    ({"type": "number", "default": "five"}, "default 'five' is not of type number"),
    ({"type": "number", "maximum": 3, "default": 5}, "default 5 is outside [-inf, 3]"),
    ({"type": "string", "enum": ["a"], "default": "b"}, "default 'b' is not one of the enum"),
    ({"type": "string", "required": "no"}, "'required' must be true or false, got 'no'"),
    ({"type": "string", "grounded": "perception"}, "must be true, false, scene or quote"),
])
def test_an_optional_argument_that_cannot_hold_is_a_catalog_error(spec, message):
    with pytest.raises(CatalogError, match=re.escape(message)):
        SkillCatalog.from_dict({"skills": [{"name": "a", "args": {"x": spec}}]})


def test_a_yaml_boolean_as_an_argument_name_is_named(tmp_path):
    path = tmp_path / "skills.yaml"
    path.write_text("skills:\n  - name: put\n    args:\n      on: {type: string}\n")
    with pytest.raises(CatalogError, match="got True .*bare on, off, yes or no"):
        SkillCatalog.from_yaml(path)


def test_the_scene_list_goes_into_the_users_message_without_short_forms(catalog):
    user = build_messages(catalog, "put the coke away", "", scene=("coke can|coke", "bin"))[1]
    assert user["content"] == "Task: put the coke away\nObjects: coke can; bin"


@pytest.fixture(scope="module")
def example_catalog() -> SkillCatalog:
    return SkillCatalog.from_yaml(EXAMPLE)


@pytest.fixture(scope="module", params=["demo", "qwen3-real"])
def example_grammar(request, example_catalog, demo_tok, qwen_tok):
    tok, size = (demo_tok, 1024) if request.param == "demo" else (qwen_tok, QWEN_VOCAB_SIZE)
    return PlanGrammar(example_catalog, compiler_for(tok, size))


def test_the_example_catalogs_plans_validate_and_pass_its_grammar(example_catalog,
                                                                  example_grammar, demo_tok):
    examples = yaml.safe_load(EXAMPLES.read_text())["examples"]
    assert len(examples) >= 4
    for ex in examples:
        words = RequestWords.of(ex["task"], "", tuple(ex["scene"]))
        obj = {"plan": ex["plan"]}
        assert accepts(example_grammar, json.dumps(obj), words=words), ex["task"]
        steps = validate_plan(obj, example_catalog, words)
        assert all(a in [e.split("|")[0] for e in ex["scene"]]
                   for step, spec in zip(steps, ex["plan"])
                   for name, a in step["args"].items()
                   if next(x for x in example_catalog.get(spec["skill"]).args
                           if x.name == name).grounded == "scene")
    assert len(demo_tok.encode(system_prompt(example_catalog, True))) < 1000


def test_the_demo_planner_under_the_example_catalog_names_only_listed_objects(example_catalog):
    """The demo model never saw this catalog; under each request's grammar whatever it
    answers is still a plan whose scene arguments are listed names, or the reason there is
    none."""
    from flash_planner.engine.engine import Engine
    from flash_planner.planning.presets import ModelPreset
    from flash_planner.planning.request import PlanRequest
    from flash_planner.planning.service import PlannerConfig, PlannerService

    engine = Engine.load(ModelPreset.load("demo").engine_config(device="cpu", dtype="fp32"))
    service = PlannerService(engine, example_catalog, PlannerConfig(max_new_tokens=256))
    service.start()
    try:
        for ex in yaml.safe_load(EXAMPLES.read_text())["examples"]:
            result = service.plan(PlanRequest(ex["task"], scene=tuple(ex["scene"])),
                                  timeout=300)
            listed = [entry.split("|")[0] for entry in ex["scene"]]
            assert result.success or result.refusal or result.finish_reason == "length", \
                result.error
            for step in result.plan or []:
                skill = example_catalog.get(step["skill"])
                for arg in skill.args:
                    if arg.grounded == "scene" and arg.name in step["args"]:
                        assert step["args"][arg.name] in listed, (ex["task"], step)
    finally:
        service.stop()
