"""The open vocabulary: objects, places and containers named from word lists and made-up words,
so the demo learns to copy names from the task instead of recalling a closed world's.

Names are compositional ("small red toolbox", "garden shed"), numbered ("shelf 14", "locker
7b": no article, as in the closed worlds), multi-word, or made-up words the tokenizer splits
into several pieces ("the vornik", "blue traskel"). Every word (list words and made-up ones)
falls on one side of a fixed SHA-256 split: `train` names are built from train words only,
`heldout` names from held-out words only (a door may keep the word "door": "east door"), so
no held-out name, nor any other word of one, ever occurs in training. Words of the closed
worlds (`world.py`), of the phrasing templates and of the refusals are always train words.
"""

from __future__ import annotations

import hashlib
import random
import re
from functools import cache

from . import phrasing, refusals
from .world import WORLDS, Entity, World

SALT = "flash_planner-open-vocab-v1"
HELDOUT_SHARE = 0.22

# Nouns of things a robot can carry (singular, lowercase).
OBJECT_NOUNS = (
    "screwdriver wrench hammer stapler flashlight kettle teapot thermos ladle spatula whisk "
    "colander jug pitcher vase candle lantern clock radio speaker headset camera tripod "
    "drill pliers chisel ruler tape measure notebook binder clipboard marker pen pencil "
    "envelope parcel carton crate basket bucket pail tray mat rug cushion blanket scarf glove "
    "hat helmet jacket boot sneaker sock umbrella wallet purse backpack suitcase briefcase "
    "bottle flask jar can tin mug cup glass bowl plate saucer fork knife spoon pan pot lid "
    "sponge brush broom dustpan towel soap shampoo lotion toothbrush comb mirror remote "
    "charger cable adapter battery router keyboard mouse monitor tablet phone laptop printer "
    "scanner cartridge ball puzzle doll robot kite drum guitar violin flute trophy medal "
    "plant cactus seedling apple orange lemon melon pear banana onion potato carrot loaf "
    "muffin cookie sandwich pizza yogurt cheese butter jam honey cereal rice pasta flour "
    "sugar coffee tea valve gear bolt nut spring hinge pulley sensor motor fan filter hose "
    "nozzle funnel pipe bracket clamp rod panel tile brick plank beam sack bag pouch tote "
    "cooler canister barrel spool reel coil cone sign badge ticket map globe atlas dictionary "
    "magazine newspaper letter package box pallet jack cart trolley ladder stool").split()
# Places: (noun, preposition for "where something lies").
PLACE_NOUNS = tuple(tuple(p.split(":")) for p in (
    "workbench:on counter:on table:on desk:on shelf:on bench:on stand:on ledge:on platform:on "
    "dock:at station:at gate:at entrance:at exit:at corner:in corridor:in hall:in lobby:in "
    "garage:in porch:on patio:on balcony:on terrace:on attic:in basement:in cellar:in "
    "studio:in workshop:in library:in nursery:in pantry:in office:in lab:in classroom:in "
    "warehouse:in depot:at yard:in garden:in greenhouse:in shed:in barn:in stable:in "
    "kiosk:at booth:at counter:on desk:on rack:on cart:on trolley:on cabinet:on dresser:on "
    "sideboard:on mantel:on windowsill:on doorstep:on staircase:on landing:on "
    "bay:in zone:in area:in bay:in pier:on wharf:on ramp:on deck:on loft:in vestibule:in "
    "foyer:in den:in cafeteria:in canteen:in kitchenette:in laundry:in washroom:in "
    "mailroom:in storeroom:in stockroom:in showroom:in checkpoint:at reception:at"
).split())
# Containers that hold things, and things that open but hold nothing.
HOLDER_NOUNS = (
    "toolbox chest locker bin trunk hamper crate cupboard closet safe vault coffer box "
    "drawer cabinet fridge freezer cooler icebox wardrobe armoire bureau dresser pantry "
    "canister hopper tank silo tote cubby pigeonhole compartment").split()
DOOR_NOUNS = ("door gate hatch shutter flap barrier portal doorway trapdoor grille").split()
ADJECTIVES = (
    "red blue green yellow black white grey orange purple pink brown silver golden beige "
    "teal navy maroon olive violet cyan crimson amber ivory small large big tiny huge tall "
    "short long round square flat heavy light old new broken spare clean dirty empty full "
    "wooden metal plastic glass paper leather cotton steel copper ceramic rubber striped "
    "dotted shiny dusty folded damp warm cold soft hard").split()
PLACE_MODIFIERS = (
    "north south east west upper lower front back main side inner outer top bottom left "
    "right middle first second third old new small large rear central private shared "
    "guest staff").split()
