"""A connection's ``FrameReader``: frames as the socket delivers them, bounded, errors in order."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from ng_harness import WAIT_S

from backends.northguard import protocol
from backends.northguard.frame_reader import FrameReader
from backends.northguard.protocol import MsgType
from backends.northguard.runtime import READER_LIMIT_BYTES, RealRuntime
from xinfra.errors import ProtocolError


@dataclass
class Peer:
    """Our end (``reader``, ``writer``: what ``Network.connect`` gave) and the server's."""

    reader: FrameReader
    writer: asyncio.StreamWriter
    server_end: asyncio.StreamWriter

    def send(self, data: bytes) -> None:
        self.server_end.write(data)


@pytest.fixture
async def peer() -> AsyncIterator[Peer]:
    """A plain TCP server whose writes reach a ``FrameReader`` opened by ``Network.connect``."""
    accepted: asyncio.Future[asyncio.StreamWriter] = asyncio.get_running_loop().create_future()

    async def accept(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.set_result(writer)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await RealRuntime().network.connect(
        "127.0.0.1", port, WAIT_S, protocol.FRAME_BYTES_MAX
    )
    connection = Peer(reader, writer, await asyncio.wait_for(accepted, WAIT_S))
    try:
        yield connection
    finally:
        writer.close()
        connection.server_end.close()
        server.close()


async def test_frames_arrive_whole_and_in_order(peer: Peer) -> None:
    reader, send = peer.reader, peer.send
    sent = [protocol.encode_append(1, seq, bytes([seq]) * (seq * 997)) for seq in range(200)]
    stream = b"".join(sent)
    for start in range(0, len(stream), 4099):  # cut anywhere, headers included
        send(stream[start : start + 4099])
    got: list[protocol.Frame] = []
    while len(got) < len(sent):
        got += await asyncio.wait_for(reader.frames(), WAIT_S)
    assert [protocol.decode_append(f.body)[1] for f in got] == list(range(200))
    assert [bytes(protocol.decode_append(f.body)[2]) for f in got] == [
        bytes([seq]) * (seq * 997) for seq in range(200)
    ]
    assert reader.received_any


async def test_reading_pauses_while_frames_wait_and_resumes_when_taken(peer: Peer) -> None:
    reader, send = peer.reader, peer.send
    frame = protocol.encode_append(1, 0, bytes(64 << 10))
    count = 4 * READER_LIMIT_BYTES // len(frame)  # twice what pauses the reading
    for _ in range(count):
        send(frame)
    transport = peer.writer.transport  # the one the reader reads from
    assert isinstance(transport, asyncio.ReadTransport)

    async def paused() -> None:
        while transport.is_reading():
            await asyncio.sleep(0.01)

    await asyncio.wait_for(paused(), WAIT_S)
    got = await reader.frames()
    assert transport.is_reading()
    while len(got) < count:
        got += await asyncio.wait_for(reader.frames(), WAIT_S)
    assert len(got) == count


async def test_a_malformed_frame_fails_the_reader_after_the_frames_taken_before_it(
    peer: Peer,
) -> None:
    reader, send = peer.reader, peer.send
    good = protocol.encode_json(MsgType.RESPONSE, 1, {"result": {}})
    send(good)
    assert [f.type for f in await asyncio.wait_for(reader.frames(), WAIT_S)] == [MsgType.RESPONSE]
    send(struct.pack("<IBB", 2, 99, MsgType.REQUEST) + good)
    with pytest.raises(ProtocolError, match="version 99"):
        await asyncio.wait_for(reader.frames(), WAIT_S)
    send(good)  # read by the transport, dropped: the connection's owner closes it
    with pytest.raises(ProtocolError):
        await asyncio.wait_for(reader.frames(), WAIT_S)


async def test_the_end_of_the_stream_is_no_frames(peer: Peer) -> None:
    reader, send = peer.reader, peer.send
    send(protocol.encode_json(MsgType.RESPONSE, 1, {"result": {}}))
    assert len(await asyncio.wait_for(reader.frames(), WAIT_S)) == 1
    peer.server_end.close()
    assert await asyncio.wait_for(reader.frames(), WAIT_S) == []


def test_a_control_frame_carries_its_json_object_exactly() -> None:
    """Control frames are encoded by orjson, with the standard library for what it refuses."""
    payload = {
        "op": "lead_segment",
        "range": {"start": "0", "end": str(1 << 64)},  # 2**64 travels as a string
        "offset": (1 << 64) - 1,
        "name": "tópico ☃",
        "replicas": ["1", "2"],
        "config": {},
        "ratio": 0.25,
        "sealed": None,
        "flag": True,
    }
    frame = protocol.encode_json(MsgType.REQUEST, 7, payload)
    assert protocol.decode_json(frame[protocol.PREFIX_BYTES :]) == (7, payload)
    too_wide = protocol.encode_json(MsgType.REQUEST, 8, {"n": 1 << 70})  # orjson refuses it
    assert too_wide.endswith(b'{"n":%d}' % (1 << 70))
    with pytest.raises(ProtocolError, match="not JSON"):
        protocol.decode_json(b"\x00\x00\x00\x00{nope")
