"""Deterministic synthetic corpus of robot tasks and their JSON plans, for training from scratch.

Two worlds (household, warehouse) of objects, places and openable containers. Task families:
go, say, wait (1 step); open, close, pick (2 steps, 1 when the robot already stands there);
fetch (4 steps; 2-5 depending on the scene); put into a container (5 steps; 3-4 depending on
the scene); and compositions of two families joined by "then" (2-5 steps). An optional scene
(the prompt's "Scene:" line) either changes the plan (where the object is, what the robot
holds, where it stands, which container is already open) or is a distractor that does not.

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
represented in both and no held-out combination key ever occurs in training.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cache, lru_cache
from itertools import product
from typing import Any

from ..planning.presets import default_skills_path
from ..planning.prompt import build_messages
from ..planning.skills import SkillCatalog
from .tokenizer import EOS, THINK_CLOSE, THINK_OPEN, chat_prompt

HELDOUT_FRACTION = 0.12
HELDOUT_SALT = "flash_planner-heldout-v1"
THINKING_OFF = 0.2
MAX_STEPS = 5


# --- the worlds ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Entity:
    """An object, place or container; `name` is the phrase used in tasks and plan arguments."""
    name: str
    kind: str                 # "object" | "place" | "container"
    article: bool = True      # "the red cup" but "shelf 3"
    prep: str = "on"          # where something lies: on the desk, at the dock, in the fridge
    holds: bool = True        # containers: can things be put into it (doors cannot)

    @property
    def ref(self) -> str:
        return f"the {self.name}" if self.article else self.name


def _objects(*names: str) -> tuple[Entity, ...]:
    return tuple(Entity(n, "object", article=not n.startswith("package ")) for n in names)


def _places(spec: str) -> tuple[Entity, ...]:
    out = []
    for item in spec.split(","):
        name, prep = item.strip().rsplit(":", 1)
        out.append(Entity(name, "place", article=not name[-1].isdigit(), prep=prep))
    return tuple(out)


def _containers(holding: str, doors: str) -> tuple[Entity, ...]:
    def make(name: str, holds: bool) -> Entity:
        return Entity(name, "container", article=not name[-1].isdigit(), prep="in",
                      holds=holds)
    return (tuple(make(n.strip(), True) for n in holding.split(","))
            + tuple(make(n.strip(), False) for n in doors.split(",")))


@dataclass(frozen=True)
class World:
    name: str
    objects: tuple[Entity, ...]
    places: tuple[Entity, ...]
    containers: tuple[Entity, ...]
    texts: tuple[str, ...]
    remarks: tuple[str, ...]  # scene sentences that never matter for a plan

    @property
    def holders(self) -> tuple[Entity, ...]:
        return tuple(c for c in self.containers if c.holds)


HOUSEHOLD = World(
    "household",
    _objects("red cup", "blue cup", "green cup", "blue mug", "red mug", "white mug",
             "green bottle", "water bottle", "yellow sponge", "black remote", "tv remote",
             "white plate", "blue plate", "silver spoon", "orange towel", "white towel",
             "purple book", "red book", "glass jar", "wooden bowl", "grey blanket",
             "blue pillow", "small teddy bear", "phone charger", "red apple", "yellow banana",
             "cereal box", "milk carton", "soap bottle", "black laptop", "brown basket",
             "small cardboard box", "toy car", "red lunchbox"),
    _places("kitchen table:on, counter:on, sink:in, shelf:on, desk:on, couch:on, "
            "charging dock:at, dining table:on, coffee table:on, nightstand:on, bed:on, "
            "bookshelf:on, windowsill:on, tv stand:on, armchair:on, kitchen:in, "
            "living room:in, bedroom:in, bathroom:in, hallway:in, laundry room:in, "
            "front entrance:at"),
    _containers("fridge, drawer, top drawer, bottom drawer, cabinet, kitchen cabinet, "
                "dishwasher, microwave, oven, wardrobe, pantry, washing machine",
                "door, front door, bathroom door, bedroom door"),
    ("hello", "Hello!", "dinner is ready", "Good morning, everyone", "the laundry is done",
     "please take your medicine", "I am going to charge now", "welcome home",
     "the table is set", "Time for a break", "someone is at the door", "I found the remote"),
    ("the lights are off", "it is raining outside", "the kids are asleep", "the TV is on",
     "the floor near the sink is wet", "nobody else is home", "it is 7 pm",
     "the window in the bedroom is open", "a cat is sleeping in the hallway"),
)

WAREHOUSE = World(
    "warehouse",
    _objects("small cardboard box", "large cardboard box", "blue crate", "red crate",
             "red toolbox", "barcode scanner", "tape roll", "green bin", "yellow helmet",
             "orange safety vest", "battery pack", "metal bracket", "plastic tote",
             "package 12", "package 47", "spare wheel", "grey tablet", "label printer",
             "white envelope", "black case", "first aid kit", "blue folder"),
    _places("loading dock:at, packing station:at, shelf 3:on, shelf 7:on, aisle 4:in, "
            "aisle 12:in, conveyor belt:on, charging dock:at, inspection table:on, "
            "storage rack:on, workbench:on, office:in, shipping area:in, receiving area:in, "
            "pallet 5:on, break room:in"),
    _containers("locker, storage cabinet, tool drawer, supply closet, freezer, cabinet 2, "
                "parts cabinet", "gate, roller door, fire door, office door"),
    ("the truck has arrived", "please clear the aisle", "package 12 is ready for pickup",
     "Caution, robot moving", "shift change in ten minutes", "the loading dock is clear",
     "Attention please", "the order is packed", "I need help with a heavy box",
     "Inventory check complete"),
    ("a forklift is working nearby", "the conveyor belt is stopped",
     "the night shift has started", "two workers are at the packing station",
     "the floor was just cleaned", "the radio is playing", "it is 3 am",
     "the trucks are late today", "the main lights are dimmed"),
)

WORLDS = (HOUSEHOLD, WAREHOUSE)
ENTITIES = {e.name: e for w in WORLDS for e in (*w.objects, *w.places, *w.containers)}
WORD_DURATIONS = {"half a minute": 30, "a minute": 60, "one minute": 60, "two minutes": 120,
                  "ten seconds": 10, "five seconds": 5}
NUMBER_DURATIONS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 15, 20, 25, 30, 40, 45, 60, 90, 120, 180,
                    300, 600, 0.5, 1.5, 2.5, 3.5, 7.5, 12.5, 0.25)
DURATIONS = tuple(json.dumps(n) for n in NUMBER_DURATIONS) + tuple(WORD_DURATIONS)


def seconds_of(duration: str) -> int | float:
    """The JSON number for a duration slot: "2.5" -> 2.5, "a minute" -> 60."""
    return WORD_DURATIONS[duration] if duration in WORD_DURATIONS else json.loads(duration)


# --- plans -----------------------------------------------------------------------------------

def _step(skill: str, **args: Any) -> dict:
    return {"skill": skill, "args": args}


@dataclass
class Scene:
    """What the scene line says about the world; the plan functions read it."""
    facts: list[str] = field(default_factory=list)   # the scene's sentences
    kind: str = ""            # the relevant fact's kind ("" for none / distractor only)
    at: str = ""              # the robot stands at this entity
    holding: str = ""         # the robot holds this object
    location: dict[str, str] = field(default_factory=dict)    # object -> place
    inside: dict[str, tuple[str, bool]] = field(default_factory=dict)  # obj -> (cont, open)
    open: set[str] = field(default_factory=set)               # containers already open
    distractor: bool = False


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
SLOTS = {"go": ("target",), "say": ("text",), "wait": ("duration",), "open": ("container",),
         "close": ("container",), "pick": ("object",), "fetch": ("object", "place"),
         "put": ("object", "holder")}
COMPOSITIONS = ("go+say", "say+go", "go+wait", "wait+say", "go+open", "pick+go", "close+say",
                "open+wait", "fetch+say", "fetch+wait")
# Relative frequency of each family in both splits.
WEIGHTS = {"go": 8, "say": 6, "wait": 6, "open": 6, "close": 6, "pick": 7, "fetch": 13,
           "put": 9, "go+say": 4, "say+go": 3, "go+wait": 3, "wait+say": 3, "go+open": 3,
           "pick+go": 3, "close+say": 3, "open+wait": 3, "fetch+say": 3, "fetch+wait": 2}
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


def _parts(family: str) -> list[str]:
    return family.split("+")


@cache
def combo_space(family: str) -> tuple[tuple, ...]:
    """Every combination key of a family: (family, slot values...), both worlds, sorted."""
    keys = set()
    for world in WORLDS:
        slots = [_slot_values(world, s, family) for p in _parts(family) for s in SLOTS[p]]
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


# --- phrasing --------------------------------------------------------------------------------

CLAUSES = {
    "go": ["go to {p}", "navigate to {p}", "drive to {p}", "head over to {p}", "move to {p}",
           "make your way to {p}", "head to {p}", "go over to {p}"],
    "say": ['say "{t}"', 'announce "{t}"', 'tell everyone "{t}"', 'say "{t}" out loud',
            'tell the people nearby "{t}"', "say '{t}'", 'speak the words "{t}"',
            'let everyone know: "{t}"'],
    "wait": ["wait {d}", "wait for {d}", "pause for {d}", "stay still for {d}",
             "hold on for {d}", "do nothing for {d}", "sit tight for {d}", "stay put for {d}"],
    "open": ["open {c}", "open up {c}", "get {c} open", "go open {c}", "make sure {c} is open",
             "go and open {c}"],
    "close": ["close {c}", "shut {c}", "close up {c}", "go shut {c}",
              "make sure {c} is closed", "go and close {c}"],
    "pick": ["pick up {o}", "grab {o}", "get hold of {o}", "take {o}", "lift {o}",
             "go and grab {o}", "pick {o} up"],
    "fetch": ["bring {o} to {d}", "take {o} over to {d}", "move {o} to {d}",
              "fetch {o} and put it {dp} {d}", "pick up {o} and place it {dp} {d}",
              "carry {o} to {d}", "get {o} and leave it {dp} {d}", "put {o} {dp} {d}",
              "take {o} to {d}"],
    "put": ["put {o} into {c}", "place {o} in {c}", "store {o} in {c}", "stow {o} inside {c}",
            "load {o} into {c}", "move {o} into {c}", "put {o} away in {c}"],
}
# Whole-task sentences that are not imperative clauses (standalone tasks only).
SENTENCES = {
    "go": ["I need you {pa} {p}", "your next stop is {p}", "{P} is where you should be"],
    "open": ["{C} needs to be opened", "I would like {c} open"],
    "close": ["{C} should be closed", "{C} was left open, close it"],
    "pick": ["I need you to hold {o}"],
    "fetch": ["I need {o} {dp} {d}", "{O} belongs {dp} {d}", "{O} should be {dp} {d}"],
    "put": ["{O} goes in {c}", "{O} needs to go into {c}"],
}
WRAPPERS = [("{c}", False)] * 4 + [
    ("please {c}", False), ("{c}, please", False), ("could you {c}", True),
    ("can you {c}", True), ("would you {c}", True), ("I need you to {c}", False),
    ("robot, {c}", False), ("I want you to {c}", False), ("please {c} for me", False)]
JOINERS = ["{a}, then {b}", "{a} and then {b}", "first {a}, then {b}", "{a}; after that, {b}",
           "{a}. Then {b}", "{a}, and afterwards {b}", "{a}, and once done, {b}"]


def _cap(text: str) -> str:
    """Sentence case, except where the text starts with a bare entity name ("shelf 3 is ..."):
    names stay exactly as the plan's arguments write them."""
    head = text.split(":")[0]
    if any(head == n or head.startswith(n + " ") for n in ENTITIES):
        return text
    return text[:1].upper() + text[1:]


