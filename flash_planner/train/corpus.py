"""Deterministic synthetic corpus of robot tasks and their JSON plans, for training from scratch.

Three sources, mixed (OPEN_SHARE, REFUSE_SHARE): two closed worlds (household, warehouse) of
objects, places and openable containers (`world.py`); open-vocabulary worlds, a fresh cast of
names per task (`names.py`), so that plans copy names from the task instead of recalling
them; and tasks the catalog cannot express, answered `{"refusal": REASON}` (`refusals.py`).
Half of the training prompts name the refusal shape (HINT_SHARE). Task families:
go, say, wait (1 step); open, close, pick (2 steps, 1 when the robot already stands there);
fetch (4 steps; 2-5 depending on the scene); put into a container (5 steps; 3-4 depending on
the scene); and compositions of two families joined by "then" (2-5 steps). An optional scene
(the prompt's "Scene:" line) either changes the plan (where the object is, what the robot
holds, where it stands, which container is already open) or is a distractor that does not;
where the object is may also be said in the task ("take the box from the hall to ...").

Argument strings are the object/place phrase as written in the task or scene ("red cup",
"kitchen table", "shelf 3"); durations are JSON numbers. Each answer is a thinking block of one
or two varied sentences that name the objects and places, then `json.dumps({"plan": steps})`;
a fraction of examples is thinking-off (the chat template closes an empty thinking block in
the prompt and the answer is the JSON alone).

Held-out split: for every family, the space of its combinations (the content slots, e.g.
(fetch, object, destination), (go, place), (wait, duration), (go+say, place, text)) is
enumerated and ranked by a fixed SHA-256 hash; the first HELDOUT_FRACTION of each family
(at least 2) is held out. Training draws only the other combinations, the held-out split only
these, with the same per-family quotas, so every family (the 1-step ones included) is well
represented in both and no held-out combination key ever occurs in training. That is held-out
set (a); `heldout_sets` adds (b), open-vocabulary tasks named only with held-out words, and
(c), tasks to refuse with actions never refused in training.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import cache, lru_cache
from itertools import product
from typing import Any

from ..planning.presets import default_skills_path
from ..planning.prompt import build_messages
from ..planning.skills import SkillCatalog
from .names import open_world
from .phrasing import FROM_CLAUSES, SOURCE, make_scene, scene_text, task_text, thinking_text
from .refusals import refusal_task
from .tokenizer import EOS, THINK_CLOSE, THINK_OPEN, chat_prompt
from .world import DURATIONS, SLOTS, WORLDS, Entity, Scene, World, family_parts, seconds_of

HELDOUT_FRACTION = 0.12
HELDOUT_SALT = "flash_planner-heldout-v1"
THINKING_OFF = 0.2
MAX_STEPS = 5
SOURCE_SHARE = 0.3    # pick/fetch/put tasks that say where the object is ("from the hall")
# The training mix: closed-world tasks, open-vocabulary tasks, tasks to refuse.
OPEN_SHARE, REFUSE_SHARE = 0.5, 0.15
HINT_SHARE = 0.5      # training prompts that name the refusal shape (prompt.REFUSAL_HINT)
# Training tasks whose say texts are not quoted ("say hello, then go to the dock"): people
# seldom quote what the robot should say (the held-out sets keep the templates' quotes).
UNQUOTED_SAY = 0.3
REFUSE = "refuse"     # the family of refusals
# The held-out sets: (a) the training worlds' held-out combinations, (b) open-vocabulary
# tasks named only with held-out words, (c) tasks the catalog cannot express.
HELDOUT_SETS = ("world", "unseen", "inexpressible")



def _step(skill: str, **args: Any) -> dict:
    return {"skill": skill, "args": args}



def _reach(obj: str, sc: Scene) -> list[dict]:
    """Steps that bring the robot's gripper to `obj`, ending with picking it up."""
    if sc.holding == obj:
        return []
    if sc.at == obj:
        return [_step("pick", object=obj)]
    if obj in sc.inside:
        cont, is_open = sc.inside[obj]
        return ([_step("navigate_to", target=cont)] + ([] if is_open else
                [_step("open", object=cont)]) + [_step("pick", object=obj)])
    return [_step("navigate_to", target=sc.location.get(obj, obj)), _step("pick", object=obj)]


def _go_to(target: str, sc: Scene) -> list[dict]:
    return [] if sc.at == target else [_step("navigate_to", target=target)]


