"""Tasks the skill catalog cannot express, and how the corpus answers them: a refusal.

Three kinds: an action no skill performs ("polish the brass lamp", "lock locker 4"), the same
after a clause the catalog can do ("go to the hall, then sweep the hall": a plan that does
half the task is worse than none), and a task that names nothing to act on ("pick it up").
The thinking says why; the answer is `{"refusal": REASON}`. Actions and vague phrasings
fall on one side of a fixed SHA-256 split, so the held-out refusals use actions the model
never saw refused.
"""

from __future__ import annotations

import hashlib
import random

from .phrasing import CLAUSES, JOINERS, WRAPPERS
from .world import World

SALT = "flash_planner-refusal-v1"
HELDOUT_SHARE = 0.25

# "{x}" is what the action is done to: {o} an object, {p} a place, {c} a container.
ACTIONS = (
    "clean {o}", "wash {o}", "paint {o}", "repair {o}", "fix {o}", "cut {o}", "fold {o}",
    "iron {o}", "charge {o}", "plug in {o}", "water {o}", "heat {o}", "cool down {o}",
    "fill {o}", "empty {o}", "pour out {o}", "sort {o}", "label {o}", "polish {o}",
    "dust {o}", "weigh {o}", "measure {o}", "photograph {o}", "scan {o}", "recycle {o}",
    "throw {o}", "kick {o}", "hide {o}", "squeeze {o}", "spray {o}", "bake {o}", "boil {o}",
    "fry {o}", "chop {o}", "slice {o}", "peel {o}", "stir {o}", "sew {o}", "wrap {o}",
    "unwrap {o}", "tie up {o}", "sharpen {o}", "glue {o}", "sand {o}", "hammer {o}",
    "switch on {o}", "turn off {o}", "count {o}", "shake {o}", "rinse {o}", "dry {o}",
    "sweep {p}", "mop {p}", "vacuum {p}", "tidy up {p}", "decorate {p}", "patrol {p}",
    "light up {p}", "guard {p}", "scrub {p}", "ventilate {p}", "photograph {p}",
    "lock {c}", "unlock {c}", "repaint {c}", "knock on {c}", "oil {c}", "bolt {c}",
    "sing a song", "dance", "order a pizza", "call an ambulance", "play some music",
    "turn on the lights", "set an alarm", "send an email", "check the weather",
    "take a nap", "make coffee", "cook dinner", "do the dishes", "feed the cat",
)
# More actions, refused in training only (the held-out actions stay those of the split
# above): the wider the inventory the model saw refused, the better it refuses actions it never
# saw (held-out set (c)). None starts with a verb that plain tasks start with (take, get, put,
# go, open, close, turn, light): trained with "take a picture" and "go to sleep" refused, the
# demo refused "open the fridge, take the milk and say done" too. Known leak, kept until the
# next retrain (removing them changes the shipped pair's corpus): "clean up {p}" and "wash down
# {p}" share a verb with the held-out "clean {o}" and "wash {o}", as "switch off" does with
# "switch on" (docs/performance.md: set (c) reads 91.5% refused without their help, not 92.5).
TRAIN_ACTIONS = (
    "lubricate {o}", "disinfect {o}", "tighten {o}", "loosen {o}", "unscrew {o}", "assemble {o}",
    "dismantle {o}", "calibrate {o}", "test {o}", "refill {o}", "stack {o}", "rotate {o}",
    "flip {o}", "twist {o}", "bend {o}", "crush {o}", "melt {o}", "freeze {o}", "microwave {o}",
    "toast {o}", "grill {o}", "taste {o}", "smell {o}", "inflate {o}", "staple {o}", "print {o}",
    "sign {o}", "stamp {o}", "tag {o}", "inspect {o}", "sterilize {o}", "mend {o}", "patch {o}",
    "untangle {o}", "feed {o}", "break {o}", "bury {o}", "blow out {o}", "switch off {o}",
    "power up {o}", "reboot {o}", "sketch {o}", "throw away {o}", "search {p}", "explore {p}",
    "map {p}", "heat up {p}", "rake {p}", "evacuate {p}", "lock up {p}", "inspect {p}", "tidy {p}",
    "seal {c}", "empty {c}", "label {c}", "dust {c}", "fix {c}", "paint {c}", "tell a joke",
    "write a poem", "call my mother", "book a taxi", "walk the dog", "make the bed",
    "brew some tea", "read me the news", "jump", "recharge your battery", "count to ten",
    "sit down", "wave hello", "warm up {o}", "chill {o}", "defrost {o}", "power down {o}",
    "recharge {o}", "wipe {o}", "soak {o}", "steam {o}", "roast {o}", "mash {o}", "grate {o}",
    "dice {o}", "shred {o}", "knit {o}", "varnish {o}", "decorate {o}", "dim {p}",
    "brighten {p}", "air out {p}", "hose down {p}", "clean up {p}", "wash down {p}",
    "dust off {p}", "shovel {p}", "hum a tune", "do a dance", "have a rest", "meditate",
)
# Tasks with an action the catalog has but nothing named to act on.
VAGUE = (
    "pick it up", "grab that", "bring it here", "put it over there", "take that one",
    "go there", "go over there", "open it", "close it", "shut that", "put it away",
    "move this", "fetch it", "bring me that", "do it", "do that again", "carry it",
    "hand it over", "drop it somewhere", "go somewhere", "pick something up",
    "open something", "bring something", "take it back", "put that one in there",
    "move it over here", "get that thing", "leave it there", "go back there",
    "close the other one",
)
# More of them, refused in training only (the held-out ones stay those of the split above):
# an action the catalog has, done to a pronoun ("it", "that one", "the other one", "them").
TRAIN_VAGUE = (
    "open that one", "shut it", "close that", "open the other one", "grab the other one",
    "pick that one up", "take this", "bring those here", "put them away", "carry that over there",
    "move it", "fetch that one", "get it", "lift that", "bring it back", "put it back",
    "take it away", "shut the other one", "close this one", "open this one", "go over here",
    "head there", "drive over there", "get the other one", "move the other one",
    "put this one there", "take them", "grab it", "pick them up", "hand me that",
    "bring this one over", "put it there", "place it over there", "open them", "close them",
    "go to it", "navigate there", "pick the other one up",
)
THOUGHTS = ["I have no skill to {v}.", "None of my skills can {v}.",
            "The skills cannot {v}.", "There is no skill to {v}."]
