"""The on-disk frame of one entry, shared by the write-ahead log and the segment files.

A frame is a 32-byte header, the segment id (UTF-8) and the producer's batch
untouched::

    magic u32 | header_crc u32 | body_crc u32 | batch_len u32 |
    base_offset u64 | record_count u32 | segment_id_len u16 | reserved u16 |
    segment_id | batch

``header_crc`` (CRC32C) covers bytes 8..32 of the header and the segment id, so
a damaged length or offset is detected before it is trusted; ``body_crc``
covers the batch.  The WAL and the segment files hold byte-identical frames:
recovery re-applies a WAL frame to its segment file by copying it.

An all-zero header is what direct-I/O padding and a never-written block look
like; it is reported as ``ZERO`` so that recovery can tell the end of data
from corruption.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import crc32c

MAGIC = 0x4E474601  # "NGF" + format version 1
HEADER = struct.Struct("<IIIIQIHH")
HEADER_BYTES = HEADER.size  # 32
SEGMENT_ID_BYTES_MAX = 255
BATCH_BYTES_MAX = (1 << 31) - 1
_ZERO_HEADER = bytes(HEADER_BYTES)


class FrameStatus(enum.Enum):
    OK = "ok"
    END = "end"  # no byte left
    ZERO = "zero"  # an all-zero header: padding or an unwritten block
    TRUNCATED = "truncated"  # the frame runs past the end of the data
    BAD_HEADER = "bad_header"  # magic or header CRC mismatch: the length cannot be trusted
    BAD_BODY = "bad_body"  # header fine, batch CRC mismatch


@dataclass(frozen=True, slots=True)
class Frame:
    segment_id: str
    base_offset: int
    record_count: int
    batch: bytes
    frame_bytes: int  # header + segment id + batch
    body_crc: int

    @property
    def end_offset(self) -> int:
        return self.base_offset + self.record_count

    def body_ok(self) -> bool:
        return crc32c.crc32c(self.batch) == self.body_crc


@dataclass(frozen=True, slots=True)
class Decoded:
    status: FrameStatus
    frame: Frame | None  # set for OK, and for BAD_BODY (with the damaged batch)
    frame_bytes: int  # known for OK, BAD_BODY and TRUNCATED-after-a-good-header; else 0


def encode_frame(segment_id: str, base_offset: int, record_count: int, batch: bytes) -> bytes:
    """The frame for one entry; the caller has validated the arguments."""
    sid = segment_id.encode()
    assert 0 < len(sid) <= SEGMENT_ID_BYTES_MAX, segment_id
    assert 0 < record_count < 1 << 32 and 0 <= base_offset < 1 << 63
    assert len(batch) <= BATCH_BYTES_MAX
    body_crc = crc32c.crc32c(batch)
    rest = HEADER.pack(0, 0, body_crc, len(batch), base_offset, record_count, len(sid), 0)[8:]
    header_crc = crc32c.crc32c(sid, crc32c.crc32c(rest))
    return b"".join((struct.pack("<II", MAGIC, header_crc), rest, sid, batch))


def frame_bytes_of(segment_id: str, batch_bytes: int) -> int:
    return HEADER_BYTES + len(segment_id.encode()) + batch_bytes


def decode_frame(data: bytes | memoryview, position: int, *, verify_body: bool = True) -> Decoded:
    """Decode the frame at ``position`` of ``data``, checking both CRCs (the body's on request)."""
    remaining = len(data) - position
    if remaining <= 0:
        return Decoded(FrameStatus.END, None, 0)
    if remaining < HEADER_BYTES:
        zero = bytes(data[position:]) == bytes(remaining)
        return Decoded(FrameStatus.ZERO if zero else FrameStatus.TRUNCATED, None, 0)
    header = bytes(data[position : position + HEADER_BYTES])
    if header == _ZERO_HEADER:
        return Decoded(FrameStatus.ZERO, None, 0)
    magic, header_crc, body_crc, batch_len, base_offset, record_count, sid_len, _ = HEADER.unpack(
        header
    )
    if magic != MAGIC or sid_len == 0:
        return Decoded(FrameStatus.BAD_HEADER, None, 0)
    if remaining < HEADER_BYTES + sid_len:
        return Decoded(FrameStatus.TRUNCATED, None, 0)
    sid_end = position + HEADER_BYTES + sid_len
    sid = bytes(data[position + HEADER_BYTES : sid_end])
    if crc32c.crc32c(sid, crc32c.crc32c(header[8:])) != header_crc:
        return Decoded(FrameStatus.BAD_HEADER, None, 0)
    frame_bytes = HEADER_BYTES + sid_len + batch_len
    if remaining < frame_bytes:
        return Decoded(FrameStatus.TRUNCATED, None, frame_bytes)
    batch = bytes(data[sid_end : position + frame_bytes])
    frame = Frame(
        sid.decode(errors="replace"), base_offset, record_count, batch, frame_bytes, body_crc
    )
    if verify_body and not frame.body_ok():
        return Decoded(FrameStatus.BAD_BODY, frame, frame_bytes)
    return Decoded(FrameStatus.OK, frame, frame_bytes)