PLANS: dict[str, Callable[..., list[dict]]] = {
    "go": lambda sc, p: [_step("navigate_to", target=p)],
    "say": lambda sc, t: [_step("say", text=t)],
    "wait": lambda sc, d: [_step("wait", seconds=seconds_of(d))],
    "open": lambda sc, c: _go_to(c, sc) + [_step("open", object=c)],
    "close": lambda sc, c: _go_to(c, sc) + [_step("close", object=c)],
    "pick": lambda sc, o: _reach(o, sc),
    "fetch": lambda sc, o, d: _reach(o, sc) + [_step("navigate_to", target=d),
                                               _step("place", object=o, location=d)],
    "put": lambda sc, o, c: (_reach(o, sc) + [_step("navigate_to", target=c)]
                             + ([] if c in sc.open else [_step("open", object=c)])
                             + [_step("place", object=o, location=c)]),
}
COMPOSITIONS = ("go+say", "say+go", "go+wait", "wait+say", "go+open", "pick+go", "close+say",
                "open+wait", "fetch+say", "fetch+wait", "fetch+go")
# Relative frequency of each family in both splits.
WEIGHTS = {"go": 8, "say": 6, "wait": 6, "open": 6, "close": 6, "pick": 7, "fetch": 13,
           "put": 9, "go+say": 4, "say+go": 3, "go+wait": 3, "wait+say": 3, "go+open": 3,
           "pick+go": 3, "close+say": 3, "open+wait": 3, "fetch+say": 3, "fetch+wait": 2,
           "fetch+go": 3}
FAMILIES = tuple(WEIGHTS)


def _slot_values(world: World, slot: str, family: str) -> list[str]:
    if slot == "target":  # go: places, and containers when going alone
        extra = world.containers if family == "go" else ()
        return [e.name for e in (*world.places, *extra)]
    return {"text": list(world.texts), "duration": list(DURATIONS),
            "container": [e.name for e in world.containers],
            "object": [e.name for e in world.objects],
            "place": [e.name for e in world.places],
            "holder": [e.name for e in world.holders]}[slot]



@cache
def combo_space(family: str) -> tuple[tuple, ...]:
    """Every combination key of a family: (family, slot values...), both worlds, sorted."""
    keys = set()
    for world in WORLDS:
        slots = [_slot_values(world, s, family) for p in family_parts(family) for s in SLOTS[p]]
        keys.update((family, *values) for values in product(*slots))
    return tuple(sorted(keys))


def _rank(combo: tuple) -> str:
    return hashlib.sha256(f"{HELDOUT_SALT}|{combo!r}".encode()).hexdigest()


@cache
def heldout_combos(family: str) -> frozenset:
    """The held-out combinations of a family: the lowest-ranked HELDOUT_FRACTION (>= 2)."""
    space = combo_space(family)
    k = max(2, round(HELDOUT_FRACTION * len(space)))
    return frozenset(sorted(space, key=_rank)[:k])


@cache
def split_combos(family: str, split: str) -> tuple[tuple, ...]:
    held = heldout_combos(family)
    if split == "heldout":
        return tuple(c for c in combo_space(family) if c in held)
    if split == "train":
        return tuple(c for c in combo_space(family) if c not in held)
    raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")


def _worlds_of(combo: tuple) -> list[World]:
    """The worlds that hold every entity and text of a combination (durations fit all)."""
    names = [v for v in combo[1:] if v not in DURATIONS]
    found = []
    for world in WORLDS:
        pool = {e.name for e in (*world.objects, *world.places, *world.containers)}
        if all(v in pool or v in world.texts for v in names):
            found.append(world)
    if not found:
        raise AssertionError(f"no world holds all of {combo}")
    return found


# --- examples --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Example:
    task: str
    context: str
    thinking: str | None      # None: a thinking-off example (empty think block in the prompt)
    plan: list[dict]          # [] for a refusal
    family: str
    combo: tuple
    refusal: str = ""         # the reason, when the catalog cannot express the task
    hint: bool = False        # the prompt names the refusal shape (training prompts only)
    scene: tuple[str, ...] = ()   # the request's scene list ("name|short form", `mobile.py`)
    catalog: str = ""         # the skill catalog the plan is written in ("": the default)
    progress: str = ""        # a replan's progress section (`replans.py`); "" otherwise


def _plan(family: str, combo: tuple, sc: Scene) -> list[dict]:
    values, steps = list(combo[1:]), []
    for part in family_parts(family):
        n = len(SLOTS[part])
        steps += PLANS[part](sc if not steps else Scene(), *values[:n])
        values = values[n:]
    return steps


