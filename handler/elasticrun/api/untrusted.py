"""The one tolerant reader for fields of objects elasticrun does not own.

Leases, their annotations, and the status fields nodes write are written by
pods, and a pod can write anything the API server accepts: JSON nested deep
enough to exhaust Python's recursion, numbers too large for a float, times in
the year 9999 (which overflow the moment a duration is added), values of the
wrong type, 256 KiB strings.  Everything read from such a field goes through
this module: times are clamped to a window in which any arithmetic the
rendezvous does stays valid, and anything unreadable becomes ``None`` plus a
short problem description (for one Event), never an exception.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from collections.abc import Mapping
from typing import Any

#: Times outside this window are clamped to it.  Wide enough for any real
#: clock, narrow enough that adding a year of seconds never overflows.
EARLIEST = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)
LATEST = dt.datetime(2200, 1, 1, tzinfo=dt.UTC)
#: A join request is a handful of short fields; anything longer is not one.
MAX_JOIN_BYTES = 4096
#: Longest RFC 3339 string worth parsing (with nanoseconds and an offset).
MAX_TIME_CHARS = 40
#: Longest name (node, pod, holder) taken from an untrusted field.
MAX_NAME_CHARS = 253


class UnreadableError(ValueError):
    """A field of an object we do not own holds something we will not use."""


def clamp_time(value: dt.datetime) -> dt.datetime:
    """``value`` with a time zone (UTC when it has none), inside [EARLIEST, LATEST]."""
    if value.tzinfo is None:
        value = value.replace(tzinfo=dt.UTC)
    try:
        if value < EARLIEST:
            return EARLIEST
        if value > LATEST:
            return LATEST
    except OverflowError:  # an offset pushes it past year 1 or 9999 in UTC
        return LATEST if value.year > EARLIEST.year else EARLIEST
    return value


def read_time(value: Any) -> dt.datetime | None:
    """An RFC 3339 time, clamped; None when absent or unreadable."""
    if not isinstance(value, str) or len(value) > MAX_TIME_CHARS:
        return None
    try:
        parsed = dt.datetime.fromisoformat(value)
    except (ValueError, OverflowError):
        return None
    return clamp_time(parsed)


def mapping(value: Any) -> Mapping[str, Any]:
    """``value`` when it is an object, else an empty one."""
    return value if isinstance(value, Mapping) else {}


def text(value: Any, limit: int = MAX_NAME_CHARS) -> str | None:
    """A non-empty string of at most ``limit`` characters, else None."""
    if isinstance(value, str) and 0 < len(value) <= limit:
        return value
    return None


def counter(value: Any, minimum: int, maximum: int) -> int | None:
    """An integer (not a bool) with ``minimum <= value < maximum``, else None."""
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value < maximum:
        return None
    return value


def number(value: Any, default: float = 0.0) -> float:
    """A finite number (not a bool), else ``default``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return default
    try:
        result = float(value)
    except OverflowError:
        return default
    return result if math.isfinite(result) else default


def _depth(raw: str) -> int:
    """Deepest nesting of ``[`` / ``{`` outside strings, without recursion."""
    depth = deepest = 0
    in_string = escaped = False
    for char in raw:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def json_object(raw: Any, limit: int = MAX_JOIN_BYTES, max_depth: int = 4) -> dict[str, Any]:
    """A small, shallow JSON object; raises :class:`UnreadableError` saying why not."""
    if not isinstance(raw, str):
        raise UnreadableError(f"expected a JSON string, found {type(raw).__name__}")
    if len(raw) > limit:
        raise UnreadableError(f"{len(raw)} characters, more than the {limit} a request may have")
    if _depth(raw) > max_depth:
        raise UnreadableError(f"nested deeper than {max_depth} levels")
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise UnreadableError(f"not JSON ({str(exc)[:80]})") from None
    if not isinstance(value, dict):
        raise UnreadableError(f"expected a JSON object, found {type(value).__name__}")
    return value