VAGUE_THOUGHTS = ["The task does not say what to act on.",
                  "Nothing in the task names an object or a place.",
                  "I cannot tell which object or place is meant."]
PARTIAL = ["I could do the first part, but not the rest.", "Only part of this is possible.",
           "Part of the task needs a skill I do not have."]
CLOSING = ["So I refuse.", "I cannot plan this.", "I have to refuse this task.",
           "So there is no plan."]
VAGUE_REASON = "the task names nothing to act on"


def _held(text: str) -> bool:
    digest = hashlib.sha256(f"{SALT}|{text}".encode()).digest()
    return digest[0] < HELDOUT_SHARE * 256


def side(options: tuple[str, ...], split: str) -> tuple[str, ...]:
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    return tuple(o for o in options if _held(o) == (split == "heldout"))


def actions(split: str) -> tuple[str, ...]:
    """The actions refused on one side: the split's share of ACTIONS, and in training
    TRAIN_ACTIONS too."""
    return side(ACTIONS, split) + (TRAIN_ACTIONS if split == "train" else ())


def vague(split: str) -> tuple[str, ...]:
    """The vague tasks of one side: the split's share of VAGUE, and in training TRAIN_VAGUE."""
    return side(VAGUE, split) + (TRAIN_VAGUE if split == "train" else ())


def verb_of(action: str) -> str:
    """The action's words before what it acts on: "tie up {o}" -> "tie up"."""
    return action.split(" {")[0]


def refusal_task(world: World, rng: random.Random, split: str
                 ) -> tuple[str, str, str]:
    """(task, thinking, reason) of one task the catalog cannot express."""
    roll = rng.random()
    if roll < 0.2:
        core = rng.choice(vague(split))
        thinking = f"{rng.choice(VAGUE_THOUGHTS)} {rng.choice(CLOSING)}"
        reason = VAGUE_REASON
    else:
        action = rng.choice(actions(split))
        fields = {"o": rng.choice(world.objects).ref, "p": rng.choice(world.places).ref,
                  "c": rng.choice(world.containers).ref}
        core = action.format(**fields)
        verb = verb_of(action)
        thinking = rng.choice(THOUGHTS).format(v=verb)
        reason = f"no skill to {verb}"
        if roll < 0.45:
            clause = rng.choice(CLAUSES["go"]).format(p=rng.choice(world.places).ref)
            a, b = (clause, core) if rng.random() < 0.7 else (core, clause)
            core = rng.choice(JOINERS).format(a=a, b=b)
            thinking = f"{rng.choice(PARTIAL)} {thinking}"
        thinking = f"{thinking} {rng.choice(CLOSING)}"
    pattern, question = rng.choice(WRAPPERS)
    if ". " in core:
        pattern, question = "{c}", False
    text = pattern.format(c=core)
    if rng.random() < 0.75:
        text = text[:1].upper() + text[1:]
    return text + ("?" if question else rng.choice([".", ".", "", "!"])), thinking, reason
