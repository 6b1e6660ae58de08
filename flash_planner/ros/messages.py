"""Field dicts <-> rosidl messages of any type, as the bindings need them: a goal filled from
a step's fields (ints into float fields, nested dicts into nested messages) and a server's
feedback or result read back as JSON-ready fields. No rclpy; the messages are the generated
classes' instances."""

from __future__ import annotations

import array
from typing import Any

FLOATS = ("float", "double")


def to_message(msg: Any, fields: dict[str, Any], where: str = "goal") -> Any:
    """Set `fields` on `msg`; ValueError names the field that is missing or does not fit."""
    types = msg.get_fields_and_field_types()
    for name, value in fields.items():
        if name not in types:
            raise ValueError(f"{where}: {type(msg).__name__} has no field {name!r}")
        if isinstance(value, dict):
            to_message(getattr(msg, name), value, f"{where}.{name}")
            continue
        try:
            setattr(msg, name, _coerce(types[name], value))
        except (AssertionError, TypeError, ValueError) as exc:
            raise ValueError(f"{where}.{name} is {types[name]}; {value!r} does not fit it "
                             f"({exc or type(exc).__name__})") from None
    return msg


def _coerce(kind: str, value: Any) -> Any:
    """An integer where the field takes a float (JSON and YAML write 1 for 1.0)."""
    element = kind[len("sequence<"):-1] if kind.startswith("sequence<") else kind.split("[")[0]
    if element not in FLOATS:
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, (list, tuple)):
        return [float(v) if isinstance(v, int) and not isinstance(v, bool) else v
                for v in value]
    return value


def to_fields(msg: Any) -> dict[str, Any]:
    """Every field of `msg` as JSON-ready values (nested messages as dicts)."""
    return {name: _plain(getattr(msg, name)) for name in msg.get_fields_and_field_types()}


def _plain(value: Any) -> Any:
    if hasattr(value, "get_fields_and_field_types"):
        return to_fields(value)
    if isinstance(value, (bytes, bytearray)):
        return list(value)
    if isinstance(value, (list, tuple, array.array)) or hasattr(value, "tolist"):
        items = value.tolist() if hasattr(value, "tolist") else list(value)
        return [_plain(v) for v in items] if isinstance(items, list) else items
    return value
