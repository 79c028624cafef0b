"""Frames leave a connection together: a broker's Acks of one group commit in one socket write
and one frame, and a client's frames at least ``WRITE_GAP_S`` after its last write, or during a
long turn.

A producer writing many ranges gets one Ack per range per group commit; a
write each was a system call on the broker and a wake-up of the client per
Ack.  The broker counts its writes (``northguard_writes``) beside its Acks.
A client sending once per turn wrote once per turn; it now waits for the gap
after a recent write, but never adds it to a frame sent after a pause.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from pathlib import Path

import pytest
import uvloop
from ng_harness import WAIT_S, backend_for, in_process_broker, wait_for

from backends.northguard import protocol
from backends.northguard.broker.server import Broker
from backends.northguard.client import connection as client_connection
from backends.northguard.client.connection import (
    LONG_TURN_BYTES,
    LONG_TURN_S,
    WRITE_BYTES_MAX,
    ClientConnection,
)
from backends.northguard.protocol import MsgType
from backends.northguard.runtime import RealRuntime
from xinfra.backend import ProducerOptions
from xinfra.keyspace import shard_ranges
from xinfra.model import Record

RANGES = 64


def counter(broker: Broker, name: str) -> float:
    value = broker.metrics.registry.get_sample_value(f"{name}_total")
    assert value is not None, name
    return value


async def test_the_acks_of_one_group_commit_leave_in_one_write_and_one_frame(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One ACK frame carries the Acks of every stream that a turn of the broker completed (a
    frame each was a header, a decode and a dispatch each on both sides), in one write."""
    frames: list[int] = []  # per ACK frame the client decodes, its Acks

    def counted(body: bytes) -> list[protocol.Ack]:
        acks = decode_acks(body)
        frames.append(len(acks))
        return acks

    decode_acks = protocol.decode_acks
    monkeypatch.setattr(protocol, "decode_acks", counted)
    broker = await in_process_broker(tmp_path / "broker")
    try:
        backend = backend_for(f"127.0.0.1:{broker.port}")
        try:
            await backend.create_topic("t", shard_ranges(RANGES))
            producer = backend.producer("t", ProducerOptions(linger_ms=0))
            # Every range's stream opened (its answers are writes too), then one send to each,
            # all in one turn: one group commit, one Ack per range.
            await asyncio.gather(*(producer.send(s, [Record(b"open")]) for s in range(RANGES)))
            acks, writes = counter(broker, "northguard_acks"), counter(broker, "northguard_writes")
            frames.clear()
            offsets = await asyncio.gather(
                *(producer.send(s, [Record(b"%d" % s)]) for s in range(RANGES))
            )
            assert offsets == [[1]] * RANGES
            acks = counter(broker, "northguard_acks") - acks
            writes = counter(broker, "northguard_writes") - writes
            await producer.close()
        finally:
            await backend.close()
    finally:
        await broker.stop()
    assert acks >= RANGES and sum(frames) == RANGES
    assert writes * 8 <= acks, f"{writes:.0f} writes for {acks:.0f} Acks"
    assert len(frames) * 8 <= RANGES, f"{len(frames)} ACK frames for {RANGES} Acks: {frames}"


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_client_frame_waits_only_behind_a_recent_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, loop: str
) -> None:
    """On both event loops (the broker's peers run under uvloop, whose timers are its own)."""
    monkeypatch.setattr(client_connection, "WRITE_GAP_S", 3600.0)  # the gap, made unmissable
    run = uvloop.run if loop == "uvloop" else asyncio.run
    run(_a_frame_waits_only_behind_a_recent_write(tmp_path))