def _source(family: str, combo: tuple, sc: Scene, world: World,
            rng: random.Random) -> Entity | None:
    """Where the first part's object is, said in the task rather than the scene (sometimes,
    when the scene says nothing that matters)."""
    part = family_parts(family)[0]
    if sc.kind or part not in FROM_CLAUSES or rng.random() >= SOURCE_SHARE:
        return None
    source = rng.choice([p for p in world.places if p.name not in combo[1:]])
    sc.location[combo[1]] = source.name
    sc.kind = SOURCE
    return source


def make_example(family: str, combo: tuple, rng: random.Random,
                 world: World | None = None) -> Example:
    """One example of a combination; phrasing, scene and thinking drawn from `rng`. `world`
    holds the combination's entities (default: a closed world that has them all)."""
    world = world or rng.choice(_worlds_of(combo))
    for _ in range(20):
        sc = make_scene(family, combo[1:], world, rng)
        source = _source(family, combo, sc, world, rng)
        steps = _plan(family, combo, sc)
        if len(steps) <= MAX_STEPS:
            break
    else:  # pragma: no cover - the scene kinds keep every family within MAX_STEPS
        raise AssertionError(f"{combo}: no scene keeps the plan within {MAX_STEPS} steps")
    task = task_text(family, combo, rng, world, source)
    thinking = None if rng.random() < THINKING_OFF else thinking_text(family, combo, sc, steps,
                                                                   rng, world)
    return Example(task, scene_text(sc, rng, world), thinking, steps, family, combo)


def open_example(family: str, rng: random.Random, split: str) -> Example:
    """A task of `family` in a freshly named open-vocabulary world (`names.py`)."""
    world = open_world(rng, split)
    if family == "wait":  # names nothing: the closed worlds' split of durations holds
        return make_example(family, rng.choice(split_combos(family, split)), rng, world)
    slots = [_slot_values(world, s, family) for p in family_parts(family) for s in SLOTS[p]]
    return make_example(family, (family, *(rng.choice(v) for v in slots)), rng, world)


def refusal_example(rng: random.Random, split: str) -> Example:
    """A task the catalog cannot express (`refusals.py`), in a closed or open world (held
    out: open worlds of held-out names only)."""
    use_open = split == "heldout" or rng.random() < 0.6
    world = open_world(rng, split) if use_open else rng.choice(WORLDS)
    task, thinking, reason = refusal_task(world, rng, split)
    context = rng.choice(world.remarks) if rng.random() < 0.25 else ""
    if rng.random() < THINKING_OFF:
        thinking = None
    return Example(task, context, thinking, [], REFUSE, (REFUSE, reason), refusal=reason)


def answer_text(example: Example) -> str:
    """The assistant's text: thinking block (unless thinking-off), then the JSON plan (or
    the refusal)."""
    plan = json.dumps({"refusal": example.refusal} if example.refusal
                      else {"plan": example.plan})
    if example.thinking is None:
        return plan
    return f"{THINK_OPEN}\n{example.thinking}\n{THINK_CLOSE}\n\n{plan}"


