"""What a client connection hands its transport: bounded writes, every frame once and in order.

A producer whose windows open in one turn queues tens of MB of frames on one
connection.  Handed to the transport at once they became one joined copy, the
transport's buffer a second and, under TLS, the SSL buffer and what is read
out of it two more: allocations of 30-60 MB each, mapped, faulted in and
unmapped every turn (``WRITE_BYTES_MAX`` in ``client.connection`` says what
that cost).  Here a peer that does not read yet gets 40 MiB in one turn: no
single write may exceed ``WRITE_BYTES_MAX`` and the transport may not hold
more than about two of them, while every byte still arrives, once, in order,
when the peer reads; a turn of small frames is still one write.  Plain and TLS.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from backends.northguard import tls
from backends.northguard.client.connection import WRITE_BYTES_MAX, ClientConnection
from backends.northguard.runtime import RealRuntime

FRAME_BYTES = 1 << 20  # as large as a producer's batch
FRAMES = 40


class Peer:
    """A server that reads nothing until ``release``, then counts and hashes what it got."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.received = 0
        self.digest = hashlib.sha256()
        self.got = asyncio.Condition()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self.release.wait()
        while data := await reader.read(1 << 20):
            self.digest.update(data)
            async with self.got:
                self.received += len(data)
                self.got.notify_all()
        writer.close()

    async def wait_for(self, total: int) -> None:
        async with self.got:
            await asyncio.wait_for(self.got.wait_for(lambda: self.received >= total), 30)


@pytest.fixture(params=["plain", "tls"])
async def peer_connection(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[tuple[Peer, ClientConnection]]:
    peer = Peer()
    server_tls = client_tls = None
    if request.param == "tls":
        files = tls.make_test_certificates(tmp_path / "tls")
        server_tls = tls.server_context(files.cert, files.key)
        client_tls = tls.client_context(
            {tls.TLS_ATTRIBUTE: "true", tls.CA_ATTRIBUTE: str(files.ca)}
        )
    server = await asyncio.start_server(peer.handle, "127.0.0.1", 0, ssl=server_tls)
    port = server.sockets[0].getsockname()[1]
    connection = await ClientConnection.open(
        RealRuntime(seed=1), f"127.0.0.1:{port}", 10.0, tls_context=client_tls
    )
    try:
        yield peer, connection
    finally:
        peer.release.set()
        await connection.close()
        server.close()
        await server.wait_closed()


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of every write a client connection hands its stream writer."""
    sizes: list[int] = []
    write = asyncio.StreamWriter.write

    def recording(self: asyncio.StreamWriter, data: Any) -> None:
        sizes.append(len(data))
        write(self, data)

    monkeypatch.setattr(asyncio.StreamWriter, "write", recording)
    return sizes


async def test_a_burst_is_written_in_bounded_pieces_in_order(
    peer_connection: tuple[Peer, ClientConnection], writes: list[int]
) -> None:
    peer, connection = peer_connection
    frames = [bytes([n]) * FRAME_BYTES for n in range(FRAMES)]
    expected = hashlib.sha256(b"".join(frames)).hexdigest()
    del writes[:]  # the handshake's and the open's
    for frame in frames:  # one turn, as a producer whose windows all opened
        connection.send(frame)
    held = []
    for _ in range(20):  # the peer reads nothing yet: what does the transport hold?
        await asyncio.sleep(0.01)
        held.append(connection._writer.transport.get_write_buffer_size())
    assert max(writes) <= WRITE_BYTES_MAX, f"one write of {max(writes)} bytes"
    assert max(held) <= 2 * WRITE_BYTES_MAX + FRAME_BYTES, f"transport held {max(held)} bytes"
    assert connection.write_buffer_full  # what waits is still counted as buffered
    peer.release.set()
    await connection.drain()
    await peer.wait_for(FRAMES * FRAME_BYTES)
    assert peer.received == FRAMES * FRAME_BYTES
    assert peer.digest.hexdigest() == expected
    assert not connection._outbox


async def test_small_frames_of_one_turn_are_one_write(
    peer_connection: tuple[Peer, ClientConnection], writes: list[int]
) -> None:
    peer, connection = peer_connection
    peer.release.set()
    del writes[:]
    for n in range(5):
        connection.send(bytes([n]) * 100)
    await connection.drain()
    assert writes == [500]
    await peer.wait_for(500)
