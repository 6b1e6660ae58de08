"""From model output to a validated plan, or a precise reason why there is none.

The answer is the text after `</think>` (the whole text when the model did not think). The
first JSON object in it is parsed (code fences and trailing text are tolerated) and checked
against the JSON-Schema generated from the skill catalog with the `jsonschema` library:
first the plan's envelope, then each step's arguments against its skill's schema, so that an
error names the step, the skill and the argument. An invalid plan is never returned as one.
Given the request's words (`grounding.RequestWords`), a grounded argument that names nothing
the task or scene mentions is an error too, a `grounded: scene` argument must be one of the
request's listed scene names (the step then carries the listed name, not its short form), and
a `grounded: quote` one, when the task quotes any text, one of those texts as written. An
optional argument left out is filled in with its default, where the catalog gives one. Error
messages list at most `LISTED` values, the closest ones first.

Numbers are finite or an error (finite.py): `loads` and the answer's reader refuse `NaN`,
`Infinity` and `1e999`, and a number argument that is not finite (a plan given by a caller as
objects) fails validation.

A refusal, `{"refusal": REASON}`, is the planner's answer when the catalog cannot express
the task (docs/cli.md, "Refusals"): it raises `PlanRefused`, a `PlanError` carrying the reason.
"""

from __future__ import annotations

import difflib
import json
from typing import Any

from jsonschema import Draft202012Validator

from . import finite, plan_tree
from .grounding import RequestWords
from .skills import Skill, SkillCatalog

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

ENVELOPE = {
    "type": "object", "required": ["plan"], "additionalProperties": False,
    "properties": {"plan": {"type": "array", "minItems": 1, "items": {
        "type": "object", "required": ["skill", "args"], "additionalProperties": False,
        "properties": {"skill": {"type": "string"}, "args": {"type": "object"}}}}},
}
_STEP = Draft202012Validator(ENVELOPE["properties"]["plan"]["items"])
# a plan's envelope where its nodes may be structures (plan_tree.py), each leaf then a step
_TREE_ENVELOPE = Draft202012Validator({**ENVELOPE, "properties": {"plan": {
    **ENVELOPE["properties"]["plan"], "items": {"type": "object"}}}})
# The refusal shape, here and in the plan grammar. No minLength on the reason: xgrammar 0.2.8
# turns a string with a length bound into a rule that lets raw control characters through
# (invalid JSON); an empty reason is still a refusal.
REFUSAL_SCHEMA = {"type": "object", "required": ["refusal"], "additionalProperties": False,
                  "properties": {"refusal": {"type": "string"}}}
_REFUSAL = Draft202012Validator(REFUSAL_SCHEMA)


# values an error message lists at most (an enum of hundreds of names is not printed whole)
LISTED = 5


def closest(value: Any, allowed, n: int = LISTED) -> str:
    """`allowed` as a short list for an error: all of them when few, else the n closest to
    `value` in spelling and how many there are."""
    allowed = [str(a) for a in allowed]
    if len(allowed) <= n:
        return ", ".join(allowed)
    near = difflib.get_close_matches(str(value), allowed, n=n, cutoff=0.0)
    return f"{len(allowed)} of them, the closest: {', '.join(near)}"


class PlanError(ValueError):
    """The model's output is not a valid plan; the message says precisely why."""


def loads(text: str) -> Any:
    """JSON text as Python values; PlanError for NaN, Infinity or a number past float's
    range, json.JSONDecodeError (a ValueError) for text that is not JSON."""
    try:
        return finite.loads(text)
    except finite.NotFinite as exc:
        raise PlanError(str(exc)) from None


class PlanRefused(PlanError):
    """The model answered with a refusal: the catalog cannot express the task."""

    def __init__(self, reason: str):
        super().__init__(f"the planner refused the task: {reason or '(no reason given)'}")
        self.reason = reason


def refusal_reason(obj: Any) -> str | None:
    """The reason of a refusal object ('' if empty), or None when `obj` is not one."""
    return obj["refusal"].strip() if _REFUSAL.is_valid(obj) else None


def split_answer(text: str) -> tuple[str, str]:
    """(thinking, answer). Raises PlanError if a thinking block was opened and not closed."""
    if THINK_CLOSE in text:
        thinking, _, answer = text.partition(THINK_CLOSE)
        return thinking.replace(THINK_OPEN, "").strip(), answer.strip()
    if THINK_OPEN in text:
        raise PlanError("the model's thinking never ended (no </think>): no answer was given")
    return "", text.strip()


def extract_json(answer: str, truncated: bool = False) -> Any:
    """The first JSON object in the answer; code fences and trailing text are ignored."""
    start = answer.find("{")
    if start < 0:
        if truncated:
            raise PlanError("output truncated at max_new_tokens before the JSON plan began")
        shown = answer if len(answer) <= 60 else answer[:57] + "..."
        raise PlanError(f"the answer is not JSON (no '{{' found): {shown!r}")
    try:
        obj, _ = finite.STRICT_JSON.raw_decode(answer[start:])
    except finite.NotFinite as exc:
        raise PlanError(str(exc)) from None
    except json.JSONDecodeError as exc:
        if truncated:
            raise PlanError("output truncated at max_new_tokens: the JSON plan is "
                            "incomplete") from exc
        raise PlanError(f"the answer is not valid JSON: {exc.msg} at line {exc.lineno} "
                        f"column {exc.colno}") from exc
    return obj


def _where(path) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)