# Heads of numbered names ("shelf 14", "package 4417"): places, objects.
NUMBERED_PLACES = (
    "shelf rack bay aisle dock pallet room zone station gate table desk bench slot cell row "
    "platform unit bed stall berth pad lane").split()
NUMBERED_OBJECTS = "box crate package parcel tote bin case kit drum tray sample unit".split()
IN_PLACES = ("aisle", "room", "zone", "bay", "cell", "row", "stall", "berth", "lane")
# Made-up words: onset + vowel (+ coda), two or three syllables.
ONSETS = ("b d f g h j k l m n p r s t v w z c ch sh br dr gr kr pl tr st sk sn fl gl sp qu "
          "th wr").split()
VOWELS = "a e i o u a e i o u ai ou ee oo y".split()
CODAS = ["", "", "", "n", "r", "l", "k", "x", "m", "s", "th", "ck", "nd", "sk", "p", "t"]
# Share of name words that are made up. Training leans on them: a made-up word can only be
# copied from the task, never recalled, so they teach copying (a model trained mostly on
# list words substituted familiar ones for new names: "cell 10" -> "cellar"). The held-out
# names keep the natural mix, mostly real words.
MADE_UP = {"train": 0.55, "heldout": 0.25}
# Training names also put made-up words where held-out names bring unseen list words: the
# heads of places and containers, adjectives, place modifiers and numbered heads. A model
# that saw only familiar words there stopped copying at the first unfamiliar one ("beige"
# for "beige gear", "mouvabrai" for "mouvabrai washroom", "bureau" for "bureau 4b").
# Held-out names draw exactly as before (no extra draws), so the held-out sets do not change.
MADE_UP_HEAD = {"train": 0.5, "heldout": 0.125}
MADE_UP_SLOT = 0.3       # adjectives, modifiers, numbered heads: training names only


def _held(word: str) -> bool:
    digest = hashlib.sha256(f"{SALT}|{word}".encode()).digest()
    return digest[0] < HELDOUT_SHARE * 256


@cache
def train_only_words() -> frozenset[str]:
    """Words of the closed worlds, their texts and the phrasing templates: never held out."""
    texts = list(closed_names())
    texts += [t for w in WORLDS for t in (*w.texts, *w.remarks)]
    for table in (phrasing.CLAUSES, phrasing.FROM_CLAUSES, phrasing.SENTENCES,
                  phrasing.FACTS, phrasing.GOALS, phrasing.SITUATIONS, phrasing.VERBS):
        texts += [t for options in table.values() for t in options]
    texts += phrasing.IRRELEVANT + phrasing.OUTLINE_ONE + phrasing.OUTLINE_MANY
    texts += [w for w, _ in phrasing.WRAPPERS] + phrasing.JOINERS
    texts += [*refusals.ACTIONS, *refusals.TRAIN_ACTIONS, *refusals.VAGUE, *refusals.TRAIN_VAGUE,
              *refusals.THOUGHTS, *refusals.VAGUE_THOUGHTS, *refusals.PARTIAL, *refusals.CLOSING]
    return frozenset(re.findall(r"[a-z]+", " ".join(texts).lower()))


def is_heldout(word: str) -> bool:
    return word not in train_only_words() and _held(word)


def _side(words, split: str) -> tuple[str, ...]:
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    want = split == "heldout"
    return tuple(w for w in words if is_heldout(w) == want)


@cache
def vocabulary(split: str) -> dict[str, tuple]:
    """The word lists of one side of the split."""
    places = tuple(p for p in PLACE_NOUNS if is_heldout(p[0]) == (split == "heldout"))
    return {"object": _side(OBJECT_NOUNS, split), "place": places,
            "holder": _side(HOLDER_NOUNS, split), "door": _side(DOOR_NOUNS, split),
            "adjective": _side(ADJECTIVES, split), "modifier": _side(PLACE_MODIFIERS, split),
            "numbered place": _side(NUMBERED_PLACES, split),
            "numbered object": _side(NUMBERED_OBJECTS, split)}


def made_up_word(rng: random.Random, split: str) -> str:
    """A pronounceable made-up word on the given side of the split."""
    want = split == "heldout"
    while True:
        word = "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS)
                       for _ in range(rng.choice((2, 2, 3))))
        if 4 <= len(word) <= 10 and is_heldout(word) == want:
            return word


def _word(rng: random.Random, words: tuple[str, ...], split: str) -> str:
    """A list word; on the training side sometimes a made-up word instead (MADE_UP_SLOT)."""
    if split == "train" and rng.random() < MADE_UP_SLOT:
        return made_up_word(rng, split)
    return rng.choice(words)


