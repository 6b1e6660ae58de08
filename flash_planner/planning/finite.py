"""Finite numbers: the only numbers a request, a catalog, a plan or a goal may carry.

Python's json reads `NaN`, `Infinity` and `1e999` (as an infinity), none of which is JSON or
a value a robot can be sent. `loads` is json's reader less those; `finite_number` is the
test every other check applies to a number it was given as an object (a catalog's limits,
a plan's arguments, a filled goal, a request's deadline).
"""

from __future__ import annotations

import json
import math
from typing import Any


class NotFinite(ValueError):
    """JSON text holding NaN, an infinity or a number past a double's range."""


def finite_number(value: Any) -> bool:
    """A real number (a bool is none), finite, and one a float can hold."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:      # an int past float's range
        return False


def _no_constant(name: str):
    raise NotFinite(f"{name} is not a JSON number: numbers must be finite")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise NotFinite(f"{text} is past the range of a double: numbers must be finite")
    return value


# json's own reader, less the constants and overflowing numbers that are not finite
STRICT_JSON = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite_float)


def loads(text: str) -> Any:
    """JSON text as Python values; NotFinite for NaN, Infinity or a number past float's
    range, json.JSONDecodeError (a ValueError too) for text that is not JSON."""
    return STRICT_JSON.decode(text)
