"""The Northguard wire protocol: length-prefixed frames, unary requests and sessionized streams.

Frame::

    length u32 (bytes after this field) | version u8 | type u8 | body

``FrameDecoder`` is sans-IO: it is fed whatever the socket gave and returns
whole frames.  It rejects a frame whose announced length exceeds the limit
*before* buffering its body, and a wrong version as soon as the version byte
arrives; both raise ``ProtocolError`` (the connection is then closed).

Control messages (requests, responses, stream opens, errors) carry a small
JSON object: they are rare, and JSON keeps them readable and extensible.
Data messages (Append, Ack, Push, Read) are fixed binary headers followed by
record batches as opaque bytes, so the hot path is one ``struct`` call per
frame.

Streams (ids chosen by the client, unique per connection):

* Produce: ``PRODUCE_OPEN`` -> ``PRODUCE_OPENED`` {window_bytes}; then
  ``APPEND`` (stream, seq, batch) while unacknowledged bytes stay under the
  window; the broker answers with Acks (stream, first_seq, base offsets
  of consecutive appends, window) only for committed appends: M Acks for N
  Appends.  One ``ACK`` frame carries the Acks of every stream of the
  connection that the same turn of the broker completed, back to back (with
  hundreds of ranges written at once, one group commit completes hundreds of
  streams, and a frame each was a header, a decode and a dispatch each, on
  both sides); a frame with one Ack is the format of old.
* Consume: ``CONSUME_OPEN`` {offset, window_bytes} -> ``CONSUME_OPENED``;
  the broker ``PUSH``es entries (base offset + batch) while pushed minus
  consumed bytes stay under the window; the client sends ``READ`` (stream,
  consumed bytes so far, window) to move it.
* Replication (broker to broker): the segment leader sends ``REPLICA_OPEN``
  {segment_id, start_offset} -> ``REPLICA_OPENED`` {end_offset}; then
  ``REPLICA_APPEND`` (stream, base offset, record count, committed offset,
  batch: the producer's bytes as stored) in offset order, pipelined; the
  follower answers ``REPLICA_ACK`` (stream, durable end) once its store has
  fsynced them (its group commit), M Acks for N ReplicaAppends.  A
  ReplicaAppend of zero records carries only the committed offset.
* Either side ends a stream with ``STREAM_CLOSE``; the broker reports a
  stream's failure with ``STREAM_ERROR`` {code, message}, which also ends it.
"""

from __future__ import annotations

import enum
import json
import struct
from typing import Any, NamedTuple

import orjson

from xinfra.errors import ProtocolError, UnsupportedVersion, XinfraError

PROTOCOL_VERSION = 1
FRAME_BYTES_MAX = 16 << 20
"""Default largest frame body; a larger announced length closes the connection."""
_PREFIX = struct.Struct("<IBB")
PREFIX_BYTES = _PREFIX.size
_U32 = struct.Struct("<I")
_APPEND = struct.Struct("<IQ")
_APPEND_FRAME = struct.Struct("<IBBIQ")  # the prefix and the Append's header, packed at once
_ACK = struct.Struct("<IQII")
_OFFSET = struct.Struct("<Q")
_PUSH = struct.Struct("<IH")
_ENTRY = struct.Struct("<QI")
_READ = struct.Struct("<IQI")
_REPLICA_APPEND = struct.Struct("<IQIQ")
_REPLICA_ACK = struct.Struct("<IQ")
PUSH_ENTRIES_MAX = 65535
JSON_BYTES_MAX = 1 << 20
CONSUME_WINDOW_BYTES_MAX = 64 << 20
"""The largest consume window a broker accepts (client-owned, in bytes)."""


class MsgType(enum.IntEnum):
    REQUEST = 1
    RESPONSE = 2
    PRODUCE_OPEN = 3
    PRODUCE_OPENED = 4
    APPEND = 5
    ACK = 6
    CONSUME_OPEN = 7
    CONSUME_OPENED = 8
    PUSH = 9
    READ = 10
    STREAM_CLOSE = 11
    STREAM_ERROR = 12
    ERROR = 13
    REPLICA_OPEN = 14
    REPLICA_OPENED = 15
    REPLICA_APPEND = 16
    REPLICA_ACK = 17


_TYPE_OF = {int(t): t for t in MsgType}
"""A frame's type byte to its ``MsgType``: a dict lookup, where the enum's call cost more than
the rest of decoding an Append."""