def _slots_text(family: str, values: tuple[str, ...], rng: random.Random) -> dict[str, str]:
    """Template fields of one simple family's slot values."""
    out: dict[str, str] = {}
    for slot, value in zip(SLOTS[family], values):
        if slot == "text":
            out["t"] = value
        elif slot == "duration":
            if value in WORD_DURATIONS:
                out["d"] = value
            else:
                unit = "second" if value == "1" else rng.choice(["seconds"] * 6 + ["sec", "s"])
                out["d"] = f"{value} {unit}"
        else:
            e = ENTITIES[value]
            key = {"target": "p", "container": "c", "holder": "c", "object": "o",
                   "place": "d"}[slot]
            out[key] = e.ref
            out[key.upper()] = _cap(e.ref)
            out[key + "p"] = e.prep
            out[key + "a"] = "in" if e.prep == "in" and e.kind == "place" else "at"
    return out


def _task(family: str, combo: tuple, rng: random.Random) -> str:
    parts, values = _parts(family), list(combo[1:])
    fields = []
    for part in parts:
        n = len(SLOTS[part])
        fields.append(_slots_text(part, tuple(values[:n]), rng))
        values = values[n:]
    if len(parts) == 1 and family in SENTENCES and rng.random() < 0.15:
        text = rng.choice(SENTENCES[family]).format(**fields[0])
        return _cap(text) + rng.choice([".", ".", ""])
    clauses = [rng.choice(CLAUSES[p]).format(**f) for p, f in zip(parts, fields)]
    core = clauses[0] if len(clauses) == 1 else rng.choice(JOINERS).format(
        a=clauses[0], b=clauses[1])
    pattern, question = rng.choice(WRAPPERS)
    if ". " in core and pattern != "{c}":
        pattern, question = "{c}", False
    text = pattern.format(c=core)
    if rng.random() < 0.75:
        text = _cap(text)
    if question:
        return text + "?"
    return text + rng.choice([".", ".", ".", "", "", "!"])


