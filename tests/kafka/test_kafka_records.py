"""``to_records``: both of its paths (plain chunks in C, chunks with headers or errors one by one)
give the same records, in order, and hand back the messages carrying an error."""

from __future__ import annotations

from confluent_kafka import KafkaError, Message

from backends.kafka.records import to_records
from xinfra.model import ConsumedRecord

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