async def _a_frame_waits_only_behind_a_recent_write(tmp_path: Path) -> None:
    broker = await in_process_broker(tmp_path / "broker", store="memory")
    try:
        connection = await ClientConnection.open(RealRuntime(), f"127.0.0.1:{broker.port}", WAIT_S)
        try:
            # The connection's first write: at the end of its turn, however long the gap.
            first = await asyncio.wait_for(connection.request("ping", WAIT_S), WAIT_S)
            assert first["broker_id"]
            # Right behind it: held for the gap...
            second = asyncio.ensure_future(connection.request("ping", WAIT_S))
            done, _ = await asyncio.wait({second}, timeout=0.5)
            assert not done, "a frame sent right after a write did not wait for the gap"
            # ...until the outbox holds WRITE_BYTES_MAX: then everything leaves at once.
            pad = "x" * (WRITE_BYTES_MAX // 2)
            for correlation in (1 << 30, (1 << 30) + 1):  # answers nobody waits for
                connection.send(
                    protocol.encode_json(MsgType.REQUEST, correlation, {"op": "ping", "pad": pad})
                )
            assert (await asyncio.wait_for(second, WAIT_S))["broker_id"] == first["broker_id"]
        finally:
            await connection.close()
    finally:
        await broker.stop()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_long_turn_writes_its_frames_before_it_ends(loop: str) -> None:
    """A producer's first write to 4,096 new ranges queues every stream's open and first batch
    in one turn of ~0.2 s; written at its end, the broker sat idle through it."""
    run = uvloop.run if loop == "uvloop" else asyncio.run
    run(_a_long_turn_writes_its_frames_before_it_ends())


async def _a_long_turn_writes_its_frames_before_it_ends() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    received = threading.Event()

    def read_until_a_long_turns_worth() -> None:
        peer, _ = listener.accept()
        with peer:
            got = 0
            while got < LONG_TURN_BYTES and (chunk := peer.recv(1 << 16)):
                got += len(chunk)
            received.set()
            while peer.recv(1 << 16):  # until the client closes
                pass

    reader = threading.Thread(target=read_until_a_long_turns_worth, daemon=True)
    reader.start()
    connection = await ClientConnection.open(
        RealRuntime(), f"127.0.0.1:{listener.getsockname()[1]}", WAIT_S
    )
    try:
        frame = protocol.encode_json(MsgType.REQUEST, 1, {"op": "ping", "pad": "x" * 1000})
        started, queued = time.monotonic(), 0
        while queued < 2 * LONG_TURN_BYTES or time.monotonic() - started < 2 * LONG_TURN_S:
            connection.send(frame)  # one turn: nothing here yields to the event loop
            queued += len(frame)
        # Still in that turn: the peer has them only if they were written before its end.
        assert received.wait(WAIT_S), "a long turn's frames waited for the end of the turn"
    finally:
        await connection.close()
        listener.close()
        reader.join(WAIT_S)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_write_hook_runs_with_the_write_or_after_the_connection_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, loop: str
) -> None:
    """``before_write`` is how a producer seals an idle shard's records: its frames must leave
    with the write it waited for, and a connection that fails first must still run it (the
    records then go to the producer's next stream), never leave them unsealed."""
    monkeypatch.setattr(client_connection, "WRITE_GAP_S", 3600.0)
    run = uvloop.run if loop == "uvloop" else asyncio.run
    run(_a_write_hook_runs_with_the_write_or_after_the_connection_fails(tmp_path))


async def _a_write_hook_runs_with_the_write_or_after_the_connection_fails(tmp_path: Path) -> None:
    broker = await in_process_broker(tmp_path / "broker", store="memory")
    connection = await ClientConnection.open(RealRuntime(), f"127.0.0.1:{broker.port}", WAIT_S)
    try:
        await asyncio.wait_for(connection.request("ping", WAIT_S), WAIT_S)

        # Right behind that write: the hook waits for the gap, then its frame goes with the
        # write that the outbox's filling forces.
        def pings() -> float:
            return (
                broker.metrics.registry.get_sample_value(
                    "northguard_requests_total", {"op": "ping"}
                )
                or 0.0
            )

        before = pings()
        loop = asyncio.get_running_loop()
        hooked: asyncio.Future[None] = loop.create_future()

        def hook() -> None:
            connection.send(protocol.encode_json(MsgType.REQUEST, 7, {"op": "ping"}))
            hooked.set_result(None)

        connection.before_write(hook)
        await asyncio.sleep(0)
        assert not hooked.done(), "the hook ran before the write it waited for"
        pad = "x" * (WRITE_BYTES_MAX // 2)
        for correlation in (1 << 30, (1 << 30) + 1):  # answers nobody waits for
            connection.send(
                protocol.encode_json(MsgType.REQUEST, correlation, {"op": "ping", "pad": pad})
            )
        await asyncio.wait_for(hooked, WAIT_S)

        async def all_three_arrived() -> bool:
            return pings() - before == 3

        await wait_for(all_three_arrived, "the hook's frame, with the write it waited for")
        # Behind the next gap again, then the broker goes: the hook still runs.
        ran: asyncio.Future[bool] = loop.create_future()
        connection.before_write(lambda: ran.set_result(connection.closed))
        await broker.stop()
        assert await asyncio.wait_for(ran, WAIT_S) is True  # run once the connection failed
    finally:
        await connection.close()
        await broker.stop()


def test_a_hook_registered_by_a_hook_gets_a_write_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hooks run with the send side held (their frames go with the write under way), so one that
    a hook registers must still get a write scheduled, not wait for an unrelated send."""
    monkeypatch.setattr(client_connection, "WRITE_GAP_S", 0.0)
    asyncio.run(_a_hook_registered_by_a_hook_gets_a_write_of_its_own(tmp_path))


async def _a_hook_registered_by_a_hook_gets_a_write_of_its_own(tmp_path: Path) -> None:
    broker = await in_process_broker(tmp_path / "broker", store="memory")
    connection = await ClientConnection.open(RealRuntime(), f"127.0.0.1:{broker.port}", WAIT_S)
    try:
        inner: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        connection.before_write(lambda: connection.before_write(lambda: inner.set_result(None)))
        await asyncio.wait_for(inner, WAIT_S)
    finally:
        await connection.close()
        await broker.stop()
