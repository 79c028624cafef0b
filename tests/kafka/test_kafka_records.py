"""``to_records`` (the C conversion, ``xinfra._records.kafka_records``): the records a plain
reading of each message gives, in order, the messages carrying an error handed back; its
error paths and references."""

from __future__ import annotations

import contextlib
import gc
import sys
from typing import Any, NamedTuple

import pytest
from confluent_kafka import KafkaError, Message
from hypothesis import given, settings
from hypothesis import strategies as st
from leaks import LEAK_BYTES_MAX, bytes_kept

from backends.kafka.records import to_records
from clients.consumer import XinfraRecord
from xinfra.model import ConsumedRecord, fast_fields


class _Prefixed(NamedTuple):
    """A record type with a prefix field of any type."""

    extra: Any
    shard: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...]


fast_fields(_Prefixed)

DEFAULT = b""
"""``value`` left out: ``b"v<offset>"``."""


def message(
    offset: int,
    key: bytes | None = None,
    value: bytes | None = DEFAULT,
    headers: list[tuple[str, str | bytes | None]] | None = None,
    error: KafkaError | None = None,
) -> Message:
    """A message as librdkafka's consume hands it out (partition 2, stamped at 1000 + offset)."""
    return Message(
        topic="t",
        partition=2,
        offset=offset,
        key=key,
        value=b"v%d" % offset if value is DEFAULT else value,
        headers=headers,
        timestamp=(1, 1000 + offset),
        error=error,
    )


def test_a_plain_chunk_keeps_every_field_in_order() -> None:
    messages = [message(0), message(1, key=b"k"), message(2, value=None)]
    records, failed = to_records(messages)
    assert failed == []
    assert records == [
        ConsumedRecord(2, 0, 1000, None, b"v0", ()),
        ConsumedRecord(2, 1, 1001, b"k", b"v1", ()),
        ConsumedRecord(2, 2, 1002, None, None, ()),
    ]
    assert all(type(record) is ConsumedRecord for record in records)


def test_a_chunk_with_headers_keeps_them_and_the_plain_records_around_them() -> None:
    messages = [message(0), message(1, headers=[("h", b"1"), ("h", b"2")]), message(2)]
    records, failed = to_records(messages)
    assert failed == []
    assert records == [
        ConsumedRecord(2, 0, 1000, None, b"v0", ()),
        ConsumedRecord(2, 1, 1001, None, b"v1", (("h", b"1"), ("h", b"2"))),
        ConsumedRecord(2, 2, 1002, None, b"v2", ()),
    ]


def test_a_message_carrying_an_error_is_handed_back_not_made_a_record() -> None:
    broken = message(1, value=None, error=KafkaError(KafkaError._PARTITION_EOF))
    records, failed = to_records([message(0), broken, message(2)])
    assert [record.offset for record in records] == [0, 2]
    assert failed == [broken]


def test_an_empty_chunk_is_no_records() -> None:
    assert to_records([]) == ([], [])


# -- against a plain reading of each message -------------------------------------------------


def read_plainly(
    messages: list[Message], cls: type[tuple[Any, ...]], prefix: tuple[Any, ...]
) -> tuple[list[Any], list[Message]]:
    """What the conversion must give, written the obvious way."""
    records = [
        cls(
            *prefix,
            m.partition(),
            m.offset(),
            m.timestamp()[1],
            m.key(),
            m.value(),
            tuple(m.headers() or ()),
        )
        for m in messages
        if m.error() is None
    ]
    return records, [m for m in messages if m.error() is not None]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.none() | st.binary(max_size=8),
            st.none() | st.binary(max_size=8),
            st.none() | st.lists(st.tuples(st.text(max_size=4), st.binary(max_size=4)), max_size=3),
            st.booleans(),
        ),
        max_size=20,
    )
)
def test_the_conversion_reads_each_message_as_a_plain_loop_would(
    rows: list[tuple[bytes | None, bytes | None, list[tuple[str, bytes]] | None, bool]],
) -> None:
    messages = [
        message(
            offset,
            key=key,
            value=value,
            headers=headers,  # type: ignore[arg-type]
            error=KafkaError(KafkaError._PARTITION_EOF) if failing else None,
        )
        for offset, (key, value, headers, failing) in enumerate(rows)
    ]
    for cls, prefix in ((ConsumedRecord, ()), (XinfraRecord, ("topic", 7))):
        made, failed = to_records(messages, cls, prefix)
        assert (made, failed) == read_plainly(messages, cls, prefix)
        assert all(type(record) is cls for record in made)
        assert all(type(record.headers) is tuple for record in made)


