"""How the corpus words things: task sentences, scene lines and the thinking sentences."""

from __future__ import annotations

import json
import random

from .world import SLOTS, WORD_DURATIONS, Entity, Scene, World, family_parts, seconds_of

CLAUSES = {
    "go": ["go to {p}", "navigate to {p}", "drive to {p}", "head over to {p}", "move to {p}",
           "make your way to {p}", "head to {p}", "go over to {p}", "return to {p}",
           "go back to {p}"],
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
# Clauses that say where the object is ({l}): the first steps go there for it.
FROM_CLAUSES = {
    "pick": ["pick up {o} from {l}", "grab {o} {lp} {l}", "get {o} from {l}",
             "pick up {o} {lp} {l}", "go to {l} and pick up {o}"],
    "fetch": ["take {o} from {l} to {d}", "bring {o} from {l} to {d}",
              "move {o} from {l} to {d}", "pick up {o} {lp} {l} and put it {dp} {d}",
              "get {o} from {l} and leave it {dp} {d}", "carry {o} from {l} over to {d}"],
    "put": ["pick up {o} {lp} {l} and put it in {c}", "take {o} from {l} and put it into {c}",
            "put {o} from {l} into {c}", "get {o} from {l} and store it in {c}"],
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


def _cap(text: str, world: World) -> str:
    """Sentence case, except where the text starts with a bare entity name ("shelf 3 is ..."):
    names stay exactly as the plan's arguments write them."""
    head = text.split(":")[0]
    if any(head == n or head.startswith(n + " ") for n in world.by_name):
        return text
    return text[:1].upper() + text[1:]


def _slots_text(family: str, values: tuple[str, ...], rng: random.Random,
                world: World) -> dict[str, str]:
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
            e = world.entity(value)
            key = {"target": "p", "container": "c", "holder": "c", "object": "o",
                   "place": "d"}[slot]
            out[key] = e.ref
            out[key.upper()] = e.cap_ref
            out[key + "p"] = e.prep
            out[key + "a"] = "in" if e.prep == "in" and e.kind == "place" else "at"
    return out


def task_text(family: str, combo: tuple, rng: random.Random, world: World,
              source: Entity | None = None) -> str:
    """The task sentence; `source` (where the first part's object is) is said in the task."""
    parts, values = family_parts(family), list(combo[1:])
    fields = []
    for part in parts:
        n = len(SLOTS[part])
        fields.append(_slots_text(part, tuple(values[:n]), rng, world))
        values = values[n:]
    if source is not None:
        fields[0].update(_entity_fields("l", source))
    elif len(parts) == 1 and family in SENTENCES and rng.random() < 0.15:
        text = rng.choice(SENTENCES[family]).format(**fields[0])
        return _cap(text, world) + rng.choice([".", ".", ""])
    first = FROM_CLAUSES if source is not None else CLAUSES
    clauses = [rng.choice((first if i == 0 else CLAUSES)[p]).format(**f)
               for i, (p, f) in enumerate(zip(parts, fields))]
    core = clauses[0] if len(clauses) == 1 else rng.choice(JOINERS).format(
        a=clauses[0], b=clauses[1])
    pattern, question = rng.choice(WRAPPERS)
    if ". " in core and pattern != "{c}":
        pattern, question = "{c}", False
    text = pattern.format(c=core)
    if rng.random() < 0.75:
        text = _cap(text, world)
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
SOURCE = "source"   # a scene kind said in the task itself ("... from the hall ...")
# Relevant scene kinds per family (about the first part's slots).
SCENE_KINDS = {"pick": ("location", "inside_closed", "inside_open", "at_object"),
               "fetch": ("location", "inside_closed", "inside_open", "holding", "at_object"),
               "put": ("location", "holding", "at_object", "open_container"),
               "open": ("at_container",), "close": ("at_container",)}


def _entity_fields(prefix: str, e: Entity) -> dict[str, str]:
    return {prefix: e.ref, prefix.upper(): e.cap_ref, prefix + "p": e.prep,
            prefix + "n": e.name}


def _relevant(family: str, values: tuple, world: World, rng: random.Random,
              sc: Scene) -> None:
    part = family_parts(family)[0]
    kinds = SCENE_KINDS.get(part)
    if not kinds:
        return
    kind = rng.choice(kinds)
    first = values[:len(SLOTS[part])]
    f: dict[str, str] = {}
    if kind in ("location", "inside_closed", "inside_open", "holding", "at_object"):
        obj = first[0]
        f.update(_entity_fields("o", world.entity(obj)))
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
        f.update(_entity_fields("c", world.entity(cont)))
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
        return f"{obj.cap_ref} is {place.prep} {place.ref}"
    if roll < 0.5:
        words = {w for v in values for w in v.split()}
        cont = rng.choice([c for c in world.containers if not words & set(c.name.split())])
        return f"{cont.cap_ref} is {rng.choice(['closed', 'open'])}"
    if roll < 0.6:
        return f"the battery is at {rng.randrange(15, 100)}%"
    return rng.choice(world.remarks)


def make_scene(family: str, values: tuple, world: World, rng: random.Random) -> Scene:
    sc = Scene()
    roll = rng.random()
    if family_parts(family)[0] in SCENE_KINDS and roll < 0.35:
        _relevant(family, values, world, rng, sc)
        if rng.random() < 0.3:
            sc.facts.insert(rng.randrange(2), _distractor(values, world, rng))
    elif roll < 0.6:
        sc.facts.append(_distractor(values, world, rng))
        sc.distractor = True
    return sc


def scene_text(sc: Scene, rng: random.Random, world: World) -> str:
    if not sc.facts:
        return ""
    sep = rng.choice(["; ", ". ", ". "])
    facts = [f if i == 0 or sep == "; " else _cap(f, world) for i, f in enumerate(sc.facts)]
    text = sep.join(facts)
    if rng.random() < 0.6:
        text = _cap(text, world)
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
    SOURCE: ["{O} is {lp} {l}, so I go to {l} for it.", "I get {o} from {l} first.",
             "Since {o} is {lp} {l}, I head there to get it."],
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


def _verbalise(step: dict, rng: random.Random, world: World) -> str:
    skill, args = step["skill"], step["args"]
    template = rng.choice(VERBS[skill])
    if skill == "place":
        loc = world.entity(args["location"])
        return template.format(x=world.entity(args["object"]).ref, l=loc.ref, lp=loc.prep)
    if skill == "wait":
        value = args["seconds"]
        text = json.dumps(value)
        if value == 1:
            return template.format(x=text).replace("seconds", "second")
        return template.format(x=text)
    if skill == "say":
        return template.format(x=args["text"])
    return template.format(x=world.entity(next(iter(args.values()))).ref)


def _outline(steps: list[dict], rng: random.Random, world: World) -> str:
    phrases = [_verbalise(s, rng, world) for s in steps]
    if len(phrases) == 1:
        return _cap(rng.choice(OUTLINE_ONE).format(a=phrases[0]), world)
    template = rng.choice(OUTLINE_MANY)
    text = template.format(list=", ".join(phrases[:-1]), last=phrases[-1],
                           n=NUMBERS[len(phrases)])
    return _cap(text, world)


def _goal(family: str, combo: tuple, rng: random.Random, world: World) -> str:
    if "+" in family:
        return rng.choice(GOALS["pair"])
    f = _slots_text(family, combo[1:], rng, world)
    if family == "wait":
        f["n"] = json.dumps(seconds_of(combo[1]))
        if combo[1] in WORD_DURATIONS and rng.random() < 0.5:
            return f"{_cap(combo[1], world)} is {f['n']} seconds."
    return _cap(rng.choice(GOALS[family]).format(**f), world)


def _situation(sc: Scene, combo: tuple, rng: random.Random, world: World) -> str:
    f: dict[str, str] = {}
    entities = [world.by_name.get(v) for v in combo[1:]]
    obj = next((e for e in entities if e is not None and e.kind == "object"), None)
    if obj:
        f.update(_entity_fields("o", obj))
    if sc.location:
        f.update(_entity_fields("l", world.entity(next(iter(sc.location.values())))))
    if sc.inside:
        f.update(_entity_fields("c", world.entity(next(iter(sc.inside.values()))[0])))
    elif sc.at and world.entity(sc.at).kind == "container":
        f.update(_entity_fields("c", world.entity(sc.at)))
    elif sc.open:
        f.update(_entity_fields("c", world.entity(next(iter(sc.open)))))
    return _cap(rng.choice(SITUATIONS[sc.kind]).format(**f), world)


def thinking_text(family: str, combo: tuple, sc: Scene, steps: list[dict],
                  rng: random.Random, world: World) -> str:
    outline = _outline(steps, rng, world)
    if sc.kind:
        return f"{_situation(sc, combo, rng, world)} {outline}"
    if sc.distractor and rng.random() < 0.4:
        return f"{rng.choice(IRRELEVANT)} {outline}"
    if rng.random() < 0.35:
        return outline
    return f"{_goal(family, combo, rng, world)} {outline}"


