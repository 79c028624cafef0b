"""librdkafka messages as ``ConsumedRecord``s, on the read hot path.

The conversion is C (``xinfra._records.kafka_records``): per message, the
``Message`` accessors called through the C API and one record allocated and
filled, no bytecode; the application then reads the record's fields with one
specialised load each (member descriptors, ``xinfra.model.fast_fields``).
Counted with callgrind over the bench's read loop (tansu, 4 shards, 100-byte
records, the whole process with librdkafka's threads, instructions per
record): the bare accessor loop 12.0k; ours 16.0k with the previous C
``map``/``zip``/``tuple.__new__`` conversion and ``_tuplegetter`` fields,
12.1k with this.

Garbage collection.  A record whose items are all atomic (ints, str, bytes,
None, the empty tuple: a record without headers) is untracked when made, as
CPython untracks exact tuples, so records the application holds are never
rescanned by collections; see ``xinfra/_records.c`` for why that is safe.

Without the extension (a tree not built yet) the pure Python conversion
below runs: same records, same order, only slower.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import repeat
from operator import is_not, itemgetter
from typing import Any

from confluent_kafka import Message

from xinfra.model import ConsumedRecord

_kafka_records: Callable[..., tuple[list[Any], list[Message]]] | None
try:
    from xinfra._records import kafka_records as _kafka_records
except ImportError:  # a tree whose extension is not built yet: python_records
    _kafka_records = None

_error = Message.error
_headers = Message.headers
_partition = Message.partition
_offset = Message.offset
_timestamp = Message.timestamp
_key = Message.key
_value = Message.value
_timestamp_ms = itemgetter(1)
"""``Message.timestamp()`` is (type, milliseconds)."""


def to_records(
    messages: Sequence[Message],
    cls: type[tuple[Any, ...]] = ConsumedRecord,
    prefix: tuple[Any, ...] = (),
) -> tuple[list[Any], list[Message]]:
    """The records among ``messages``, in order, and the messages that carry an error.

    Each record is ``cls(*prefix, *consumed_record)`` (``ReaderOptions.record_type`` and
    ``record_prefix``): a ``ConsumedRecord`` unless the reader was asked otherwise.
    """
    if _kafka_records is not None:
        return _kafka_records(messages, cls, prefix)
    return python_records(messages, cls, prefix)


def python_records(
    messages: Sequence[Message], cls: type[tuple[Any, ...]], prefix: tuple[Any, ...]
) -> tuple[list[Any], list[Message]]:
    """``to_records`` without the extension: C ``map``s over plain chunks, else a loop."""
    if not any(map(_headers, messages)) and not any(
        map(is_not, map(_error, messages), repeat(None))
    ):
        rows = zip(
            *map(repeat, prefix),
            map(_partition, messages),
            map(_offset, messages),
            map(_timestamp_ms, map(_timestamp, messages)),
            map(_key, messages),
            map(_value, messages),
            repeat(()),
        )
        return list(map(tuple.__new__, repeat(cls), rows)), []
    return _one_by_one(messages, cls, prefix)


def _one_by_one(
    messages: Sequence[Message], cls: type[tuple[Any, ...]], prefix: tuple[Any, ...]
) -> tuple[list[Any], list[Message]]:
    """``to_records`` of a chunk with headers or errors: a loop over the messages."""
    new = tuple.__new__
    records: list[Any] = []
    append = records.append
    failed: list[Message] = []
    for message in messages:
        if message.error() is not None:
            failed.append(message)
            continue
        headers = message.headers()
        append(
            new(
                cls,
                (
                    *prefix,
                    message.partition(),
                    message.offset(),
                    message.timestamp()[1],
                    message.key(),
                    message.value(),
                    tuple(headers) if headers else (),
                ),
            )
        )
    return records, failed
