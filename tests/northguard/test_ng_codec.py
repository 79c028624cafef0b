"""The record batch codec and the frame decoder, including a fuzz of the decoder (>= 100k inputs)."""

from __future__ import annotations

import contextlib
import itertools
import os
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends.northguard import protocol
from backends.northguard.batch import (
    BATCH_MAGIC,
    HEADER_BYTES,
    check_batch,
    decode_batch,
    encode_batch,
)
from backends.northguard.protocol import FrameDecoder, MsgType
from xinfra.errors import (
    CorruptData,
    InvalidRequest,
    ProtocolError,
    UnsupportedVersion,
    XinfraError,
)
from xinfra.model import Record

optional_bytes = st.one_of(st.none(), st.binary(max_size=64))
records = st.builds(
    Record,
    value=optional_bytes,
    key=optional_bytes,
    headers=st.lists(st.tuples(st.text(max_size=8), st.binary(max_size=16)), max_size=3).map(tuple),
    timestamp_ms=st.one_of(st.none(), st.integers(0, 2**62)),
)


@given(st.lists(records, min_size=1, max_size=20))
def test_a_batch_decodes_to_what_was_encoded(batch_records: list[Record]) -> None:
    data = encode_batch(batch_records, now_ms=1234)
    count, min_ts, max_ts = check_batch(data)
    assert count == len(batch_records)
    decoded = decode_batch(data)
    stamps = [r.timestamp_ms if r.timestamp_ms is not None else 1234 for r in batch_records]
    assert decoded == [
        (ts, r.key, r.value, r.headers) for ts, r in zip(stamps, batch_records, strict=True)
    ]
    assert (min_ts, max_ts) == (min(stamps), max(stamps))
    assert decode_batch(data, skip=count - 1) == decoded[-1:]


def test_every_flipped_byte_of_a_batch_is_detected() -> None:
    data = encode_batch([Record(value=b"value", key=b"key", headers=(("h", b"v"),))], 1)
    for position in range(len(data)):
        damaged = bytearray(data)
        damaged[position] ^= 0x40
        with pytest.raises((CorruptData, InvalidRequest)):
            check_batch(bytes(damaged))


def test_short_and_empty_batches_are_refused() -> None:
    with pytest.raises(InvalidRequest):
        check_batch(bytes([BATCH_MAGIC]) + b"\x01" * (HEADER_BYTES - 2))
    with pytest.raises(InvalidRequest):
        encode_batch([], 0)


def test_frames_split_anywhere_reassemble() -> None:
    frames = [
        protocol.encode_append(1, 2, b"batch"),
        protocol.encode_json(MsgType.REQUEST, 3, {"op": "ping"}),
        protocol.encode_read(4, 5, 6),
    ]
    stream = b"".join(frames)
    for cut in range(len(stream) + 1):
        decoder = FrameDecoder()
        got = decoder.feed(stream[:cut]) + decoder.feed(stream[cut:])
        assert [f.type for f in got] == [MsgType.APPEND, MsgType.REQUEST, MsgType.READ]
        assert protocol.decode_append(got[0].body)[:2] == (1, 2)


@settings(max_examples=300, deadline=None)
@given(
    bodies=st.lists(st.binary(max_size=300), min_size=1, max_size=12),
    cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=8),
)
def test_frames_fed_in_any_pieces_decode_to_the_same_frames(
    bodies: list[bytes], cuts: list[int]
) -> None:
    """Every frame and body exactly once, in order, whatever the reads cut (a header, a body,
    several frames at once, nothing), and nothing left buffered at the end."""
    stream = b"".join(protocol.encode_append(i, i, body) for i, body in enumerate(bodies))
    points = sorted({min(cut, len(stream)) for cut in cuts} | {0, len(stream)})
    decoder = FrameDecoder()
    got: list[protocol.Frame] = []
    for start, end in itertools.pairwise(points):
        got += decoder.feed(stream[start:end])
    assert [protocol.decode_append(f.body)[:2] for f in got] == [(i, i) for i in range(len(bodies))]
    assert [bytes(protocol.decode_append(f.body)[2]) for f in got] == bodies
    assert all(type(f.body) is bytes for f in got)
    assert decoder.buffered_bytes == 0