class Frame(NamedTuple):
    """A tuple, made once per frame received: a frozen dataclass's ``__init__`` cost a
    microsecond per frame."""

    type: MsgType
    body: bytes


class FrameDecoder:
    """Incremental frame parser with a hard bound on buffered bytes (one frame plus one read).

    Each frame's body is copied once, out of the bytes it arrived in: what a
    read completes is parsed where it lies, and only a frame cut by the end
    of a read waits in the buffer for the rest (a bytearray slice and its
    ``bytes`` were two copies of every byte, joining the buffer a third).
    """

    def __init__(self, frame_bytes_max: int = FRAME_BYTES_MAX) -> None:
        self.frame_bytes_max = frame_bytes_max
        self._buffer = bytearray()  # the start of a frame cut by the end of a read

    def feed(self, data: bytes) -> list[Frame]:
        """Frames completed by ``data``; raises ``ProtocolError`` on the first bad frame."""
        buffer = self._buffer
        frames: list[Frame] = []
        if buffer:
            # Complete the cut frame first (its header may itself be cut), then go on in ``data``.
            taken = self._complete(buffer, data, frames)
            if buffer:
                return frames  # ``data`` was all taken and the frame is still not whole
            view = memoryview(data)[taken:]
        else:
            view = memoryview(data)
        with view:
            start = self._parse(view, frames)
            if start < len(view):
                buffer += view[start:]
        return frames

    def _complete(self, buffer: bytearray, data: bytes, frames: list[Frame]) -> int:
        """Move bytes of ``data`` into ``buffer`` until its frame is whole (then parse it and
        empty the buffer) or ``data`` ends; return how many bytes of ``data`` were taken."""
        taken = 0
        if len(buffer) < PREFIX_BYTES:
            taken = min(PREFIX_BYTES - len(buffer), len(data))
            buffer += data[:taken]
            if len(buffer) < PREFIX_BYTES:
                return taken
        length = self._check(buffer, 0)
        more = min(4 + length - len(buffer), len(data) - taken)
        buffer += data[taken : taken + more]
        taken += more
        if len(buffer) == 4 + length:
            self._parse(buffer, frames)
            buffer.clear()
        return taken

    def _parse(self, view: memoryview | bytearray, frames: list[Frame]) -> int:
        """Append the whole frames at the start of ``view``; return where the first cut one starts."""
        start = 0
        end = len(view)
        while end - start >= PREFIX_BYTES:
            length = self._check(view, start)
            if end - start < 4 + length:
                break
            frames.append(
                Frame(
                    _TYPE_OF[view[start + 5]],
                    bytes(view[start + PREFIX_BYTES : start + 4 + length]),
                )
            )
            start += 4 + length
        return start

    def _check(self, data: memoryview | bytearray, start: int) -> int:
        """The length of the frame whose header starts at ``start``; raises on a bad header."""
        length, version, kind = _PREFIX.unpack_from(data, start)
        if length > self.frame_bytes_max + 2:
            raise ProtocolError(
                f"frame of {length} bytes exceeds the limit of {self.frame_bytes_max}"
            )
        if length < 2:
            raise ProtocolError(f"frame length {length} is shorter than its header")
        if version != PROTOCOL_VERSION:
            raise UnsupportedVersion(
                f"protocol version {version} is not supported; this peer speaks {PROTOCOL_VERSION}"
            )
        if kind not in _TYPE_OF:
            raise ProtocolError(f"unknown message type {kind}")
        return int(length)

    @property
    def buffered_bytes(self) -> int:
        return len(self._buffer)


def frame(kind: MsgType, *parts: bytes) -> bytes:
    """One encoded frame of ``kind`` whose body is the concatenation of ``parts``."""
    length = 2 + sum(len(part) for part in parts)
    return b"".join((_PREFIX.pack(length, PROTOCOL_VERSION, kind), *parts))


# -- control messages (JSON) ------------------------------------------------------------------