def _number(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.55:
        return str(rng.randint(1, 20))
    if roll < 0.8:
        return str(rng.randint(21, 999))
    return f"{rng.randint(1, 30)}{rng.choice('abcd')}"


def _noun(rng: random.Random, words: tuple[str, ...], split: str, made_up: float) -> str:
    return made_up_word(rng, split) if rng.random() < made_up else rng.choice(words)


def object_name(rng: random.Random, split: str) -> Entity:
    v = vocabulary(split)
    roll = rng.random()
    if roll < 0.12:
        return Entity(f"{_word(rng, v['numbered object'], split)} {_number(rng)}", "object",
                      article=False)
    noun = _noun(rng, v["object"], split, MADE_UP[split])
    if roll < 0.35:
        name = noun
    elif roll < 0.75:
        name = f"{_word(rng, v['adjective'], split)} {noun}"
    elif roll < 0.87:
        first, second = (_word(rng, v["adjective"], split) for _ in range(2))
        name = f"{first} {second} {noun}"
    else:
        name = f"{_noun(rng, v['object'], split, MADE_UP[split])} {noun}"
    return Entity(name, "object")


def place_name(rng: random.Random, split: str) -> Entity:
    v = vocabulary(split)
    noun, prep = rng.choice(v["place"])
    if rng.random() < MADE_UP_HEAD[split]:
        noun, prep = made_up_word(rng, split), rng.choice(("on", "at", "in"))
    roll = rng.random()
    if roll < 0.25:
        head = _word(rng, v["numbered place"], split)
        return Entity(f"{head} {_number(rng)}", "place", article=False,
                      prep="in" if head in IN_PLACES
                      else "at" if head in ("dock", "station", "gate", "pad") else "on")
    if roll < 0.45:
        return Entity(noun, "place", prep=prep)
    if roll < 0.75:
        return Entity(f"{_word(rng, v['modifier'], split)} {noun}", "place", prep=prep)
    if roll < 0.88:
        return Entity(f"{made_up_word(rng, split)} {noun}", "place", prep=prep)
    return Entity(f"{_word(rng, v['object'], split)} {noun}", "place", prep=prep)


def container_name(rng: random.Random, split: str, holds: bool = True) -> Entity:
    v = vocabulary(split)
    heads = v["holder"] if holds else v["door"]
    roll = rng.random()
    if roll < 0.2:
        name = f"{_word(rng, heads, split)} {_number(rng)}"
        return Entity(name, "container", article=False, prep="in", holds=holds)
    noun = rng.choice(heads) if holds or rng.random() < 0.6 else "door"
    if holds and rng.random() < MADE_UP_HEAD[split]:
        noun = made_up_word(rng, split)
    if roll < 0.45:
        name = noun
    elif roll < 0.8:
        name = f"{_word(rng, v['adjective'] if holds else v['modifier'], split)} {noun}"
    else:
        name = f"{made_up_word(rng, split)} {noun}"
    return Entity(name, "container", prep="in", holds=holds)


@cache
def closed_names() -> frozenset[str]:
    return frozenset(name for w in WORLDS for name in w.by_name)


def _distinct(make, n: int, taken: set[str]) -> tuple[Entity, ...]:
    """n entities whose names are new to `taken` (neither contains another) and are not the
    closed worlds' (held-out set (a) keeps its combinations out of training)."""
    out = []
    while len(out) < n:
        e = make()
        if e.name in closed_names():
            continue
        if e.name not in taken and not any(e.name in t or t in e.name for t in taken):
            taken.add(e.name)
            out.append(e)
    return tuple(out)


SAY_TEMPLATES = ("{o} is ready", "{o} is {lp} {l}", "please come to {l}", "I am bringing {o}",
                 "{o} has arrived", "meet me {lp} {l}", "{l} is clear", "{o} is missing",
                 "{l} needs cleaning", "I left {o} {lp} {l}")


def open_world(rng: random.Random, split: str) -> World:
    """A small world of freshly named entities (one task's cast) on one side of the split.
    Names never contain one another, so a plan argument names one entity unambiguously."""
    taken: set[str] = set()
    objects = _distinct(lambda: object_name(rng, split), 6, taken)
    places = _distinct(lambda: place_name(rng, split), 6, taken)
    holders = _distinct(lambda: container_name(rng, split), 3, taken)
    doors = _distinct(lambda: container_name(rng, split, holds=False), 1, taken)
    texts = []
    # the say texts of this cast: copied into the plan verbatim, like the names
    for template in rng.sample(SAY_TEMPLATES, 4):
        obj, place = rng.choice(objects), rng.choice(places)
        texts.append(template.format(o=obj.ref, l=place.ref, lp=place.prep))
    remarks = tuple(r for w in WORLDS for r in w.remarks)
    return World(f"open-{split}", objects, places, holders + doors, tuple(texts), remarks)
