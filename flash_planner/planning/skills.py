"""The skill catalog (config/skills.yaml) and the JSON-Schema of a plan generated from it.

A string argument marked `grounded: true` names something the request mentions: with the
request's words (`grounding.RequestWords`) its schema admits only their runs. One marked
`grounded: scene` names one of the objects and places the request lists (`scene`, from
perception): with a scene list its schema is that list's names as an enum; without one it
follows the phrase rule of `grounded: true`. One marked `grounded: quote` is a text to say:
when the task quotes any, its schema is the task's quoted texts as an enum (else any string).
An argument with `required: false` (or a `default`) may be left out; the validated step then
carries its default, if it has one.
A skill may name what executes it (an action or service, bindings.py); one that does not is
plan-only. An argument a bound goal takes as a place (`{location:ARG}`) admits only the
location table's names in the plan's schema (with the request's words, only the names the
request mentions when it is grounded), so that no plan names a place the gate would refuse.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from .bindings import (
    Binding,
    BindingError,
    Location,
    Workspace,
    read_binding,
    read_locations,
    read_workspace,
    unknown_place,
)
from .finite import finite_number
from .grounding import RequestWords

ARG_TYPES = ("string", "number", "integer", "boolean")
CONSTRAINTS = ("enum", "minimum", "maximum")
ARG_FIELDS = ("type", "description", "grounded", "required", "default", *CONSTRAINTS)
SKILL_FIELDS = ("name", "description", "args", "action", "service", "approve", "limits")
TOP_FIELDS = ("skills", "enum_shown", "locations", "workspace")
GROUNDED = (False, True, "scene", "quote")
# A signature lists an enum's values up to this many; past it, their count and the first few
# (the grammar and the validator keep the whole set). A catalog may set `enum_shown`.
ENUM_SHOWN = 8
ENUM_EXAMPLES = 3


class CatalogError(ValueError):
    """A skill catalog that cannot be used; the message names the file and entry."""


def _catalog_error(exc: BindingError) -> CatalogError:
    return CatalogError(str(exc))


@dataclass(frozen=True)
class Argument:
    name: str
    type: str
    description: str = ""
    constraints: tuple[tuple[str, Any], ...] = ()
    # True: words of the task or scene; "scene": a scene name; "quote": a text the task quotes
    grounded: bool | str = False
    required: bool = True
    default: Any = None           # filled in when an optional argument is left out

    def schema(self, words: RequestWords | None = None) -> dict[str, Any]:
        """JSON-Schema of the value; a grounded argument's, given the request's words,
        admits only their runs, or (`grounded: scene` with a scene list) a scene name, or
        (`grounded: quote` when the task quotes) a quoted text."""
        schema = {"type": self.type, **dict(self.constraints)}
        if self.grounded == "quote":
            if words is not None and words.quotes:
                schema["enum"] = list(words.quotes)
        elif self.grounded == "scene" and words is not None and words.scene:
            schema["enum"] = list(words.scene_values)
        elif self.grounded and words is not None and words.pattern is not None:
            schema["pattern"] = words.pattern
        return schema

    def signature(self, enum_shown: int = ENUM_SHOWN) -> str:
        """`name` for a plain string argument, else `name: type` and its constraints; `name?`
        when it may be left out, `name ... = default` when it has a default. An enum longer
        than `enum_shown` shows its count and first values."""
        name = self.name if self.required or self.default is not None else f"{self.name}?"
        default = "" if self.default is None else f" = {self.default!r}"
        if self.type == "string" and not self.constraints:
            return f"{name}{default}"
        extra = "".join(f" {k} {_shown(k, v, enum_shown)}" for k, v in self.constraints)
        return f"{name}: {self.type}{extra}{default}"


def _shown(key: str, value: Any, enum_shown: int) -> Any:
    if key != "enum" or len(value) <= enum_shown:
        return value
    first = ", ".join(repr(v) for v in value[:ENUM_EXAMPLES])
    return f"(one of {len(value)} values, e.g. {first})"


@dataclass(frozen=True)
class Skill:
    name: str
    description: str
    args: tuple[Argument, ...]

    def args_schema(self, words: RequestWords | None = None) -> dict[str, Any]:
        return {"type": "object", "properties": {a.name: a.schema(words) for a in self.args},
                "required": [a.name for a in self.args if a.required],
                "additionalProperties": False}

    @property
    def grounded(self) -> tuple[Argument, ...]:
        return tuple(a for a in self.args if a.grounded)

    @property
    def names_things(self) -> bool:
        """Whether an argument names a thing of the request (`grounded` true or scene): a
        request with no words to name leaves the skill out of its plans."""
        return any(a.grounded in (True, "scene") for a in self.args)

    def signature(self, enum_shown: int = ENUM_SHOWN) -> str:
        return f"{self.name}({', '.join(a.signature(enum_shown) for a in self.args)})"


@dataclass(frozen=True)
class SkillCatalog:
    skills: tuple[Skill, ...]
    enum_shown: int = ENUM_SHOWN    # enum values a signature lists (see ENUM_SHOWN)
    # skill name -> what executes it (bindings.py); the named locations and the workspace
    bindings: dict[str, Binding] = field(default_factory=dict)
    locations: dict[str, Location] | None = None
    workspace: Workspace | None = None

    @classmethod
    def from_yaml(cls, path: str | Path) -> SkillCatalog:
        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text())
        except OSError as exc:
            raise CatalogError(f"skill catalog {path} is not readable ({exc})") from exc
        except yaml.YAMLError as exc:
            raise CatalogError(f"skill catalog {path} is not valid YAML ({exc})") from exc
        return cls.from_dict(data, where=str(path), base=path.parent)

    @classmethod
    def from_dict(cls, data: Any, where: str = "skill catalog",
                  base: Path | None = None) -> SkillCatalog:
        """`base`: the directory a `locations` file is relative to (the catalog's)."""
        if not isinstance(data, dict) or not isinstance(data.get("skills"), list):
            raise CatalogError(f"{where}: expected a mapping with a 'skills' list")
        unknown = sorted(set(data) - set(TOP_FIELDS))
        if unknown:
            raise CatalogError(f"{where}: unknown top-level field(s) {unknown} (known: "
                               f"{', '.join(TOP_FIELDS)})")
        try:
            locations = (None if data.get("locations") is None else read_locations(
                (base or Path.cwd()) / str(data["locations"]), where))
            workspace = (None if data.get("workspace") is None
                         else read_workspace(data["workspace"], where))
        except BindingError as exc:
            raise _catalog_error(exc) from None
        skills, seen, bindings = [], set(), {}
        for i, entry in enumerate(data["skills"]):
            at = f"{where}: skills[{i}]"
            skill = _skill(entry, at)
            if skill.name in seen:
                raise CatalogError(f"{where}: skill '{skill.name}' is defined twice")
            seen.add(skill.name)
            skills.append(skill)
            try:
                binding = read_binding(skill.name, entry, {a.name: a for a in skill.args},
                                       locations, at)
            except BindingError as exc:
                raise _catalog_error(exc) from None
            if binding is not None:
                bindings[skill.name] = binding
        if not skills:
            raise CatalogError(f"{where}: the catalog has no skills")
        shown = data.get("enum_shown", ENUM_SHOWN)
        if isinstance(shown, bool) or not isinstance(shown, int) or shown < 0:
            raise CatalogError(f"{where}: 'enum_shown' must be a non-negative integer, "
                               f"got {shown!r}")
        return cls(tuple(skills), shown, bindings, locations, workspace)

    def without(self, names) -> SkillCatalog:
        """This catalog less the skills `names` (what a plan may name while their servers
        are away)."""
        names = set(names)
        return replace(self, skills=tuple(s for s in self.skills if s.name not in names),
                       bindings={k: b for k, b in self.bindings.items() if k not in names})

    def with_locations(self, locations: dict[str, Location]) -> SkillCatalog:
        """This catalog with another location table (one sent at run time); CatalogError
        when an argument's enum names a place the table does not hold."""
        for skill, binding in self.bindings.items():
            unknown = unknown_place(binding, {a.name: a for a in self.get(skill).args},
                                    locations)
            if unknown:
                raise CatalogError(f"skill {skill}: argument {unknown[0]!r} may name "
                                   f"{unknown[1]!r}, which the new location table does not "
                                   "hold")
        return replace(self, locations=dict(locations))

    def place_args(self, skill: str) -> tuple[str, ...]:
        """The arguments of `skill` its binding takes as places of the location table."""
        binding = self.bindings.get(skill)
        return binding.place_args if binding is not None and self.locations else ()

    @property
    def places(self) -> tuple[str, ...]:
        """The location table's names, where a bound skill takes a place (the prompt lists
        them); () otherwise."""
        if not self.locations or not any(b.place_args for b in self.bindings.values()):
            return ()
        return tuple(self.locations)

    def _places_for(self, arg: Argument, words: RequestWords | None) -> list[str]:
        """The places an argument may name: the table's, or with the request's words and a
        grounded argument, those the request mentions."""
        if words is None or arg.grounded is not True:
            return list(self.locations or ())
        return [p for p in self.locations or () if words.contains(p)]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.skills)

    def get(self, name: str) -> Skill | None:
        return next((s for s in self.skills if s.name == name), None)

    @property
    def has_grounded(self) -> bool:
        return any(s.grounded for s in self.skills)

    def signatures(self) -> list[str]:
        """Each skill's signature as the prompt shows it."""
        return [s.signature(self.enum_shown) for s in self.skills]

    def plan_schema(self, words: RequestWords | None = None) -> dict[str, Any] | None:
        """JSON-Schema of a whole plan: {"plan": [{"skill": NAME, "args": {...}}, ...]}.
        Given the request's words, grounded arguments admit only their runs, and a skill
        with one is left out when the request has no words (None: no plan is possible); an
        argument taken as a place admits the location table's names (`_places_for`), and a
        skill with no place to name is left out too."""
        unnameable = words is not None and words.pattern is None
        steps = []
        for s in self.skills:
            if unnameable and s.names_things:
                continue
            args, takes_place = s.args_schema(words), self.place_args(s.name)
            places = {a.name: self._places_for(a, words) for a in s.args
                      if a.name in takes_place}
            if not all(places.values()):     # a place to name, and none the request allows
                continue
            for name, names in places.items():
                args["properties"][name] = {"type": "string", "enum": names}
            steps.append({"type": "object",
                          "properties": {"skill": {"const": s.name}, "args": args},
                          "required": ["skill", "args"], "additionalProperties": False})
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
    unknown = sorted(set(entry) - set(SKILL_FIELDS))
    if unknown:
        raise CatalogError(f"{where} ({name}): unknown field(s) {unknown} (known: "
                           f"{', '.join(SKILL_FIELDS)})")
    args = entry.get("args") or {}
    if not isinstance(args, dict):
        raise CatalogError(f"{where} ({name}): 'args' must be a mapping")
    return Skill(name, str(entry.get("description", "")),
                 tuple(_argument(k, v, f"{where} ({name}) argument '{k}'")
                       for k, v in args.items()))