def encode_json(kind: MsgType, ident: int, payload: dict[str, Any]) -> bytes:
    """A control frame: ``ident`` (correlation or stream id) then a JSON object.

    orjson: a stream's open and its answer cost 8 and 5 us in ``json`` here against 0.4 each,
    and a first write to 4,096 new ranges makes 4,096 of each.  What orjson refuses goes
    through ``json``; integers past 64 bits never should (``decode_json`` would read them as
    floats): send them as strings, as ``KeyRange.to_json`` does."""
    try:
        text = orjson.dumps(payload, option=orjson.OPT_NON_STR_KEYS)
    except orjson.JSONEncodeError:
        text = json.dumps(payload, separators=(",", ":")).encode()
    return frame(kind, _U32.pack(ident), text)


def decode_json(body: bytes) -> tuple[int, dict[str, Any]]:
    if len(body) < 4:
        raise ProtocolError("control message shorter than its id")
    if len(body) - 4 > JSON_BYTES_MAX:
        raise ProtocolError(f"control message exceeds {JSON_BYTES_MAX} bytes")
    (ident,) = _U32.unpack_from(body)
    try:
        payload = orjson.loads(body[4:])
    except orjson.JSONDecodeError:
        try:  # what orjson refuses and ``json`` reads (and writes): NaN, Infinity
            payload = json.loads(body[4:])
        except (ValueError, RecursionError) as error:
            raise ProtocolError(f"control message is not JSON: {error}") from error
    if not isinstance(payload, dict):
        raise ProtocolError("control message is not a JSON object")
    return ident, payload


def error_payload(error: XinfraError) -> dict[str, Any]:
    return {"error": {"code": error.code, "message": error.message}}


def encode_error(error: XinfraError) -> bytes:
    """A connection-level error, sent just before the broker closes the connection."""
    return encode_json(MsgType.ERROR, 0, error_payload(error))


# -- data messages (binary) -------------------------------------------------------------------


def encode_append(stream_id: int, seq: int, batch: bytes) -> bytes:
    # One pack and one concatenation: the producer's per-batch path (``frame`` is general).
    return (
        _APPEND_FRAME.pack(
            2 + _APPEND.size + len(batch), PROTOCOL_VERSION, MsgType.APPEND, stream_id, seq
        )
        + batch
    )


def decode_append(body: bytes) -> tuple[int, int, memoryview]:
    if len(body) < _APPEND.size:
        raise ProtocolError("Append shorter than its header")
    stream_id, seq = _APPEND.unpack_from(body)
    return stream_id, seq, memoryview(body)[_APPEND.size :]


def encode_ack(stream_id: int, first_seq: int, base_offsets: list[int], window_bytes: int) -> bytes:
    """An ACK frame holding one stream's Ack."""
    return encode_acks([ack_entry(stream_id, first_seq, base_offsets, window_bytes)])


def ack_entry(stream_id: int, first_seq: int, base_offsets: list[int], window_bytes: int) -> bytes:
    """One stream's Ack, for an ACK frame (``encode_acks``)."""
    count = len(base_offsets)
    header = _ACK.pack(stream_id, first_seq, count, window_bytes)
    if count == 1:  # with many ranges written at once, nearly every Ack
        return header + _OFFSET.pack(base_offsets[0])
    return header + struct.pack(f"<{count}Q", *base_offsets)


def encode_acks(entries: list[bytes]) -> bytes:
    """One ACK frame of the Acks ``ack_entry`` made (at least one)."""
    length = 2 + sum(len(entry) for entry in entries)
    return b"".join((_PREFIX.pack(length, PROTOCOL_VERSION, MsgType.ACK), *entries))


Ack = tuple[int, int, tuple[int, ...], int]
"""(stream id, first sequence number, base offsets, window bytes) of one stream's Ack."""


def decode_acks(body: bytes) -> list[Ack]:
    """The Acks of an ACK frame, in order; ``ProtocolError`` unless they fill it exactly."""
    acks: list[Ack] = []
    position, end = 0, len(body)
    header = _ACK.size
    while position < end or not acks:
        if end - position < header:
            raise ProtocolError("Ack shorter than its header")
        stream_id, first_seq, count, window_bytes = _ACK.unpack_from(body, position)
        position += header
        if end - position < 8 * count:
            raise ProtocolError(f"Ack announces {count} offsets but carries {end - position} bytes")
        if count == 1:
            offsets: tuple[int, ...] = _OFFSET.unpack_from(body, position)
        else:
            offsets = struct.unpack_from(f"<{count}Q", body, position)
        position += 8 * count
        acks.append((stream_id, first_seq, offsets, window_bytes))
    return acks


