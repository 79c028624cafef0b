"""Types of the C extension ``xinfra._records`` (see ``xinfra/_records.c`` for why it exists)."""

from collections.abc import Callable, Sequence
from dataclasses import Field
from typing import Any, ClassVar, TypeVar

_T = TypeVar("_T", bound=type[tuple[Any, ...]])

def fast_fields(cls: _T, /) -> _T:
    """A named tuple's fields as specialisable member descriptors; every instance must be whole."""

def kafka_records(
    messages: Sequence[Any], cls: type[tuple[Any, ...]], prefix: tuple[Any, ...], /
) -> tuple[list[Any], list[Any]]:
    """``cls(*prefix, partition, offset, timestamp_ms, key, value, headers)`` per clean message,
    and the messages carrying an error."""

class Record:
    """What a producer writes: ``Record(value, key=None, headers=(), timestamp_ms=None)``."""

    __match_args__ = ("value", "key", "headers", "timestamp_ms")
    __dataclass_fields__: ClassVar[dict[str, Field[Any]]]
    value: bytes | None
    key: bytes | None
    headers: tuple[tuple[str, bytes], ...]
    timestamp_ms: int | None
    def __init__(
        self,
        value: bytes | None,
        key: bytes | None = None,
        headers: tuple[tuple[str, bytes], ...] = (),
        timestamp_ms: int | None = None,
    ) -> None: ...
    def size_bytes(self) -> int:
        """Payload size used for batching limits and RecordTooLarge checks."""
    def __hash__(self) -> int: ...
    def __eq__(self, other: object) -> bool: ...

def record_fields(fields: dict[str, Any], /) -> None:
    """Record's ``__dataclass_fields__``: the ``dataclasses`` functions take a Record."""

def record_sizes(records: Sequence[Record], /) -> tuple[int, int, bool]:
    """``(total, largest, plain)``: what ``send`` checks before anything is queued.

    A record's size is ``size_bytes()`` if it has headers or a timestamp, else
    ``len(value) + len(key)`` (``None`` counts 0); ``plain``: no record has
    headers or a timestamp.  Any object with the four fields is taken (the C
    ``Record`` is read directly); a missing field raises ``AttributeError``.
    """

def produce_records(
    produce: Callable[..., object],
    topic: str,
    partition: int,
    on_delivery: Callable[..., object],
    records: Sequence[Record],
    plain: bool,
    /,
) -> int:
    """``produce(topic, value, key, partition, on_delivery)`` per record, in order, positionally.

    Not ``plain``: ``produce(topic, value, key, partition, on_delivery, None,
    timestamp_ms or 0, list(headers) or None)``.  Returns the count queued.  If
    a call (or reading a record) raises, the exception propagates with
    ``records_queued`` set on it: how many records were queued before it.
    """