def _describe(error, name: str, skill: Skill) -> str:
    at = f"{name} ({skill.name})"
    if error.validator == "required":
        missing = next(k for k in error.validator_value if k not in error.instance)
        return f"{at}: missing argument '{missing}'"
    if error.validator == "additionalProperties":
        allowed = sorted(a.name for a in skill.args)
        extra = sorted(k for k in error.instance if k not in allowed)
        if not allowed:
            return f"{at}: unexpected argument '{extra[0]}' ({skill.name} takes no arguments)"
        return f"{at}: unexpected argument '{extra[0]}' (allowed: {', '.join(allowed)})"
    arg = error.path[0] if error.path else "?"
    if error.validator == "type":
        got = type(error.instance).__name__
        optional = any(a.name == arg and not a.required for a in skill.args)
        hint = " (leave an optional argument out instead of null)" \
            if optional and error.instance is None else ""
        return f"{at}: argument '{arg}' must be {error.validator_value}, got {got}{hint}"
    if error.validator == "enum":
        return (f"{at}: argument '{arg}' is {error.instance!r}, not one of its values "
                f"({closest(error.instance, error.validator_value)})")
    return f"{at}: argument '{arg}': {error.message}"


def validate_step(step: Any, index: int, catalog: SkillCatalog,
                  words: RequestWords | None = None, called: str | None = None
                  ) -> dict[str, Any]:
    """One step of a plan (0-based `index`; `called` how errors name it, "step INDEX+1" unless
    given) as the robot gets it, or PlanError naming its problem. Given the request's words,
    a grounded argument must be a run of them, or with a scene list a `grounded: scene` one
    a listed name (replaced by the entry's full name), or with quotes in the task a
    `grounded: quote` one a quoted text; optional arguments left out get their defaults."""
    called = called or f"step {index + 1}"
    error = next(iter(_STEP.iter_errors(step)), None)
    if error is not None:
        raise PlanError(f"{called}: {error.message}")
    skill = catalog.get(step["skill"])
    if skill is None:
        raise PlanError(f"{called}: unknown skill '{step['skill']}' "
                        f"(known: {closest(step['skill'], catalog.names)})")
    errors = sorted(Draft202012Validator(skill.args_schema()).iter_errors(step["args"]),
                    key=lambda e: (e.validator != "required", list(e.path)))
    if errors:
        raise PlanError(_describe(errors[0], called, skill))
    args = dict(step["args"])
    for arg in skill.args:
        if arg.type in ("number", "integer") and arg.name in args \
                and not finite.finite_number(args[arg.name]):
            raise PlanError(f"{called} ({skill.name}): argument '{arg.name}' must be "
                            f"a finite number, got {args[arg.name]!r}")
    for arg in skill.grounded if words is not None else ():
        if arg.name not in args:
            continue
        value = args[arg.name]
        why = None
        if arg.grounded == "quote":
            if words.quotes and value not in words.quotes:
                why = f"is none of the texts the task quotes ({closest(value, words.quotes)})"
        elif arg.grounded == "scene" and words.scene:
            name = words.scene_name(value)
            if name is None:
                why = f"is not in the scene list (nearest: {', '.join(words.nearest(value))})"
            else:
                args[arg.name] = name
        elif not words.contains(value):
            why = "the task and scene never mention"
        if why is not None:
            raise PlanError(f"{called} ({skill.name}): argument '{arg.name}' is "
                            f"{value!r}, which {why}")
    for arg in skill.args:
        if arg.name not in args and arg.default is not None:
            args[arg.name] = arg.default
    return {**step, "args": args}


def validate_plan(obj: Any, catalog: SkillCatalog, words: RequestWords | None = None
                  ) -> list[dict[str, Any]]:
    """The plan's nodes, each step validated (a plan of plain steps: its steps; with
    structures, plan_tree.py, the same structures around validated steps), or PlanError
    naming the first problem (PlanRefused: a refusal); given the request's words, grounded
    arguments are checked against them. A nested step is named by its number among the
    plan's steps and its node's path."""
    reason = refusal_reason(obj)
    if reason is not None:
        raise PlanRefused(reason)
    envelope = next(iter(sorted(_TREE_ENVELOPE.iter_errors(obj), key=lambda e: list(e.path))),
                    None)
    if envelope is not None:
        where = _where(envelope.path) or "the plan"
        raise PlanError(f"{where}: {envelope.message} (expected "
                        '{"plan": [{"skill": NAME, "args": {...}}, ...]})')
    try:
        tree = plan_tree.tree_of(obj["plan"])
    except plan_tree.TreeError as exc:
        raise PlanError(str(exc)) from None
    checked = []
    for leaf in plan_tree.leaves(tree):
        flat = len(leaf.path) == 1
        shape = next(iter(sorted(_STEP.iter_errors(leaf.step), key=lambda e: list(e.path))),
                     None)
        if shape is not None and flat:
            raise PlanError(f"plan[{leaf.path[0]}]{_where(shape.path)}: {shape.message} "
                            '(expected {"skill": NAME, "args": {...}} or a retry or fallback)')
        name = None if flat else f"step {leaf.index + 1} (node {plan_tree.label(leaf.path)})"
        checked.append(validate_step(leaf.step, leaf.index, catalog, words, name))
    return plan_tree.plan_of(plan_tree.with_steps(tree, checked))


def parse_plan(text: str, catalog: SkillCatalog, truncated: bool = False,
               words: RequestWords | None = None) -> tuple[list[dict[str, Any]], str]:
    """(validated steps, thinking) from the model's full output text (`words`: the
    request's, which grounded arguments must come from)."""
    thinking, answer = split_answer(text)
    return validate_plan(extract_json(answer, truncated), catalog, words), thinking