def test_records_without_headers_are_untracked_by_the_collector() -> None:
    """All their items are atomic: they cannot be in a cycle, collections need not scan them."""
    made, _ = to_records([message(0), message(1, headers=[("h", b"1")]), message(2, key=b"k")])
    assert [gc.is_tracked(record) for record in made] == [False, True, False]
    not_atomic = [1]
    made, _ = to_records([message(0)], _Prefixed, (not_atomic,))
    assert gc.is_tracked(made[0])  # a list in the prefix: it could be in a cycle
    assert made[0].extra is not_atomic


def test_a_record_type_of_another_width_is_refused() -> None:
    with pytest.raises(ValueError, match="fields"):
        to_records([message(0)], XinfraRecord, ())
    with pytest.raises(ValueError, match="fields"):
        to_records([message(0)], ConsumedRecord, ("extra",))


def test_wrong_arguments_raise_type_errors() -> None:
    with pytest.raises(TypeError):
        to_records([message(0)], dict, ())  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        to_records([message(0)], ConsumedRecord, ["not", "a tuple"])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        to_records(42, ConsumedRecord, ())  # type: ignore[arg-type]
    with pytest.raises(AttributeError):
        to_records([object()], ConsumedRecord, ())  # type: ignore[list-item]
    # A Message again after another type: the accessors are looked up anew.
    assert to_records([message(3)])[0][0].offset == 3


class _Raising:
    """Message-like, with an accessor that fails after some have run: nothing may leak."""

    def __init__(self, failing: str) -> None:
        self.failing = failing

    def _answer(self, name: str, answer: object) -> object:
        if name == self.failing:
            raise RuntimeError(name)
        return answer

    def error(self) -> object:
        return self._answer("error", None)

    def partition(self) -> object:
        return self._answer("partition", 1)

    def offset(self) -> object:
        return self._answer("offset", 2)

    def timestamp(self) -> object:
        return self._answer("timestamp", (1, 3) if self.failing != "shape" else 3)

    def key(self) -> object:
        return self._answer("key", b"k")

    def value(self) -> object:
        return self._answer("value", b"v")

    def headers(self) -> object:
        return self._answer("headers", [("h", b"1")])


@pytest.mark.parametrize(
    "failing", ["error", "partition", "offset", "timestamp", "key", "value", "headers"]
)
def test_an_accessor_raising_is_raised_and_leaks_nothing(failing: str) -> None:
    chunk: list[Any] = [_Raising("none"), _Raising(failing)]
    with pytest.raises(RuntimeError, match=failing):
        to_records(chunk)
    assert to_records([_Raising("none")])[0] == [  # type: ignore[list-item]
        ConsumedRecord(1, 2, 3, b"k", b"v", (("h", b"1"),))
    ]
    with pytest.raises(TypeError, match="timestamp"):
        to_records([_Raising("shape")])  # type: ignore[list-item]
    kept = bytes_kept(lambda: _raise_many(chunk))
    assert kept < LEAK_BYTES_MAX, kept


def _raise_many(chunk: list[Any]) -> None:
    for _ in range(2000):
        with contextlib.suppress(RuntimeError):
            to_records(chunk)


def test_converting_many_chunks_leaks_nothing() -> None:
    """Records, headers, failed messages: every reference the C makes is released."""
    chunk = [
        message(0),
        message(1, key=b"k", headers=[("h", b"1")]),
        message(2, error=KafkaError(KafkaError._PARTITION_EOF)),
        message(3, value=None),
    ]

    def convert_and_drop() -> None:
        for _ in range(5000):
            to_records(chunk, XinfraRecord, ("topic", 1))

    assert bytes_kept(convert_and_drop) < LEAK_BYTES_MAX
    kept, _ = to_records(chunk)
    # The list, the loop's name and getrefcount's argument: none left over from the C.
    assert [sys.getrefcount(record) for record in kept] == [3, 3, 3]