def encode_push(stream_id: int, entries: list[tuple[int, bytes]]) -> bytes:
    """A Push of whole stored entries: (base offset, batch bytes) each, in offset order."""
    assert 0 < len(entries) <= PUSH_ENTRIES_MAX
    parts: list[bytes] = [_PUSH.pack(stream_id, len(entries))]
    for base_offset, batch in entries:
        parts.append(_ENTRY.pack(base_offset, len(batch)))
        parts.append(batch)
    return frame(MsgType.PUSH, *parts)


def decode_push(body: bytes) -> tuple[int, list[tuple[int, bytes]]]:
    if len(body) < _PUSH.size:
        raise ProtocolError("Push shorter than its header")
    stream_id, count = _PUSH.unpack_from(body)
    entries: list[tuple[int, bytes]] = []
    position = _PUSH.size
    for _ in range(count):
        if len(body) - position < _ENTRY.size:
            raise ProtocolError("Push entry header truncated")
        base_offset, length = _ENTRY.unpack_from(body, position)
        position += _ENTRY.size
        if len(body) - position < length:
            raise ProtocolError("Push entry truncated")
        entries.append((base_offset, body[position : position + length]))
        position += length
    if position != len(body):
        raise ProtocolError("Push has bytes past its last entry")
    return stream_id, entries


def encode_read(stream_id: int, consumed_bytes: int, window_bytes: int) -> bytes:
    return frame(MsgType.READ, _READ.pack(stream_id, consumed_bytes, window_bytes))


def decode_read(body: bytes) -> tuple[int, int, int]:
    if len(body) != _READ.size:
        raise ProtocolError(f"Read has {len(body)} bytes, not {_READ.size}")
    stream_id, consumed, window = _READ.unpack_from(body)
    return stream_id, consumed, window


def encode_stream_close(stream_id: int) -> bytes:
    return frame(MsgType.STREAM_CLOSE, _U32.pack(stream_id))


def decode_stream_close(body: bytes) -> int:
    if len(body) != 4:
        raise ProtocolError("StreamClose is not 4 bytes")
    (stream_id,) = _U32.unpack_from(body)
    return int(stream_id)


def encode_replica_append(
    stream_id: int, base_offset: int, count: int, committed: int, batch: bytes
) -> bytes:
    return frame(
        MsgType.REPLICA_APPEND,
        _REPLICA_APPEND.pack(stream_id, base_offset, count, committed),
        batch,
    )


def decode_replica_append(body: bytes) -> tuple[int, int, int, int, bytes]:
    """(stream id, base offset, record count, committed offset, batch bytes)."""
    if len(body) < _REPLICA_APPEND.size:
        raise ProtocolError("ReplicaAppend shorter than its header")
    stream_id, base_offset, count, committed = _REPLICA_APPEND.unpack_from(body)
    batch = body[_REPLICA_APPEND.size :]
    if (count == 0) != (not batch):
        raise ProtocolError("a ReplicaAppend carries records exactly when it carries a batch")
    return stream_id, base_offset, count, committed, batch


def encode_replica_ack(stream_id: int, durable_end: int) -> bytes:
    return frame(MsgType.REPLICA_ACK, _REPLICA_ACK.pack(stream_id, durable_end))


def decode_replica_ack(body: bytes) -> tuple[int, int]:
    if len(body) != _REPLICA_ACK.size:
        raise ProtocolError(f"ReplicaAck has {len(body)} bytes, not {_REPLICA_ACK.size}")
    stream_id, durable_end = _REPLICA_ACK.unpack_from(body)
    return stream_id, durable_end


def decode_message(item: Frame) -> object:
    """Decode any frame's body by its type (what the fuzz test drives); ``ProtocolError`` if bad."""
    kind = item.type
    if kind is MsgType.APPEND:
        return decode_append(item.body)
    if kind is MsgType.ACK:
        return decode_acks(item.body)
    if kind is MsgType.PUSH:
        return decode_push(item.body)
    if kind is MsgType.READ:
        return decode_read(item.body)
    if kind is MsgType.STREAM_CLOSE:
        return decode_stream_close(item.body)
    if kind is MsgType.REPLICA_APPEND:
        return decode_replica_append(item.body)
    if kind is MsgType.REPLICA_ACK:
        return decode_replica_ack(item.body)
    return decode_json(item.body)