# --- scenes ----------------------------------------------------------------------------------

FACTS = {
    "location": ["{O} is {lp} {l}", "{O} was left {lp} {l}", "{O} is currently {lp} {l}",
                 "you can find {o} {lp} {l}", "last seen: {o} {lp} {l}", "{on}: {ln}"],
    "inside_closed": ["{O} is in {c}", "{O} is inside {c}, which is closed",
                      "{O} was put away in {c}", "{C} is closed and {o} is inside it"],
    "inside_open": ["{O} is in {c}, which is already open", "{C} is open and {o} is inside",
                    "{O} is inside {c} and {c} is open"],
    "holding": ["you are holding {o}", "{O} is already in your gripper",
                "the robot is holding {o}", "you already picked up {o}"],
    "at_object": ["you are next to {o}", "the robot is standing right by {o}",
                  "{O} is within reach", "you are already at {o}"],
    "at_container": ["you are next to {c}", "the robot is standing in front of {c}",
                     "{C} is within reach", "you are already at {c}"],
    "open_container": ["{C} is already open", "{C} is open", "someone left {c} open",
                       "{C} is standing open"],
}
# Relevant scene kinds per family (about the first part's slots).
SCENE_KINDS = {"pick": ("location", "inside_closed", "inside_open", "at_object"),
               "fetch": ("location", "inside_closed", "inside_open", "holding", "at_object"),
               "put": ("location", "holding", "at_object", "open_container"),
               "open": ("at_container",), "close": ("at_container",)}


