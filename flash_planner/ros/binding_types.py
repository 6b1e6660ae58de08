"""A catalog's skill bindings against the real ROS 2 message types (rosidl's generated
Python classes), at configure: every bound type imports, every goal (or request) field the
template names is a field of that message, and each constant and argument fits its field's
type. What planning/bindings.py checks without ROS is not repeated here.

Each failure is one line naming the skill, the field and what was wrong. Where a type's
package is not installed on this machine, that is the error (a robot binds the servers it
runs, so their interfaces are installed where the node runs).
"""

from __future__ import annotations

import importlib
import re
from dataclasses import replace
from typing import Any

from ..planning.bindings import PLACEHOLDER, Binding, BindingError
from ..planning.skills import SkillCatalog

NUMBERS = {"float", "double", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64",
           "uint64", "byte", "octet"}
INTEGERS = NUMBERS - {"float", "double"}
POSE_STAMPED = "geometry_msgs/PoseStamped"


def interface_class(binding: Binding) -> Any:
    """The action or service class of the binding's type (what a client is made of)."""
    package, kind, name = binding.type.split("/")
    try:
        module = importlib.import_module(f"{package}.{kind}")
        return getattr(module, name)
    except (ImportError, AttributeError) as exc:
        raise BindingError(f"skill {binding.skill}: {binding.kind} type {binding.type} is not "
                           f"installed here ({type(exc).__name__}: {exc})") from None


def message_class(binding: Binding) -> Any:
    """The goal (action) or request (service) class of the binding's type."""
    interface = interface_class(binding)
    return interface.Goal if binding.kind == "action" else interface.Request


def _nested_class(type_name: str) -> Any | None:
    """The class of a nested message type 'pkg/Name' (None for a primitive or sequence)."""
    if "/" not in type_name or type_name.startswith("sequence<"):
        return None
    package, name = type_name.split("/", 1)
    return getattr(importlib.import_module(f"{package}.msg"), name)


def typed(catalog: SkillCatalog, classes: dict[str, Any]) -> SkillCatalog:
    """The catalog with each binding's `field_types` read off its message class (`classes`:
    what `check_types` returns), so that the safety gate finds poses by their types
    (planning/gate.py)."""
    bindings = {skill: replace(b, field_types=field_types(classes[skill]))
                for skill, b in catalog.bindings.items()}
    return replace(catalog, bindings=bindings)


def field_types(cls: Any, prefix: str = "", depth: int = 8) -> tuple[tuple[str, str], ...]:
    """(dotted field, ROS type) of every field of a message class, nested messages and the
    element messages of arrays included (their fields keyed without an index)."""
    out = []
    for name, kind in cls.get_fields_and_field_types().items():
        out.append((prefix + name, kind))
        element = re.sub(r"^sequence<([^,>]+).*>$|\[\d*\]$", r"\1", kind) or kind
        nested = _nested_class(element) if depth > 0 else None
        if nested is not None:
            out.extend(field_types(nested, f"{prefix}{name}.", depth - 1))
    return tuple(out)


def check_types(catalog: SkillCatalog) -> dict[str, Any]:
    """skill -> its goal or request class, every binding checked (BindingError otherwise)."""
    classes = {}
    for skill, binding in catalog.bindings.items():
        cls = message_class(binding)
        args = {a.name: a for s in catalog.skills if s.name == skill for a in s.args}
        _check_fields(binding, cls, binding.template, "", args)
        classes[skill] = cls
    return classes


def _check_fields(binding: Binding, cls: Any, template: dict[str, Any], prefix: str,
                  args: dict[str, Any]) -> None:
    fields = cls.get_fields_and_field_types()
    for name, value in template.items():
        path = f"{prefix}{name}"
        where = f"skill {binding.skill}: {binding.type} field {path}"
        if name not in fields:
            raise BindingError(f"skill {binding.skill}: {binding.type} has no field {path} "
                               f"(its fields: {', '.join(fields) or 'none'})")
        kind = fields[name]
        m = PLACEHOLDER.match(value) if isinstance(value, str) else None
        if m is not None:
            if m.group(1) == "location":
                if kind != POSE_STAMPED:
                    raise BindingError(f"{where} is {kind}; a location fills a {POSE_STAMPED}")
                continue
            _check_value(where, kind, args[m.group(2)].type, argument=m.group(2))
        elif isinstance(value, dict):
            nested = _nested_class(kind)
            if nested is None:
                raise BindingError(f"{where} is {kind}, not a message: it takes a value, "
                                   "not fields")
            _check_fields(binding, nested, value, f"{path}.", args)
        else:
            _check_value(where, kind, _json_type(value))


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return type(value).__name__


def _check_value(where: str, field_type: str, value_type: str, argument: str = "") -> None:
    article = "an" if value_type[0] in "aeiou" else "a"
    what = (f"argument {argument!r} ({value_type})" if argument
            else f"{article} {value_type} constant")
    fits = {"string": field_type in ("string", "wstring") or field_type.startswith("string<"),
            "boolean": field_type == "boolean",
            "integer": field_type in NUMBERS,
            "number": field_type in NUMBERS - INTEGERS}.get(value_type, False)
    if not fits:
        raise BindingError(f"{where} is {field_type}; {what} does not fit it")