def _argument(name: Any, spec: Any, where: str) -> Argument:
    if not isinstance(name, str) or not name.strip():
        raise CatalogError(f"{where}: an argument's name must be a non-empty string, got "
                           f"{name!r} (YAML reads a bare on, off, yes or no as true/false: "
                           "quote it)")
    if isinstance(spec, str):
        spec = {"type": spec}
    if not isinstance(spec, dict) or spec.get("type") not in ARG_TYPES:
        raise CatalogError(f"{where}: 'type' must be one of {ARG_TYPES}")
    unknown = sorted(set(spec) - set(ARG_FIELDS))
    if unknown:
        raise CatalogError(f"{where}: unknown field(s) {unknown} (known: {', '.join(ARG_FIELDS)})")
    constraints = tuple((k, spec[k]) for k in CONSTRAINTS if k in spec)
    _check_constraints(spec["type"], dict(constraints), where)
    grounded = spec.get("grounded", False)
    if grounded not in GROUNDED or (grounded in (0, 1) and not isinstance(grounded, bool)):
        raise CatalogError(f"{where}: 'grounded' must be true, false, scene or quote, got "
                           f"{grounded!r}")
    if grounded and (spec["type"] != "string" or "enum" in spec):
        raise CatalogError(f"{where}: 'grounded' applies to string arguments without an "
                           "enum (a name or text taken from the request)")
    required = spec.get("required", "default" not in spec)
    if not isinstance(required, bool):
        raise CatalogError(f"{where}: 'required' must be true or false, got {required!r}")
    default = spec.get("default")
    if "default" in spec:
        if required:
            raise CatalogError(f"{where}: a required argument has no use for a 'default' "
                               "(leave 'required' out or set it to false)")
        _check_value(spec["type"], dict(constraints), default, f"{where}: default")
    return Argument(name, spec["type"], str(spec.get("description", "")), constraints,
                    grounded, required, default)


