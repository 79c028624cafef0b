"""The record batch: encoded once by the producer, stored and served as the same bytes.

Layout (little endian)::

    magic u8 | crc32c u32 | count u32 | min_timestamp_ms i64 | max_timestamp_ms i64 | records

The CRC32C covers every byte after the CRC field.  Each record is::

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

import crc32c

from xinfra.errors import CorruptData, InvalidRequest
from xinfra.model import Header, Record

BATCH_MAGIC = 1
HEADER = struct.Struct("<BIIqq")
HEADER_BYTES = HEADER.size
_CRC_FROM = 5  # bytes after magic and CRC
_RECORD = struct.Struct("<qiiH")
_HEADER = struct.Struct("<HI")
BATCH_RECORDS_MAX = 1_000_000
"""A batch holds at most this many records (producers cut batches far earlier)."""


def encode_batch(records: Sequence[Record], now_ms: int) -> bytes:
    """Encode records (at least one) as one batch; ``now_ms`` stamps records without a timestamp."""
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
    parts[0] = HEADER.pack(BATCH_MAGIC, 0, count, min_ts, max_ts)
    data = bytearray(b"".join(parts))
    struct.pack_into("<I", data, 1, crc32c.crc32c(memoryview(data)[_CRC_FROM:]))
    return bytes(data)


def check_batch(data: bytes | memoryview) -> tuple[int, int, int]:
    """``(count, min_timestamp_ms, max_timestamp_ms)`` of a batch whose header and CRC are good.

    Raises ``CorruptData`` on a CRC mismatch and ``InvalidRequest`` on a bad
    header.  Never decodes the records: this is the broker's hot path.
    """
    if len(data) < HEADER_BYTES:
        raise InvalidRequest(f"a batch has at least {HEADER_BYTES} bytes, not {len(data)}")
    magic, crc, count, min_ts, max_ts = HEADER.unpack_from(data)
    if magic != BATCH_MAGIC:
        raise InvalidRequest(f"batch magic {magic} is not {BATCH_MAGIC}")
    if crc32c.crc32c(memoryview(data)[_CRC_FROM:]) != crc:
        raise CorruptData("record batch CRC32C mismatch: the batch was damaged; it is not stored")
    if not 0 < count <= BATCH_RECORDS_MAX:
        raise InvalidRequest(f"a batch holds 1..{BATCH_RECORDS_MAX} records, not {count}")
    if count * _RECORD.size > len(data) - HEADER_BYTES or min_ts > max_ts:
        raise InvalidRequest("batch header does not match its size or timestamps")
    return count, min_ts, max_ts


def batch_count(data: bytes | memoryview) -> int:
    """The record count from a batch header (no CRC check: for bytes already checked)."""
    count: int = HEADER.unpack_from(data)[2]
    return count


DecodedRecord = tuple[int, bytes | None, bytes | None, tuple[Header, ...]]
"""(timestamp_ms, key, value, headers) of one record."""


def decode_batch(data: bytes, skip: int = 0) -> list[DecodedRecord]:
    """Every record of a checked batch from index ``skip`` on; ``CorruptData`` if it does not parse."""
    count: int = HEADER.unpack_from(data)[2]
    unpack = _RECORD.unpack_from
    size = _RECORD.size
    position = HEADER_BYTES
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