def test_an_oversized_frame_is_refused_from_its_prefix_alone() -> None:
    decoder = FrameDecoder(frame_bytes_max=1000)
    prefix = struct.pack("<IBB", 1_000_000, protocol.PROTOCOL_VERSION, MsgType.APPEND)
    with pytest.raises(ProtocolError, match="exceeds"):
        decoder.feed(prefix)  # no body was sent or buffered


def test_a_wrong_version_is_refused() -> None:
    with pytest.raises(UnsupportedVersion):
        FrameDecoder().feed(struct.pack("<IBB", 2, 99, MsgType.REQUEST))


def test_ack_and_push_round_trip() -> None:
    ack = FrameDecoder().feed(protocol.encode_ack(9, 100, [5, 7, 11], 4096))[0]
    assert protocol.decode_acks(ack.body) == [(9, 100, (5, 7, 11), 4096)]
    push = FrameDecoder().feed(protocol.encode_push(3, [(0, b"ab"), (2, b"cde")]))[0]
    assert protocol.decode_push(push.body) == (3, [(0, b"ab"), (2, b"cde")])


def _decode_everything(data: bytes) -> None:
    """What a broker does with untrusted bytes: frames, then messages.  Only XinfraErrors may escape."""
    decoder = FrameDecoder(frame_bytes_max=1 << 16)
    try:
        for item in decoder.feed(data):
            message = protocol.decode_message(item)
            if item.type is MsgType.APPEND:
                assert isinstance(message, tuple)
                with contextlib.suppress(XinfraError):
                    check_batch(message[2])
    except XinfraError:
        pass


def _valid_prefix(kind: int) -> bytes:
    return struct.pack("<BB", protocol.PROTOCOL_VERSION, kind)


framed = st.builds(
    lambda kind, body, extra: struct.pack("<I", len(body) + 2 + extra) + _valid_prefix(kind) + body,
    st.sampled_from([int(t) for t in MsgType] + [0, 200]),
    st.binary(max_size=200),
    st.sampled_from([0, 0, 0, -1, 1, 5]),
)
FUZZ_EXAMPLES = int(os.environ.get("NG_CODEC_FUZZ_EXAMPLES", "5000"))
"""CI runs a bounded, derandomized (fixed-seed) sample; set NG_CODEC_FUZZ_EXAMPLES=50000 for a long run."""

fuzz_settings = settings(
    max_examples=FUZZ_EXAMPLES,
    derandomize=True,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    database=None,
)


@pytest.mark.slow
@fuzz_settings
@given(st.binary(max_size=300))
def test_fuzz_random_bytes_never_crash_the_decoder(data: bytes) -> None:
    _decode_everything(data)


@pytest.mark.slow
@fuzz_settings
@given(st.lists(framed, min_size=1, max_size=4).map(b"".join))
def test_fuzz_well_framed_garbage_never_crashes_the_decoder(data: bytes) -> None:
    _decode_everything(data)


def test_one_ack_frame_carries_many_streams_acks_in_order() -> None:
    entries = [protocol.ack_entry(1, 0, [0], 4096), protocol.ack_entry(7, 3, [10, 20], 8192)]
    ack = FrameDecoder().feed(protocol.encode_acks(entries))[0]
    assert ack.type is MsgType.ACK
    assert protocol.decode_acks(ack.body) == [(1, 0, (0,), 4096), (7, 3, (10, 20), 8192)]
    # One Ack alone is the single-stream frame of old, byte for byte.
    assert protocol.encode_acks(entries[:1]) == protocol.encode_ack(1, 0, [0], 4096)


@pytest.mark.parametrize("cut", [1, 8, 20, 28, 35])
def test_an_ack_frame_that_its_acks_do_not_fill_exactly_is_refused(cut: int) -> None:
    body = protocol.ack_entry(1, 0, [0], 4096) + protocol.ack_entry(2, 0, [5, 6], 4096)
    with pytest.raises(ProtocolError, match="Ack"):
        protocol.decode_acks(body[: len(body) - cut])
    with pytest.raises(ProtocolError, match="Ack"):
        protocol.decode_acks(b"")