_PYTHON_TYPES = {"string": str, "number": (int, float), "integer": int, "boolean": bool}


def _of_type(kind: str, value: Any) -> bool:
    """Whether `value` is of the argument type `kind` (a bool is no number, nor is NaN or
    an infinity)."""
    if kind in ("number", "integer"):
        return isinstance(value, _PYTHON_TYPES[kind]) and finite_number(value)
    return isinstance(value, _PYTHON_TYPES[kind]) and (kind == "boolean"
                                                       or not isinstance(value, bool))


def _check_constraints(kind: str, c: dict[str, Any], where: str) -> None:
    """Constraints no value can meet are catalog errors (the plan grammar could not be
    compiled from them, and no plan could validate)."""
    if "enum" in c:
        enum = c["enum"]
        if not isinstance(enum, list) or not enum:
            raise CatalogError(f"{where}: 'enum' must be a non-empty list")
        bad = [v for v in enum if not _of_type(kind, v)]
        if bad:
            raise CatalogError(f"{where}: enum value {bad[0]!r} is not of type {kind}")
    for bound in ("minimum", "maximum"):
        if bound not in c:
            continue
        if kind not in ("number", "integer"):
            raise CatalogError(f"{where}: '{bound}' applies to number and integer arguments")
        if not finite_number(c[bound]):
            raise CatalogError(f"{where}: '{bound}' must be a number (finite), got "
                               f"{c[bound]!r}")
    if "minimum" in c and "maximum" in c and c["minimum"] > c["maximum"]:
        raise CatalogError(f"{where}: minimum {c['minimum']} is above maximum {c['maximum']}")


def _check_value(kind: str, c: dict[str, Any], value: Any, where: str) -> None:
    """A value (a default) of the argument's type, within its enum and range."""
    if not _of_type(kind, value):
        raise CatalogError(f"{where} {value!r} is not of type {kind}")
    if "enum" in c and value not in c["enum"]:
        raise CatalogError(f"{where} {value!r} is not one of the enum's values")
    if ("minimum" in c and value < c["minimum"]) or ("maximum" in c and value > c["maximum"]):
        raise CatalogError(f"{where} {value!r} is outside [{c.get('minimum', '-inf')}, "
                           f"{c.get('maximum', 'inf')}]")
