"""The record batch: encoded once by the producer, stored and served as the same bytes.

Layout (little endian)::

    magic u8 | crc32c u32 | count u32 | min_timestamp_ms i64 | max_timestamp_ms i64 |
    producer_id i64 | producer_epoch i16 | sequence i32 | records

The CRC32C covers every byte after the CRC field, the producer fields
included: a damaged producer id or sequence is a CRC failure, never a wrong
duplicate decision.  ``producer_id`` -1 marks a batch with no producer
identity (never deduplicated); otherwise ``sequence`` numbers the producer's
batches to one range consecutively from 0 and ``producer_epoch`` fences
older incarnations of the same id.  Because the identity travels in the
stored bytes, a broker rebuilds its duplicate table from the log after a
restart (``broker/range_log``).  Magic 1 (the format before the producer
fields) is still checked and read, as a batch with no identity, so data
directories written before the change stay readable.  Each record is::

    timestamp_ms i64 | key_len i32 | value_len i32 | header_count u16 | key | value |
    header_count x (name_len u16 | value_len u32 | name | value)

with a length of -1 meaning ``None``.  The broker calls only ``check_batch``
(CRC, count, timestamps: header work and one CRC pass at GB/s); it never walks
the records.  Producers call ``encode_batch``; consumers ``decode_batch``.
The min/max timestamps let a broker find the first batch at or after a
timestamp without decoding any batch but the one that holds it.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeAlias

import crc32c

from xinfra.errors import CorruptData, InvalidRequest

if TYPE_CHECKING:  # not at run time: the broker imports this module, and the model is pydantic's
    from xinfra.model import Header, Record

BATCH_MAGIC = 2
HEADER = struct.Struct("<BIIqqqhi")
HEADER_BYTES = HEADER.size
_HEADER_V1 = struct.Struct("<BIIqq")
_PRODUCER = struct.Struct("<qhi")
_PRODUCER_AT = _HEADER_V1.size
NO_PRODUCER = -1
"""``producer_id`` of a batch that carries no producer identity."""
_CRC_FROM = 5  # bytes after magic and CRC
_RECORD = struct.Struct("<qiiH")
_HEADER = struct.Struct("<HI")
BATCH_RECORDS_MAX = 1_000_000
"""A batch holds at most this many records (producers cut batches far earlier)."""


def encode_batch(
    records: Sequence[Record],
    now_ms: int,
    *,
    producer_id: int = NO_PRODUCER,
    producer_epoch: int = 0,
    sequence: int = -1,
) -> bytes:
    """Encode records (at least one) as one batch; ``now_ms`` stamps records without a timestamp.

    ``producer_id``/``producer_epoch``/``sequence`` make the batch idempotent (see the module
    docstring); the defaults leave it without an identity."""
    count = len(records)
    if not 0 < count <= BATCH_RECORDS_MAX:
        raise InvalidRequest(f"a batch holds 1..{BATCH_RECORDS_MAX} records, not {count}")
    pack = _RECORD.pack
    parts: list[bytes] = [b""]
    append = parts.append
    min_ts = max_ts = None
    for record in records:
        ts = record.timestamp_ms
        if ts is None:
            ts = now_ms
        if min_ts is None:
            min_ts = max_ts = ts
        elif ts < min_ts:
            min_ts = ts
        elif ts > max_ts:  # type: ignore[operator]
            max_ts = ts
        key = record.key
        value = record.value
        headers = record.headers
        append(
            pack(
                ts,
                -1 if key is None else len(key),
                -1 if value is None else len(value),
                len(headers),
            )
        )
        if key:
            append(key)
        if value:
            append(value)
        if headers:
            for name, header_value in headers:
                encoded = name.encode()
                append(_HEADER.pack(len(encoded), len(header_value)))
                append(encoded)
                append(header_value)
    assert min_ts is not None and max_ts is not None
    parts[0] = HEADER.pack(
        BATCH_MAGIC, 0, count, min_ts, max_ts, producer_id, producer_epoch, sequence
    )
    data = bytearray(b"".join(parts))
    struct.pack_into("<I", data, 1, crc32c.crc32c(memoryview(data)[_CRC_FROM:]))
    return bytes(data)


def restamp_batch(data: bytes, producer_id: int, producer_epoch: int, sequence: int) -> bytes:
    """The same batch under another producer identity (a producer that took a fresh id after a
    failure renumbers what it had queued); the CRC is recomputed, the records untouched."""
    assert data[0] == BATCH_MAGIC, "only a current batch is restamped"
    out = bytearray(data)
    _PRODUCER.pack_into(out, _PRODUCER_AT, producer_id, producer_epoch, sequence)
    struct.pack_into("<I", out, 1, crc32c.crc32c(memoryview(out)[_CRC_FROM:]))
    return bytes(out)


def batch_producer(data: bytes | memoryview) -> tuple[int, int, int]:
    """``(producer_id, producer_epoch, sequence)`` from a batch header (no CRC check: for bytes
    already checked); ``(NO_PRODUCER, 0, -1)`` for a batch of the format without them."""
    if data[0] != BATCH_MAGIC:
        return NO_PRODUCER, 0, -1
    producer_id, epoch, sequence = _PRODUCER.unpack_from(data, _PRODUCER_AT)
    return producer_id, epoch, sequence


def _header_bytes(data: bytes | memoryview) -> int:
    return HEADER_BYTES if data[0] == BATCH_MAGIC else _HEADER_V1.size


def check_batch(data: bytes | memoryview) -> tuple[int, int, int]:
    """``(count, min_timestamp_ms, max_timestamp_ms)`` of a batch whose header and CRC are good.

    Raises ``CorruptData`` on a CRC mismatch and ``InvalidRequest`` on a bad
    header.  Never decodes the records: this is the broker's hot path.
    """
    header = HEADER if len(data) and data[0] == BATCH_MAGIC else _HEADER_V1
    if len(data) < header.size:
        raise InvalidRequest(f"a batch has at least {header.size} bytes, not {len(data)}")
    producer_id, epoch, sequence = NO_PRODUCER, 0, -1
    if header is HEADER:
        magic, crc, count, min_ts, max_ts, producer_id, epoch, sequence = HEADER.unpack_from(data)
    else:
        magic, crc, count, min_ts, max_ts = _HEADER_V1.unpack_from(data)
    if magic not in (1, BATCH_MAGIC):
        raise InvalidRequest(f"batch magic {magic} is not {BATCH_MAGIC}")
    if crc32c.crc32c(memoryview(data)[_CRC_FROM:]) != crc:
        raise CorruptData("record batch CRC32C mismatch: the batch was damaged; it is not stored")
    if not 0 < count <= BATCH_RECORDS_MAX:
        raise InvalidRequest(f"a batch holds 1..{BATCH_RECORDS_MAX} records, not {count}")
    if count * _RECORD.size > len(data) - header.size or min_ts > max_ts:
        raise InvalidRequest("batch header does not match its size or timestamps")
    if producer_id != NO_PRODUCER and (producer_id < 0 or epoch < 0 or sequence < 0):
        raise InvalidRequest(
            f"batch producer id {producer_id}, epoch {epoch}, sequence {sequence}: "
            "an idempotent batch has all three non-negative"
        )
    return count, min_ts, max_ts


def batch_count(data: bytes | memoryview) -> int:
    """The record count from a batch header (no CRC check: for bytes already checked)."""
    count: int = _HEADER_V1.unpack_from(data)[2]
    return count


DecodedRecord: TypeAlias = "tuple[int, bytes | None, bytes | None, tuple[Header, ...]]"
"""(timestamp_ms, key, value, headers) of one record."""


def decode_batch(data: bytes, skip: int = 0) -> list[DecodedRecord]:
    """Every record of a checked batch from index ``skip`` on; ``CorruptData`` if it does not parse."""
    count: int = _HEADER_V1.unpack_from(data)[2]
    unpack = _RECORD.unpack_from
    size = _RECORD.size
    position = _header_bytes(data)
    out: list[DecodedRecord] = []
    append = out.append
    try:
        for index in range(count):
            ts, key_len, value_len, header_count = unpack(data, position)
            position += size
            if key_len >= 0:
                key: bytes | None = data[position : position + key_len]
                position += key_len
            else:
                key = None
            if value_len >= 0:
                value: bytes | None = data[position : position + value_len]
                position += value_len
            else:
                value = None
            headers: tuple[Header, ...] = ()
            if header_count:
                items: list[Header] = []
                for _ in range(header_count):
                    name_len, header_len = _HEADER.unpack_from(data, position)
                    position += _HEADER.size
                    name = data[position : position + name_len].decode()
                    position += name_len
                    items.append((name, data[position : position + header_len]))
                    position += header_len
                headers = tuple(items)
            if index >= skip:
                append((ts, key, value, headers))
    except (struct.error, UnicodeDecodeError) as error:
        raise CorruptData(f"record batch does not parse: {error}") from error
    if position != len(data):
        raise CorruptData(f"record batch has {len(data) - position} bytes past its last record")
    return out


def record_timestamps(data: bytes) -> list[int]:
    """Timestamps of every record of a checked batch (the timestamp lookup; a cold path)."""
    return [ts for ts, _, _, _ in decode_batch(data)]