def rng_for(seed: int, split: str) -> random.Random:
    digest = hashlib.sha256(f"{seed}|{split}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def _quotas(n: int) -> dict[str, int]:
    """Per-family counts for n examples, proportional to WEIGHTS (largest remainder)."""
    total = sum(WEIGHTS.values())
    exact = {f: n * w / total for f, w in WEIGHTS.items()}
    counts = {f: int(x) for f, x in exact.items()}
    for f in sorted(exact, key=lambda f: counts[f] - exact[f])[:n - sum(counts.values())]:
        counts[f] += 1
    return counts


def _world_examples(rng: random.Random, split: str, n: int) -> list[Example]:
    """n closed-world examples of the split's combinations, families by WEIGHTS."""
    out = []
    for family, count in _quotas(n).items():
        combos, seen = split_combos(family, split), set()
        for _ in range(count):
            for _attempt in range(10):
                ex = make_example(family, rng.choice(combos), rng)
                key = (ex.task, ex.context, ex.thinking is None)
                if key not in seen:
                    break
            seen.add(key)
            out.append(ex)
    return out


def _open_examples(rng: random.Random, split: str, n: int) -> list[Example]:
    return [open_example(family, rng, split)
            for family, count in _quotas(n).items() for _ in range(count)]


def _generate(seed: int, split: str, n: int) -> list[Example]:
    """The training mix (`training_mix`), or held-out set (a)."""
    rng = rng_for(seed, split)
    out = training_mix(rng, n) if split == "train" else _world_examples(rng, split, n)
    rng.shuffle(out)
    return out


def training_mix(rng: random.Random, n: int) -> list[Example]:
    """n training examples: closed world, open vocabulary and refusals (OPEN_SHARE,
    REFUSE_SHARE), half the prompts with the refusal hint, in that order."""
    n_open, n_refuse = round(n * OPEN_SHARE), round(n * REFUSE_SHARE)
    out = (_world_examples(rng, "train", n - n_open - n_refuse)
           + _open_examples(rng, "train", n_open)
           + [refusal_example(rng, "train") for _ in range(n_refuse)])
    return [_unquoted(replace(ex, hint=rng.random() < HINT_SHARE), rng) for ex in out]


def _unquoted(example: Example, rng: random.Random) -> Example:
    """The example with its say texts unquoted in the task, UNQUOTED_SAY of the time."""
    texts = [s["args"]["text"] for s in example.plan if s["skill"] == "say"]
    if rng.random() >= UNQUOTED_SAY or not texts:
        return example
    task = example.task
    for text in texts:
        task = task.replace(f'"{text}"', text).replace(f"'{text}'", text)
    return replace(example, task=task)


def make_corpus(seed: int = 0, n_train: int = 20000, n_heldout: int = 500
                ) -> tuple[list[Example], list[Example]]:
    """(train, heldout): deterministic for a seed. The held-out split is set (a) of
    `heldout_sets`: closed-world tasks of held-out combinations (see `heldout_combos`),
    which are the same for every seed; training never sees them.
    """
    return _generate(seed, "train", n_train), _generate(seed, "heldout", n_heldout)


def heldout_sets(seed: int = 0, n: int = 500) -> dict[str, list[Example]]:
    """The three held-out sets of HELDOUT_SETS, n tasks each, deterministic for a seed."""
    rng = rng_for(seed, "heldout-open")
    unseen = _open_examples(rng, "heldout", n)
    rng.shuffle(unseen)
    return {"world": _generate(seed, "heldout", n), "unseen": unseen,
            "inexpressible": [refusal_example(rng, "heldout") for _ in range(n)]}


def iter_examples(seed: int = 0, split: str = "train") -> Iterator[Example]:
    """An endless deterministic stream of examples of a split (families drawn by WEIGHTS)."""
    rng = rng_for(seed, f"{split}-stream")
    families, weights = list(WEIGHTS), list(WEIGHTS.values())
    while True:
        family = rng.choices(families, weights)[0]
        yield make_example(family, rng.choice(split_combos(family, split)), rng)


# --- rendering -------------------------------------------------------------------------------

@lru_cache(maxsize=1)
def default_catalog() -> SkillCatalog:
    return SkillCatalog.from_yaml(default_skills_path())


def prompt_text(example: Example, tokenizer=None, catalog: SkillCatalog | None = None) -> str:
    """The chat prompt up to the assistant's answer (the generation prompt included).

    With a tokenizer its own chat template renders it; without one, the same ChatML template
    in plain Python (for training the tokenizer itself).
    """
    messages = build_messages(catalog or default_catalog(), example.task, example.context,
                              refusal_hint=example.hint, scene=example.scene,
                              progress=example.progress)
    thinking = example.thinking is not None
    if tokenizer is None:
        return chat_prompt(messages, add_generation_prompt=True, enable_thinking=thinking)
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                         enable_thinking=thinking)


def render(example: Example, tokenizer=None, catalog: SkillCatalog | None = None) -> str:
    """The full training text: prompt, answer, end-of-turn token."""
    return prompt_text(example, tokenizer, catalog) + answer_text(example) + EOS


def encode(example: Example, tokenizer, catalog: SkillCatalog | None = None
           ) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of the rendered example.

    The prompt and the answer are tokenized separately (as at inference, where the prompt is
    encoded alone and the answer generated); loss_mask[i] is 1 where input_ids[i] is an
    answer token or the final `<|im_end|>`, i.e. a token the model must predict (from
    position i - 1 once labels are shifted). Use this rather than encoding `render(...)` in
    one piece: in thinking-off examples the byte-level pre-tokenizer would split the prompt's
    closing "\n\n" differently ("\n" + "\n" before "{"), unlike the prompt encoded alone.
    """
    prompt = tokenizer.encode(prompt_text(example, tokenizer, catalog), add_special_tokens=False)
    answer = tokenizer.encode(answer_text(example) + EOS, add_special_tokens=False)
    return prompt + answer, [0] * len(prompt) + [1] * len(answer)
