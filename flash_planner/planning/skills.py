"""The skill catalog (config/skills.yaml) and the JSON-Schema of a plan generated from it.

A string argument marked `grounded: true` names something the request mentions: with the
request's words (`grounding.RequestWords`) its schema admits only their runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .grounding import RequestWords

ARG_TYPES = ("string", "number", "integer", "boolean")
CONSTRAINTS = ("enum", "minimum", "maximum")


class CatalogError(ValueError):
    """A skill catalog that cannot be used; the message names the file and entry."""


@dataclass(frozen=True)
class Argument:
    name: str
    type: str
    description: str = ""
    constraints: tuple[tuple[str, Any], ...] = ()
    grounded: bool = False        # the value is a run of words of the task or scene

    def schema(self, words: RequestWords | None = None) -> dict[str, Any]:
        """JSON-Schema of the value; a grounded argument's, given the request's words,
        admits only their runs."""
        schema = {"type": self.type, **dict(self.constraints)}
        if self.grounded and words is not None and words.pattern is not None:
            schema["pattern"] = words.pattern
        return schema

    def signature(self) -> str:
        """`name` for a plain string argument, else `name: type` and its constraints."""
        if self.type == "string" and not self.constraints:
            return self.name
        extra = "".join(f" {k} {v}" for k, v in self.constraints)
        return f"{self.name}: {self.type}{extra}"


@dataclass(frozen=True)
class Skill:
    name: str
    description: str
    args: tuple[Argument, ...]

    def args_schema(self, words: RequestWords | None = None) -> dict[str, Any]:
        return {"type": "object", "properties": {a.name: a.schema(words) for a in self.args},
                "required": [a.name for a in self.args], "additionalProperties": False}

    @property
    def grounded(self) -> tuple[Argument, ...]:
        return tuple(a for a in self.args if a.grounded)

    def signature(self) -> str:
        return f"{self.name}({', '.join(a.signature() for a in self.args)})"


@dataclass(frozen=True)
class SkillCatalog:
    skills: tuple[Skill, ...]

    @classmethod
    def from_yaml(cls, path: str | Path) -> SkillCatalog:
        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text())
        except OSError as exc:
            raise CatalogError(f"skill catalog {path} is not readable ({exc})") from exc
        except yaml.YAMLError as exc:
            raise CatalogError(f"skill catalog {path} is not valid YAML ({exc})") from exc
        return cls.from_dict(data, where=str(path))

    @classmethod
    def from_dict(cls, data: Any, where: str = "skill catalog") -> SkillCatalog:
        if not isinstance(data, dict) or not isinstance(data.get("skills"), list):
            raise CatalogError(f"{where}: expected a mapping with a 'skills' list")
        skills, seen = [], set()
        for i, entry in enumerate(data["skills"]):
            skill = _skill(entry, f"{where}: skills[{i}]")
            if skill.name in seen:
                raise CatalogError(f"{where}: skill '{skill.name}' is defined twice")
            seen.add(skill.name)
            skills.append(skill)
        if not skills:
            raise CatalogError(f"{where}: the catalog has no skills")
        return cls(tuple(skills))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.skills)

    def get(self, name: str) -> Skill | None:
        return next((s for s in self.skills if s.name == name), None)

    @property
    def has_grounded(self) -> bool:
        return any(s.grounded for s in self.skills)

    def plan_schema(self, words: RequestWords | None = None) -> dict[str, Any] | None:
        """JSON-Schema of a whole plan: {"plan": [{"skill": NAME, "args": {...}}, ...]}.
        Given the request's words, grounded arguments admit only their runs, and a skill
        with one is left out when the request has no words (None: no plan is possible)."""
        unnameable = words is not None and words.pattern is None
        steps = [{"type": "object",
                  "properties": {"skill": {"const": s.name}, "args": s.args_schema(words)},
                  "required": ["skill", "args"], "additionalProperties": False}
                 for s in self.skills if not (unnameable and s.grounded)]
        if not steps:
            return None
        return {"type": "object", "required": ["plan"], "additionalProperties": False,
                "properties": {"plan": {"type": "array", "minItems": 1,
                                        "items": {"oneOf": steps}}}}


def _skill(entry: Any, where: str) -> Skill:
    if not isinstance(entry, dict):
        raise CatalogError(f"{where}: expected a mapping")
    name = entry.get("name")
    if not isinstance(name, str) or not name.isidentifier():
        raise CatalogError(f"{where}: 'name' must be an identifier, got {name!r}")
    args = entry.get("args") or {}
    if not isinstance(args, dict):
        raise CatalogError(f"{where} ({name}): 'args' must be a mapping")
    return Skill(name, str(entry.get("description", "")),
                 tuple(_argument(k, v, f"{where} ({name}) argument '{k}'")
                       for k, v in args.items()))


def _argument(name: str, spec: Any, where: str) -> Argument:
    if isinstance(spec, str):
        spec = {"type": spec}
    if not isinstance(spec, dict) or spec.get("type") not in ARG_TYPES:
        raise CatalogError(f"{where}: 'type' must be one of {ARG_TYPES}")
    unknown = sorted(set(spec) - {"type", "description", "grounded", *CONSTRAINTS})
    if unknown:
        raise CatalogError(f"{where}: unknown field(s) {unknown}")
    constraints = tuple((k, spec[k]) for k in CONSTRAINTS if k in spec)
    _check_constraints(spec["type"], dict(constraints), where)
    grounded = spec.get("grounded", False)
    if not isinstance(grounded, bool):
        raise CatalogError(f"{where}: 'grounded' must be true or false, got {grounded!r}")
    if grounded and (spec["type"] != "string" or "enum" in spec):
        raise CatalogError(f"{where}: 'grounded' applies to string arguments without an "
                           "enum (a name taken from the request)")
    return Argument(name, spec["type"], str(spec.get("description", "")), constraints,
                    grounded)


_PYTHON_TYPES = {"string": str, "number": (int, float), "integer": int, "boolean": bool}


def _check_constraints(kind: str, c: dict[str, Any], where: str) -> None:
    """Constraints no value can meet are catalog errors (the plan grammar could not be
    compiled from them, and no plan could validate)."""
    if "enum" in c:
        enum = c["enum"]
        if not isinstance(enum, list) or not enum:
            raise CatalogError(f"{where}: 'enum' must be a non-empty list")
        bad = [v for v in enum if not isinstance(v, _PYTHON_TYPES[kind])
               or (kind != "boolean" and isinstance(v, bool))]
        if bad:
            raise CatalogError(f"{where}: enum value {bad[0]!r} is not of type {kind}")
    for bound in ("minimum", "maximum"):
        if bound not in c:
            continue
        if kind not in ("number", "integer"):
            raise CatalogError(f"{where}: '{bound}' applies to number and integer arguments")
        if isinstance(c[bound], bool) or not isinstance(c[bound], (int, float)):
            raise CatalogError(f"{where}: '{bound}' must be a number, got {c[bound]!r}")
    if "minimum" in c and "maximum" in c and c["minimum"] > c["maximum"]:
        raise CatalogError(f"{where}: minimum {c['minimum']} is above maximum {c['maximum']}")
