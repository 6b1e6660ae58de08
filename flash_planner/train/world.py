"""The corpus's world model: objects, places and containers of two worlds, durations, what a
scene line can say (`Scene`), and the content slots of each task family."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property


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

    @property
    def cap_ref(self) -> str:
        """`ref` at the start of a sentence: "The red cup", but "shelf 3" (names keep their
        case: the plan's arguments write them so)."""
        return f"The {self.name}" if self.article else self.name


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

    @cached_property
    def by_name(self) -> dict[str, Entity]:
        return {e.name: e for e in (*self.objects, *self.places, *self.containers)}

    def entity(self, name: str) -> Entity:
        return self.by_name[name]


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
WORD_DURATIONS = {"half a minute": 30, "a minute": 60, "one minute": 60, "two minutes": 120,
                  "ten seconds": 10, "five seconds": 5}
NUMBER_DURATIONS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 15, 20, 25, 30, 40, 45, 60, 90, 120, 180,
                    300, 600, 0.5, 1.5, 2.5, 3.5, 7.5, 12.5, 0.25)
DURATIONS = tuple(json.dumps(n) for n in NUMBER_DURATIONS) + tuple(WORD_DURATIONS)


def seconds_of(duration: str) -> int | float:
    """The JSON number for a duration slot: "2.5" -> 2.5, "a minute" -> 60."""
    return WORD_DURATIONS[duration] if duration in WORD_DURATIONS else json.loads(duration)


# --- plans -----------------------------------------------------------------------------------


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



SLOTS = {"go": ("target",), "say": ("text",), "wait": ("duration",), "open": ("container",),
         "close": ("container",), "pick": ("object",), "fetch": ("object", "place"),
         "put": ("object", "holder")}


def family_parts(family: str) -> list[str]:
    return family.split("+")

