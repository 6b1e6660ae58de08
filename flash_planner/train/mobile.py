"""Tasks planned with the example catalog (config/catalogs/mobile_manipulator.yaml), so that the
demo plans the catalog a newcomer tries first as it plans its own.

Two kinds of example, each with a scene list (the request's `scene`, "name|short form") and
the catalog's skills:
- the default corpus's tasks, rewritten (`rewrite`): navigate_to becomes go_to (an object
  in the scene list) or go_to_room (a room of the catalog's enum), pick becomes pick_up,
  place becomes put_down (no location where the place is a room); the scene list holds every
  name the plan grounds plus up to two distractors, and some names a short form (the last
  word) that the task then uses instead of the name. Plans name listed names in full.
- tasks only this catalog can express (`own_example`): hand an object over, find it, grasp
  it from the top or side, put down what the robot holds (no location), drive to any room
  (every room is trained: the enum is closed; such a task may come with no scene list).

The same splits hold as in `corpus.py`: the held-out sets rewrite the default held-out sets,
and own tasks take their closed-world objects from the pick family's split.
"""

from __future__ import annotations

import random
import re
from dataclasses import replace
from functools import cache
from pathlib import Path

from ..planning.presets import config_dir
from ..planning.skills import SkillCatalog
from .corpus import (
    HELDOUT_SETS,
    THINKING_OFF,
    Example,
    heldout_sets,
    rng_for,
    split_combos,
    training_mix,
)
from .names import open_world
from .world import WORLDS, Entity

CATALOG = "mobile_manipulator"
OWN_SHARE = 0.2          # own tasks among this catalog's examples
ALIAS_SHARE = 0.4        # listed names given a short form
ALIAS_USED = 0.6         # ... which the task then says instead of the name
OWN_FAMILIES = {"hand_over": 6, "locate": 4, "grasp": 4, "put_down": 3, "room": 3}


def catalog_path() -> Path:
    return config_dir() / "catalogs" / f"{CATALOG}.yaml"


@cache
def catalog() -> SkillCatalog:
    return SkillCatalog.from_yaml(catalog_path())


@cache
def rooms() -> tuple[str, ...]:
    arg = next(a for s in catalog().skills if s.name == "go_to_room" for a in s.args)
    return tuple(dict(arg.constraints)["enum"])


def _step(skill: str, **args) -> dict:
    return {"skill": skill, "args": args}


def _rewrite_steps(plan: list[dict]) -> tuple[list[dict], list[str]]:
    """The default catalog's steps in this catalog's skills, and the names they ground."""
    steps, named = [], []

    def ground(name: str) -> str:
        if name not in named:
            named.append(name)
        return name
    for step in plan:
        skill, args = step["skill"], step["args"]
        if skill == "navigate_to" and args["target"] in rooms():
            steps.append(_step("go_to_room", room=args["target"]))
        elif skill == "navigate_to":
            steps.append(_step("go_to", target=ground(args["target"])))
        elif skill == "pick":
            steps.append(_step("pick_up", object=ground(args["object"])))
        elif skill == "place" and args["location"] in rooms():
            steps.append(_step("put_down", object=ground(args["object"])))
        elif skill == "place":
            steps.append(_step("put_down", object=ground(args["object"]),
                               location=ground(args["location"])))
        elif skill in ("open", "close"):
            steps.append(_step(skill, object=ground(args["object"])))
        else:                                   # say, wait: the same skills
            steps.append(step)
    return steps, named


def _words(name: str) -> frozenset[str]:
    return frozenset(re.findall(r"\w+", name.lower()))


@cache
def _distractor_pool() -> tuple[tuple[str, frozenset[str]], ...]:
    """The closed worlds' names that are not rooms, each with its words."""
    names = {e.name for w in WORLDS for e in (*w.objects, *w.places, *w.containers)}
    return tuple((name, _words(name)) for name in sorted(names - set(rooms())))


def _last_word(name: str) -> str:
    return name.split()[-1]


def _with_scene(example: Example, named: list[str], rng: random.Random) -> Example:
    """The example with a scene list of `named` and up to two distractors; some entries
    given a short form, which the task then says instead of the name."""
    words = _words(" ".join(named))
    pool = [name for name, its in _distractor_pool() if not words & its]
    entries = named + rng.sample(pool, rng.choice((0, 1, 1, 2)))
    rng.shuffle(entries)
    task, scene = example.task, []
    for name in entries:
        short = _last_word(name)
        unique = sum(short in e.split() for e in entries) == 1
        if (" " in name and short.isalpha() and unique and short not in rooms()
                and rng.random() < ALIAS_SHARE):
            scene.append(f"{name}|{short}")
            said = re.compile(rf"\b{re.escape(name)}\b")
            if (name in named and len(said.findall(task)) == 1
                    and not re.search(rf"\b{re.escape(short)}\b", said.sub("", task))
                    and rng.random() < ALIAS_USED):
                task = said.sub(short, task)
        else:
            scene.append(name)
    return replace(example, task=task, scene=tuple(scene), catalog=CATALOG)


def rewrite(example: Example, rng: random.Random) -> Example:
    """A default-catalog example as this catalog plans it (see the module's docstring)."""
    steps, named = _rewrite_steps(example.plan)
    if example.refusal:     # a task neither catalog can do: the scene lists what it names
        named = [name for name, _ in _distractor_pool()
                 if re.search(rf"\b{re.escape(name)}\b", example.task)][:2]
    return _with_scene(replace(example, plan=steps), named, rng)