def _entity_fields(prefix: str, e: Entity) -> dict[str, str]:
    return {prefix: e.ref, prefix.upper(): _cap(e.ref), prefix + "p": e.prep,
            prefix + "n": e.name}


def _relevant(family: str, values: tuple, world: World, rng: random.Random,
              sc: Scene) -> None:
    part = _parts(family)[0]
    kinds = SCENE_KINDS.get(part)
    if not kinds:
        return
    kind = rng.choice(kinds)
    first = values[:len(SLOTS[part])]
    f: dict[str, str] = {}
    if kind in ("location", "inside_closed", "inside_open", "holding", "at_object"):
        obj = first[0]
        f.update(_entity_fields("o", ENTITIES[obj]))
        if kind == "location":
            avoid = set(values)
            loc = rng.choice([p for p in world.places if p.name not in avoid])
            f.update(_entity_fields("l", loc))
            sc.location[obj] = loc.name
        elif kind.startswith("inside"):
            avoid = set(values)
            cont = rng.choice([c for c in world.holders if c.name not in avoid])
            f.update(_entity_fields("c", cont))
            sc.inside[obj] = (cont.name, kind == "inside_open")
        elif kind == "holding":
            sc.holding = obj
        else:
            sc.at = obj
    else:
        cont = first[-1]
        f.update(_entity_fields("c", ENTITIES[cont]))
        if kind == "at_container":
            sc.at = cont
        else:
            sc.open.add(cont)
    sc.kind = kind
    sc.facts.append(rng.choice(FACTS[kind]).format(**f))


