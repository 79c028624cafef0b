"""Types of the C extension ``xinfra._records`` (see ``xinfra/_records.c`` for why it exists)."""

from collections.abc import Sequence
from typing import Any, TypeVar

_T = TypeVar("_T", bound=type[tuple[Any, ...]])

def fast_fields(cls: _T, /) -> _T:
    """A named tuple's fields as specialisable member descriptors; every instance must be whole."""

def kafka_records(
    messages: Sequence[Any], cls: type[tuple[Any, ...]], prefix: tuple[Any, ...], /
) -> tuple[list[Any], list[Any]]:
    """``cls(*prefix, partition, offset, timestamp_ms, key, value, headers)`` per clean message,
    and the messages carrying an error."""
