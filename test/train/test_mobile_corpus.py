"""The example catalog's corpus (`train/mobile.py`): valid plans of listed names, short forms,
the splits, the rendered prompt."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from flash_planner.planning.grounding import RequestWords
from flash_planner.planning.parse import PlanRefused, parse_plan
from flash_planner.train import mobile
from flash_planner.train.corpus import REFUSE, answer_text, prompt_text

N_TRAIN, N_HELDOUT = 3000, 300
GROUNDED = ("object", "target", "location")     # the catalog's scene-grounded arguments


@pytest.fixture(scope="module")
def train():
    return mobile.training_examples(0, N_TRAIN)


@pytest.fixture(scope="module")
def sets():
    return mobile.heldout_examples(0, N_HELDOUT)


def _all(train, sets):
    return train + [ex for examples in sets.values() for ex in examples]


def test_same_seed_same_examples(train):
    assert mobile.training_examples(0, N_TRAIN) == train
    assert mobile.training_examples(1, 200) != train[:200]


def test_every_answer_is_a_valid_plan_of_listed_names_or_a_refusal(train, sets):
    catalog = mobile.catalog()
    for ex in _all(train, sets):
        assert ex.catalog == mobile.CATALOG, ex
        if ex.refusal:
            with pytest.raises(PlanRefused):
                parse_plan(answer_text(ex), catalog)
            continue
        words = RequestWords.of(ex.task, ex.context, ex.scene)
        # the parser writes a listed name in full: the plan already names each so
        steps, _ = parse_plan(answer_text(ex), catalog, words=words)
        assert steps == ex.plan, ex
        listed = {entry.split("|")[0] for entry in ex.scene}
        for step in ex.plan:            # a plan that names nothing may come without a list
            for name, value in step["args"].items():
                if name in GROUNDED:
                    assert value in listed, (value, ex)


def test_tasks_use_declared_short_forms_and_plans_the_full_names(train):
    shortened = 0
    for ex in train:
        for entry in ex.scene:
            if "|" not in entry:
                continue
            name, short = entry.split("|")
            assert name.split()[-1] == short
            named = any(name in step["args"].values() for step in ex.plan)
            if named and not re.search(rf"\b{re.escape(name)}\b", ex.task) \
                    and re.search(rf"\b{re.escape(short)}\b", ex.task):
                shortened += 1
    assert shortened > 0.05 * len(train)


def test_the_catalogs_own_skills_and_rooms_are_trained_and_held_out(train, sets):
    skills = Counter(step["skill"] for ex in train for step in ex.plan)
    assert set(skills) == {s.name for s in mobile.catalog().skills}
    assert {step["args"]["room"] for ex in train for step in ex.plan
            if step["skill"] == "go_to_room"} == set(mobile.rooms())
    assert any("grasp" in step["args"] for ex in train for step in ex.plan)
    assert any(step["skill"] == "put_down" and "location" not in step["args"]
               for ex in train for step in ex.plan)
    for name in ("world", "unseen"):
        families = Counter(ex.family for ex in sets[name])
        assert set(mobile.OWN_FAMILIES) <= set(families), name
    assert all(ex.family == REFUSE for ex in sets["inexpressible"])
    assert 0.1 * len(train) < sum(ex.family == REFUSE for ex in train) < 0.2 * len(train)


def test_heldout_names_and_combinations_never_occur_in_training(train, sets):
    trained = {ex.combo for ex in train}         # rooms: a closed enum, each one trained
    assert not {ex.combo for ex in sets["world"] if ex.family != "room"} & trained
    text = " ".join(f" {ex.task} {ex.context} {answer_text(ex)} " for ex in train)
    unseen = {v for ex in sets["unseen"] for s in ex.plan for k, v in s["args"].items()
              if k in GROUNDED}
    assert len(unseen) > 0.5 * len(sets["unseen"])
    # the catalog's rooms are trained by design ("corridor a"): a held-out name may share them
    room_words = {word for room in mobile.rooms() for word in room.split()}
    for name in unseen:
        if set(name.split()) & room_words:
            continue
        assert not re.search(rf"\b{re.escape(name)}\b", text), name


def test_the_prompt_lists_the_catalog_and_the_scene_names(train):
    ex = next(e for e in train if any("|" in entry for entry in e.scene))
    prompt = prompt_text(ex, catalog=mobile.catalog())
    assert "- go_to_room(room: string enum" in prompt
    assert "Objects: " + "; ".join(entry.split("|")[0] for entry in ex.scene) in prompt