def _distractor(values: tuple, world: World, rng: random.Random) -> str:
    used = set(values)
    roll = rng.random()
    if roll < 0.35:
        obj = rng.choice([o for o in world.objects if o.name not in used])
        place = rng.choice([p for p in world.places if p.name not in used])
        return f"{_cap(obj.ref)} is {place.prep} {place.ref}"
    if roll < 0.5:
        words = {w for v in values for w in v.split()}
        cont = rng.choice([c for c in world.containers if not words & set(c.name.split())])
        return f"{_cap(cont.ref)} is {rng.choice(['closed', 'open'])}"
    if roll < 0.6:
        return f"the battery is at {rng.randrange(15, 100)}%"
    return rng.choice(world.remarks)


def _scene(family: str, values: tuple, world: World, rng: random.Random) -> Scene:
    sc = Scene()
    roll = rng.random()
    if _parts(family)[0] in SCENE_KINDS and roll < 0.35:
        _relevant(family, values, world, rng, sc)
        if rng.random() < 0.3:
            sc.facts.insert(rng.randrange(2), _distractor(values, world, rng))
    elif roll < 0.6:
        sc.facts.append(_distractor(values, world, rng))
        sc.distractor = True
    return sc


def _context(sc: Scene, rng: random.Random) -> str:
    if not sc.facts:
        return ""
    sep = rng.choice(["; ", ". ", ". "])
    facts = [f if i == 0 or sep == "; " else _cap(f) for i, f in enumerate(sc.facts)]
    text = sep.join(facts)
    if rng.random() < 0.6:
        text = _cap(text)
    return text + rng.choice([".", ".", ""])


# --- thinking --------------------------------------------------------------------------------

GOALS = {
    "go": ["The task is to get to {p}.", "I need to be {pa} {p}.", "{P} is the destination.",
           "The user wants me {pa} {p}.", "This is a simple trip to {p}."],
    "say": ["I just need to speak.", 'The user wants me to say "{t}".',
            "This is only an announcement.", "Nothing to move, only a sentence to say.",
            'The message is "{t}".'],
    "wait": ["This is a pause of {n} seconds.", "I only have to wait.",
             "The task is to stay still for {n} seconds.",
             "No movement needed, just waiting {n} seconds.", "I simply wait here."],
    "open": ["{C} has to be opened.", "The task is to open {c}.", "The user wants {c} open.",
             "I need to open {c}."],
    "close": ["{C} has to be closed.", "The task is to close {c}.",
              "The user wants {c} shut.", "I need to close {c}."],
    "pick": ["I need to pick up {o}.", "The task is to grab {o}.",
             "{O} should end up in my gripper.", "The user wants me to hold {o}."],
    "fetch": ["{O} needs to go {dp} {d}.", "The task is to bring {o} to {d}.",
              "I have to move {o} to {d}.", "The user wants {o} {dp} {d}.",
              "Goal: {o} ends up {dp} {d}."],
    "put": ["{O} has to go into {c}.", "The task is to store {o} in {c}.",
            "The user wants {o} inside {c}.", "I need to put {o} in {c}."],
    "pair": ["This task has two parts.", "There are two things to do, in order.",
             "I handle the two requests one after the other.",
             "Two requests here, done in sequence."],
}
SITUATIONS = {
    "location": ["The scene says {o} is {lp} {l}, so I go to {l} for it.",
                 "{O} is {lp} {l}, so that is where I go first.",
                 "Since {o} is {lp} {l}, I head to {l} to get it."],
    "inside_closed": ["{O} is inside {c}, which is closed, so I open it first.",
                      "Because {o} is in {c}, I have to open {c} before picking it up.",
                      "{O} is stored in {c}; I go there and open it."],
    "inside_open": ["{O} is in {c} and it is already open, so I just take it out.",
                    "{C} is open already, so I can pick {o} straight from it.",
                    "No need to open {c}: it is open and {o} is inside."],
    "holding": ["I am already holding {o}, so there is no need to pick it up.",
                "{O} is already in my gripper, so I skip picking it up.",
                "Since I hold {o} already, I only need to deliver it."],
    "at_object": ["I am already next to {o}, so I can pick it up right away.",
                  "{O} is within reach, so no driving is needed to get it.",
                  "I stand by {o} already, so I grab it without moving."],
    "at_container": ["I am already standing at {c}, so no driving is needed.",
                     "{C} is within reach, so I act on it right away.",
                     "Since I am next to {c}, I skip navigating."],
    "open_container": ["{C} is already open, so I do not need to open it.",
                       "Since {c} is open, I can put {o} in directly.",
                       "No need to open {c}: it is already open."],
}
IRRELEVANT = ["The scene does not change anything here.", "Nothing in the scene matters for this.",
              "The scene information is not relevant to the plan.",
              "The note about the scene does not affect the task."]
