"""Fields of a control message (a unary request or a stream open), checked before they are used.

JSON gives a handler whatever the peer wrote: a float where an integer
belongs, ``Infinity`` or ``NaN`` (Python's ``json`` accepts them), a number
with a thousand digits, a list of a million items.  Every number a handler
acts on goes through ``int_field`` first (type, then range), so bad input is
answered with ``InvalidRequest`` before any work proportional to it, and never
surfaces as an ``OverflowError`` that would be reported as ``internal``.
"""

from __future__ import annotations

from typing import Any

from xinfra.errors import InvalidRequest

U64_MAX = (1 << 64) - 1


def int_field(
    payload: dict[str, Any],
    key: str,
    *,
    low: int = 0,
    high: int = U64_MAX,
    default: int | None = None,
) -> int:
    """The integer at ``key`` within ``[low, high]``; ``default`` when absent (if one is given)."""
    value = payload.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequest(f"field {key!r} must be an integer, not {_shown(value)}")
    if not low <= value <= high:
        raise InvalidRequest(f"field {key!r} must be in [{low}, {high}], not {_shown(value)}")
    return value


def str_field(payload: dict[str, Any], key: str) -> str:
    value = payload.get(key)
    if not isinstance(value, str):
        raise InvalidRequest(f"field {key!r} must be a string, not {_shown(value)}")
    return value


def list_field(payload: dict[str, Any], key: str, *, length_max: int) -> list[Any]:
    """The list at ``key``, refused before it is read when longer than ``length_max``."""
    value = payload.get(key)
    if not isinstance(value, list):
        raise InvalidRequest(f"field {key!r} must be a list, not {_shown(value)}")
    if not 1 <= len(value) <= length_max:
        raise InvalidRequest(f"field {key!r} holds 1..{length_max} items, not {len(value)}")
    return value


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
