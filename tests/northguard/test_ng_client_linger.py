"""The Northguard producer's linger waits only while the shard's pipe is busy.

A record sent to a shard with nothing in flight leaves with its connection's
next write (at the end of the event-loop turn, or when the write gap after a
recent write ends), with whatever else the shard was sent until then, not
after ``linger_ms``; records sent while a batch is in flight wait for its
acknowledgement (or the linger, whichever comes first) and then go as one
batch.  The linger here is ten minutes: a send that completes did not wait
for it.  Batches are counted by the broker's own append counter.
"""

from __future__ import annotations

import asyncio

import pytest
from ng_harness import backend_for, broker_metrics

from backends.northguard.client import connection as client_connection
from backends.northguard.launcher import NorthguardProcess
from xinfra.backend import ProducerOptions
from xinfra.keyspace import shard_ranges
from xinfra.model import Record

LINGER_MS = 600_000.0
WAIT_S = 30.0


def appends(process: NorthguardProcess) -> float:
    return broker_metrics(process).get("northguard_appends_total", 0.0)


def durable(process: NorthguardProcess) -> tuple[float, float]:
    """Records the store made durable, and the fsyncs its flushes made (the WAL's)."""
    metrics = broker_metrics(process)
    return (
        metrics.get("northguard_store_flushed_records_total", 0.0),
        metrics.get("northguard_store_flush_fsyncs_total", 0.0),
    )


async def test_an_idle_shard_sends_without_waiting_for_the_linger(
    private_broker: NorthguardProcess,
) -> None:
    backend = backend_for(private_broker.url)
    try:
        await backend.create_topic("idle", shard_ranges(2))
        producer = backend.producer("idle", ProducerOptions(linger_ms=LINGER_MS))
        before = appends(private_broker)
        records_before, fsyncs_before = durable(private_broker)
        same_turn = [producer.send(0, [Record(b"r%d" % i)]) for i in range(10)]
        offsets = await asyncio.wait_for(asyncio.gather(*same_turn), WAIT_S)
        assert [o for call in offsets for o in call] == list(range(10))
        assert appends(private_broker) - before == 1  # one turn's sends: one batch
        records_after, fsyncs_after = durable(private_broker)
        assert records_after - records_before == 10  # acknowledged: made durable, not lingering
        assert fsyncs_after - fsyncs_before >= 1
        other = await asyncio.wait_for(producer.send(1, [Record(b"x")]), WAIT_S)
        assert other == [0]
        await producer.close()
    finally:
        await backend.close()


async def test_an_idle_shard_seals_at_the_write_so_sends_within_the_gap_are_one_batch(
    private_broker: NorthguardProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two turns' sends to an idle shard right after a write: its records could not leave
    before the gap ends, so they are sealed then, as one batch (sealed at the end of the first
    turn, the second turn's send lingered behind that batch and made a second one)."""
    monkeypatch.setattr(client_connection, "WRITE_GAP_S", 1.0)
    backend = backend_for(private_broker.url)
    try:
        await backend.create_topic("gap", shard_ranges(1))
        producer = backend.producer("gap", ProducerOptions(linger_ms=LINGER_MS))
        await producer.send(0, [Record(b"warm")])  # the stream is open; its write was just now
        before = appends(private_broker)
        first = producer.send(0, [Record(b"first")])
        await asyncio.sleep(0)  # the turn ends inside the gap: nothing is written yet
        second = producer.send(0, [Record(b"second")])
        offsets = await asyncio.wait_for(asyncio.gather(first, second), WAIT_S)
        assert offsets == [[1], [2]]
        assert appends(private_broker) - before == 1
        await producer.close()
    finally:
        await backend.close()


async def test_sends_behind_a_batch_in_flight_go_as_one_batch_at_its_ack(
    private_broker: NorthguardProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client_connection, "WRITE_GAP_S", 0.0)  # the first batch leaves at once
    backend = backend_for(private_broker.url)
    try:
        await backend.create_topic("busy", shard_ranges(1))
        producer = backend.producer("busy", ProducerOptions(linger_ms=LINGER_MS))
        await producer.send(0, [Record(b"warm")])  # the stream is open
        before = appends(private_broker)
        first = producer.send(0, [Record(b"first")])
        await asyncio.sleep(0)  # the turn ends: the first batch is sealed and in flight
        assert not first.done()
        behind = [producer.send(0, [Record(b"b%d" % i)]) for i in range(5)]
        await asyncio.sleep(0)
        behind += [producer.send(0, [Record(b"c%d" % i)]) for i in range(5)]
        offsets = await asyncio.wait_for(asyncio.gather(first, *behind), WAIT_S)
        assert [o for call in offsets for o in call] == list(range(1, 12))
        assert appends(private_broker) - before == 2  # the first, then all ten behind it
        await producer.close()
    finally:
        await backend.close()