# --- tasks only this catalog expresses ---------------------------------------------------------

TASKS = {
    "hand_over": ["bring me {o}", "hand me {o}", "give me {o}", "could you bring me {o}",
                  "fetch {o} for me", "I need {o}, bring it to me", "get me {o}, please"],
    "locate": ["find {o}", "look for {o}", "where is {o}? find it", "search for {o}",
               "locate {o}", "can you find {o}"],
    "grasp": ["pick up {o} from the {g}", "grab {o} from the {g}", "grasp {o} from the {g}",
              "take {o}, grab it from the {g}", "pick {o} up with a {g} grasp"],
    "put_down": ["put {o} down", "put down {o}", "set {o} down", "drop {o} gently",
                 "let go of {o} and put it down"],
    "room": ["go to the {r}", "drive to the {r}", "head to the {r}", "go over to the {r}",
             "make your way to the {r}", "please go to the {r}"],
}
THINKING = {
    "hand_over": ["The person wants {o}. I go to it, pick it up and hand it over.",
                  "I get {o} and hold it out to the person.",
                  "Three steps: go to {o}, pick it up, hand it over."],
    "locate": ["I look around until {o} is in view.", "First I have to find {o}.",
               "One step: locate {o}."],
    "grasp": ["I go to {o} and grasp it from the {g}.",
              "Two steps: go to {o}, then pick it up with a {g} grasp."],
    "put_down": ["I am holding {o}, so I just put it down here.",
                 "One step: put {o} down in front of me."],
    "room": ["I drive to the {r}.", "One step: go to the {r}.",
             "The {r} is a room of the building, so I use go_to_room."],
}
HOLDING = ["the robot is holding {o}", "{o} is in the gripper", "the robot holds {o}"]


def _object(rng: random.Random, split: str, open_vocab: bool) -> Entity:
    if open_vocab:
        return rng.choice(open_world(rng, split).objects)
    name = rng.choice(split_combos("pick", split))[1]
    return next(w.by_name[name] for w in WORLDS if name in w.by_name)


def own_example(family: str, rng: random.Random, split: str, open_vocab: bool) -> Example:
    """A task of one of this catalog's own families (OWN_FAMILIES)."""
    entity = _object(rng, split, open_vocab)
    obj = entity.name
    fields = {"o": entity.ref, "g": rng.choice(("top", "side")), "r": rng.choice(rooms())}
    context, named = "", [obj]
    if family == "hand_over":
        plan = [_step("go_to", target=obj), _step("pick_up", object=obj), _step("hand_over")]
    elif family == "locate":
        plan = [_step("locate", object=obj)]
    elif family == "grasp":
        plan = [_step("go_to", target=obj), _step("pick_up", object=obj, grasp=fields["g"])]
    elif family == "put_down":
        plan = [_step("put_down", object=obj)]
        context = rng.choice(HOLDING).format(**fields)
    else:
        plan, named = [_step("go_to_room", room=fields["r"])], []
    task = rng.choice(TASKS[family]).format(**fields)
    thinking = (None if rng.random() < THINKING_OFF
                else rng.choice(THINKING[family]).format(**fields))
    example = Example(task[0].upper() + task[1:] if rng.random() < 0.5 else task, context,
                      thinking, plan, family, (family, fields["r"] if family == "room" else obj))
    return _with_scene(example, named, rng)


def _own_examples(rng: random.Random, split: str, n: int, open_vocab: bool) -> list[Example]:
    families, weights = list(OWN_FAMILIES), list(OWN_FAMILIES.values())
    return [own_example(rng.choices(families, weights)[0], rng, split, open_vocab)
            for _ in range(n)]


def training_examples(seed: int, n: int, draw: int = 0) -> list[Example]:
    """n training examples in this catalog: the default training mix rewritten, and own
    tasks (OWN_SHARE, half of them open-vocabulary); each `draw` others."""
    rng = rng_for(seed, f"train-{CATALOG}" + (f"-{draw}" if draw else ""))
    n_own = round(n * OWN_SHARE)
    out = [rewrite(ex, rng) for ex in training_mix(rng, n - n_own)]
    out += [replace(ex, hint=rng.random() < 0.5)
            for ex in _own_examples(rng, "train", n_own, open_vocab=False)[:n_own // 2]
            + _own_examples(rng, "train", n_own - n_own // 2, open_vocab=True)]
    rng.shuffle(out)
    return out


def heldout_examples(seed: int = 0, n: int = 500) -> dict[str, list[Example]]:
    """The held-out sets of `corpus.heldout_sets` in this catalog, n tasks each: (a) and (b)
    rewritten with OWN_SHARE of own tasks (closed-world held-out objects for (a), held-out
    names for (b)); (c) rewritten."""
    rng = rng_for(seed, f"heldout-{CATALOG}")
    sets = heldout_sets(seed, n)
    n_own = round(n * OWN_SHARE)
    out = {}
    for name in HELDOUT_SETS:
        rewritten = [rewrite(ex, rng) for ex in sets[name]]
        if name != "inexpressible":
            rewritten = (rewritten[:n - n_own]
                         + _own_examples(rng, "heldout", n_own, open_vocab=name == "unseen"))
            rng.shuffle(rewritten)
        out[name] = rewritten
    return out