VERBS = {
    "navigate_to": ["go to {x}", "drive to {x}", "head to {x}", "navigate to {x}",
                    "move to {x}"],
    "pick": ["pick up {x}", "grab {x}", "grasp {x}", "take {x}"],
    "place": ["place it {lp} {l}", "put it down {lp} {l}", "set it {lp} {l}",
              "leave it {lp} {l}", "put {x} {lp} {l}"],
    "open": ["open {x}", "open {x} up", "pull {x} open"],
    "close": ["close {x}", "shut {x}", "push {x} closed"],
    "say": ['say "{x}"', 'announce "{x}"', 'speak "{x}"'],
    "wait": ["wait {x} seconds", "pause for {x} seconds", "stay still for {x} seconds"],
}
OUTLINE_ONE = ["I will {a}.", "So I just {a}.", "One step: {a}.", "All I do is {a}.",
               "That is a single step: {a}."]
OUTLINE_MANY = ["I will {list} and then {last}.", "First {list}, then {last}.",
                "Plan: {list}, {last}.", "So I {list}, and finally {last}.",
                "{n} steps: {list}, then {last}."]
NUMBERS = {2: "Two", 3: "Three", 4: "Four", 5: "Five"}


def _ref(name: str) -> str:
    return ENTITIES[name].ref if name in ENTITIES else name


def _verbalise(step: dict, rng: random.Random) -> str:
    skill, args = step["skill"], step["args"]
    template = rng.choice(VERBS[skill])
    if skill == "place":
        loc = ENTITIES.get(args["location"])
        return template.format(x=_ref(args["object"]), l=_ref(args["location"]),
                               lp=loc.prep if loc else "at")
    if skill == "wait":
        value = args["seconds"]
        text = json.dumps(value)
        if value == 1:
            return template.format(x=text).replace("seconds", "second")
        return template.format(x=text)
    return template.format(x=_ref(next(iter(args.values()))))


def _outline(steps: list[dict], rng: random.Random) -> str:
    phrases = [_verbalise(s, rng) for s in steps]
    if len(phrases) == 1:
        return _cap(rng.choice(OUTLINE_ONE).format(a=phrases[0]))
    template = rng.choice(OUTLINE_MANY)
    text = template.format(list=", ".join(phrases[:-1]), last=phrases[-1],
                           n=NUMBERS[len(phrases)])
    return _cap(text)


def _goal(family: str, combo: tuple, rng: random.Random) -> str:
    if "+" in family:
        return rng.choice(GOALS["pair"])
    f = _slots_text(family, combo[1:], rng)
    if family == "wait":
        f["n"] = json.dumps(seconds_of(combo[1]))
        if combo[1] in WORD_DURATIONS and rng.random() < 0.5:
            return f"{_cap(combo[1])} is {f['n']} seconds."
    return _cap(rng.choice(GOALS[family]).format(**f))


