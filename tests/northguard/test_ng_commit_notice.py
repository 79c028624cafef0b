"""The leader tells followers the commit point on the appends it replicates; a frame of its own
only when no append carried it within ``COMMITTED_NOTICE_S``.  Real sockets: the frames a
follower would read are decoded from what reached a listening socket."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from backends.northguard import protocol
from backends.northguard.broker.replication import ReplicaStream, Replicator
from backends.northguard.client.connection import ClientConnection
from backends.northguard.protocol import MsgType
from backends.northguard.runtime import RealRuntime


class HeldTimers(RealRuntime):
    """The real runtime whose timers fire only when the test says so."""

    def __init__(self) -> None:
        super().__init__(seed=1)
        self.held: list[Callable[[], None]] = []

    def call_later(self, seconds: float, callback: Callable[[], None]) -> asyncio.TimerHandle:
        self.held.append(callback)
        handle = asyncio.get_running_loop().call_later(3600.0, callback)
        handle.cancel()
        return handle


async def test_appends_carry_the_commit_point_and_a_notice_goes_only_when_none_did() -> None:
    received: asyncio.Queue[tuple[int, int, int]] = asyncio.Queue()

    async def follower(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        decoder = protocol.FrameDecoder(protocol.FRAME_BYTES_MAX)
        while data := await reader.read(1 << 16):
            for frame in decoder.feed(data):
                if frame.type is MsgType.REPLICA_APPEND:
                    _, base, count, committed, _ = protocol.decode_replica_append(frame.body)
                    received.put_nowait((base, count, committed))
        writer.close()

    server = await asyncio.start_server(follower, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    runtime = HeldTimers()
    connection = await ClientConnection.open(runtime, f"127.0.0.1:{port}", 10.0)
    replicator = Replicator(runtime, "s1", 0, 60.0, lambda: None, lambda *_: None)
    replicator.add(ReplicaStream(connection, "2", "s1", 0, lambda: None, lambda *_: None))
    timers = runtime.held
    try:
        replicator.send(0, 1, b"a", 0)
        assert await asyncio.wait_for(received.get(), 10) == (0, 1, 0)
        del timers[:]  # the replica timeout's
        replicator.send_committed(1)
        replicator.send(1, 1, b"b", 1)  # carries it
        assert await asyncio.wait_for(received.get(), 10) == (1, 1, 1)
        assert len(timers) == 1
        timers.pop()()  # the notice is due: an append carried it, nothing to send
        replicator.send_committed(2)  # no append follows
        replicator.send_committed(2)  # one notice, however many commits before it is due
        assert len(timers) == 1
        timers.pop()()
        assert await asyncio.wait_for(received.get(), 10) == (2, 0, 2)
        assert received.empty()
    finally:
        replicator.close_streams()
        await connection.close()
        server.close()
        await server.wait_closed()
