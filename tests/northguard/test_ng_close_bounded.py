"""Closing a connection whose peer reads nothing ends within a bound, and its socket with it.

An asyncio transport closed while it still holds bytes the socket did not take
keeps the socket open, stops reading it, and waits for the peer to read them
before it reports itself closed; a peer that stopped reading (a stopped or
stuck broker, a client that went away without closing) never does.  So
``StreamWriter.wait_closed`` after ``close`` may never return, and a
connection that only calls ``close`` keeps its socket (and the peer's view of
an open connection) forever.  A broker's ``stop`` awaits every client
connection's close before it stops its coordinator: one such peer held it (and
the test tearing it down) until pytest-timeout.  Both ends must flush for a
bounded time, then abort the transport.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

from ng_harness import backend_for, in_process_broker, wait_for

from backends.northguard import protocol
from backends.northguard.client.connection import ClientConnection
from backends.northguard.protocol import MsgType
from backends.northguard.runtime import CLOSE_FLUSH_S, RealRuntime
from xinfra.backend import ProducerOptions
from xinfra.keyspace import shard_ranges
from xinfra.model import Record

RECORD_BYTES = 64 << 10
SENDS = 32  # of 8 records: 16 MiB, far more than the sockets between the two ends can hold
CLOSE_S = CLOSE_FLUSH_S + 5.0
"""What a close may take here: its flush bound, and a generous margin for a shared machine."""


async def test_a_broker_stops_while_a_client_has_stopped_reading(tmp_path: Path) -> None:
    broker = await in_process_broker(tmp_path / "broker", store="memory")
    stopped = False
    writer: asyncio.StreamWriter | None = None
    try:
        backend = backend_for(f"127.0.0.1:{broker.port}")
        try:
            await backend.create_topic("t", shard_ranges(1))
            producer = backend.producer("t", ProducerOptions(linger_ms=0))
            await asyncio.gather(
                *(producer.send(0, [Record(value=bytes(RECORD_BYTES))] * 8) for _ in range(SENDS))
            )
        finally:
            await backend.close()
        # A consumer that opens a stream with a large window, then never reads: a small receive
        # buffer, so the kernel's autotuning cannot swallow what the broker pushes.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", broker.port))
        _, writer = await asyncio.open_connection(sock=sock)
        window = protocol.CONSUME_WINDOW_BYTES_MAX
        writer.write(
            protocol.encode_json(
                MsgType.CONSUME_OPEN,
                1,
                {"topic": "t", "range_id": 1, "offset": 0, "window_bytes": window},
            )
        )

        async def broker_holds_unsent_bytes() -> bool:
            held = [c._writer.transport.get_write_buffer_size() for c in broker._connections]
            return any(size >= 1 << 20 for size in held)

        await wait_for(broker_holds_unsent_bytes, "the broker's pushes to back up")
        try:
            await asyncio.wait_for(broker.stop(), CLOSE_S)
        except TimeoutError:
            raise AssertionError(
                f"Broker.stop did not return in {CLOSE_S:g} s: it waits for a client that "
                "reads nothing to take the bytes its connection still holds"
            ) from None
        stopped = True
    finally:
        if writer is not None:
            writer.transport.abort()
        if not stopped:  # the client is gone now: the stop that was cut short runs again
            broker._stopped.clear()
            await broker.stop()


async def test_a_client_connection_closes_its_socket_though_the_peer_reads_nothing() -> None:
    release = asyncio.Event()
    outcome: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def peer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await release.wait()
        try:
            while await reader.read(1 << 20):
                pass
            outcome.set_result("end of stream")
        except ConnectionError as error:
            outcome.set_result(type(error).__name__)
        writer.close()

    server = await asyncio.start_server(peer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    connection = await ClientConnection.open(RealRuntime(seed=1), f"127.0.0.1:{port}", 10.0)
    try:
        for _ in range(40):  # frames a stream's close still hands over: more than a socket holds
            connection.send(bytes(1 << 20))
        try:
            await asyncio.wait_for(connection.close(), CLOSE_S)
        except TimeoutError:
            raise AssertionError(f"ClientConnection.close took over {CLOSE_S:g} s") from None
        sock = connection._writer.transport.get_extra_info("socket")
        assert sock.fileno() == -1, "close returned with the socket still open (not reading)"
        release.set()  # the peer now sees the connection end, not tens of MB still coming
        assert await asyncio.wait_for(outcome, CLOSE_S) in ("end of stream", "ConnectionResetError")
    finally:
        release.set()
        connection._writer.transport.abort()
        server.close()
        await server.wait_closed()