def _situation(sc: Scene, combo: tuple, rng: random.Random) -> str:
    f: dict[str, str] = {}
    values = combo[1:]
    obj = next((v for v in values if v in ENTITIES and ENTITIES[v].kind == "object"), None)
    if obj:
        f.update(_entity_fields("o", ENTITIES[obj]))
    if sc.location:
        f.update(_entity_fields("l", ENTITIES[next(iter(sc.location.values()))]))
    if sc.inside:
        f.update(_entity_fields("c", ENTITIES[next(iter(sc.inside.values()))[0]]))
    elif sc.at and ENTITIES[sc.at].kind == "container":
        f.update(_entity_fields("c", ENTITIES[sc.at]))
    elif sc.open:
        f.update(_entity_fields("c", ENTITIES[next(iter(sc.open))]))
    return _cap(rng.choice(SITUATIONS[sc.kind]).format(**f))


def _thinking(family: str, combo: tuple, sc: Scene, steps: list[dict],
              rng: random.Random) -> str:
    outline = _outline(steps, rng)
    if sc.kind:
        return f"{_situation(sc, combo, rng)} {outline}"
    if sc.distractor and rng.random() < 0.4:
        return f"{rng.choice(IRRELEVANT)} {outline}"
    if rng.random() < 0.35:
        return outline
    return f"{_goal(family, combo, rng)} {outline}"


# --- examples --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Example:
    task: str
    context: str
    thinking: str | None      # None: a thinking-off example (empty think block in the prompt)
    plan: list[dict]
    family: str
    combo: tuple


def _plan(family: str, combo: tuple, sc: Scene) -> list[dict]:
    values, steps = list(combo[1:]), []
    for part in _parts(family):
        n = len(SLOTS[part])
        steps += PLANS[part](sc if not steps else Scene(), *values[:n])
        values = values[n:]
    return steps


def make_example(family: str, combo: tuple, rng: random.Random) -> Example:
    """One example of a combination; phrasing, scene and thinking drawn from `rng`."""
    world = rng.choice(_worlds_of(combo))
    for _ in range(20):
        sc = _scene(family, combo[1:], world, rng)
        steps = _plan(family, combo, sc)
        if len(steps) <= MAX_STEPS:
            break
    else:  # pragma: no cover - the scene kinds keep every family within MAX_STEPS
        raise AssertionError(f"{combo}: no scene keeps the plan within {MAX_STEPS} steps")
    task = _task(family, combo, rng)
    thinking = None if rng.random() < THINKING_OFF else _thinking(family, combo, sc, steps,
                                                                   rng)
    return Example(task, _context(sc, rng), thinking, steps, family, combo)


def answer_text(example: Example) -> str:
    """The assistant's text: thinking block (unless thinking-off), then the JSON plan."""
    plan = json.dumps({"plan": example.plan})
    if example.thinking is None:
        return plan
    return f"{THINK_OPEN}\n{example.thinking}\n{THINK_CLOSE}\n\n{plan}"


def _rng(seed: int, split: str) -> random.Random:
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


def _generate(seed: int, split: str, n: int) -> list[Example]:
    rng, out = _rng(seed, split), []
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
    rng.shuffle(out)
    return out


def make_corpus(seed: int = 0, n_train: int = 20000, n_heldout: int = 500
                ) -> tuple[list[Example], list[Example]]:
    """(train, heldout): deterministic for a seed; families in fixed proportions (WEIGHTS).

    The held-out split uses only held-out combinations (see `heldout_combos`), which are
    the same for every seed; training never sees them.
    """
    return _generate(seed, "train", n_train), _generate(seed, "heldout", n_heldout)


def iter_examples(seed: int = 0, split: str = "train") -> Iterator[Example]:
    """An endless deterministic stream of examples of a split (families drawn by WEIGHTS)."""
    rng = _rng(seed, f"{split}-stream")
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
    messages = build_messages(catalog or default_catalog(), example.task, example.context)
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
