"""The skill catalog as OpenAI function tools, and calls of them checked as plans are.

An outside agent (an OpenAI-tools framework, an MCP host) that is handed our skills as
tools gets, per skill, a function whose parameters are the skill's arguments' schema; with a
scene list, the grounded arguments are held to the scene's names as the plan grammar holds
them. Calls it makes come back through `check_calls`, which runs `validate_plan`: the same
checks, grounding and defaults a plan of ours gets.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from .grounding import RequestWords
from .parse import validate_plan
from .skills import SkillCatalog


def _words(task: str, scene: Sequence[str]) -> RequestWords | None:
    return RequestWords.of(task, "", tuple(scene)) if task or scene else None


def skill_tools(catalog: SkillCatalog, scene: Sequence[str] = (), task: str = ""
                ) -> list[dict[str, Any]]:
    """Each skill as {"type": "function", "function": {name, description, parameters}};
    given a scene (or a task), grounded arguments admit only its names (or words)."""
    words = _words(task, scene)
    return [{"type": "function",
             "function": {"name": skill.name, "description": skill.description,
                          "parameters": skill.args_schema(words)}}
            for skill in catalog.skills]


def check_calls(catalog: SkillCatalog, calls: Iterable[tuple[str, dict]], task: str = "",
                scene: Sequence[str] = ()) -> list[dict[str, Any]]:
    """The calls, in order, as validated plan steps, or `parse.PlanError` naming the first
    problem (an unknown skill, an argument outside its schema, a name the scene never
    lists)."""
    plan = {"plan": [{"skill": name, "args": args} for name, args in calls]}
    return validate_plan(plan, catalog, _words(task, scene))
