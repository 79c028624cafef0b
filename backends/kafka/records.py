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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from confluent_kafka import Message

from xinfra._records import kafka_records
from xinfra.model import ConsumedRecord


def to_records(
    messages: Sequence[Message],
    cls: type[tuple[Any, ...]] = ConsumedRecord,
    prefix: tuple[Any, ...] = (),
) -> tuple[list[Any], list[Message]]:
    """The records among ``messages``, in order, and the messages that carry an error.

    Each record is ``cls(*prefix, *consumed_record)`` (``ReaderOptions.record_type`` and
    ``record_prefix``): a ``ConsumedRecord`` unless the reader was asked otherwise.
    """
    return kafka_records(messages, cls, prefix)
