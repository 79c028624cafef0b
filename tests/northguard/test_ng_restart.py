"""A restart whose work does not grow with the active segments: real broker processes, SIGTERM and SIGKILL.

A broker with thousands of active segments (one per range) is stopped
cleanly or killed, and restarted.  The restart must write nothing to the
metadata journal (its own counters on ``/metrics``: writes and fsyncs since
the process started), keep the segments it had (no segment sealed, none
opened), serve every acknowledged record, and take new appends into the same
segments.  Counters, not timings: the machine is shared.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from ng_harness import backend_for, broker_metrics, in_process_broker, read_until

from backends.northguard.batch import encode_batch
from backends.northguard.broker.state import State
from backends.northguard.launcher import NorthguardProcess
from xinfra.backend import ProducerOptions
from xinfra.keyspace import shard_ranges
from xinfra.model import Record

RANGES = 2048


async def write_every_range(address: str, topic: str, generation: int) -> dict[int, int]:
    """One record to every range at once; the offset each was acknowledged at, by range."""
    backend = backend_for(address)
    producer = backend.producer(topic, ProducerOptions(linger_ms=5))
    try:
        offsets = await asyncio.gather(
            *(
                producer.send(shard, [Record(value=b"%d/%d" % (generation, shard))])
                for shard in range(RANGES)
            )
        )
    finally:
        await producer.close()
        await backend.close()
    return {shard: result[0] for shard, result in enumerate(offsets)}


async def read_all(
    address: str, topic: str, count: int
) -> dict[int, list[tuple[int, bytes | None]]]:
    backend = backend_for(address)
    reader = backend.reader(topic)
    try:
        reader.assign(dict.fromkeys(range(RANGES), 0))
        records = await read_until(reader, count, timeout_s=120)
    finally:
        await reader.close()
        await backend.close()
    by_shard: dict[int, list[tuple[int, bytes | None]]] = {}
    for record in records:
        by_shard.setdefault(record.shard, []).append((record.offset, record.value))
    return by_shard


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
async def test_a_restart_keeps_thousands_of_active_segments_without_journal_writes(
    private_broker: NorthguardProcess, how: str
) -> None:
    address = private_broker.url
    admin = backend_for(address)
    await admin.create_topic("wide", shard_ranges(RANGES))
    await admin.close()
    created = broker_metrics(private_broker)
    first = await write_every_range(address, "wide", 1)
    assert set(first.values()) == {0}
    before = broker_metrics(private_broker)
    assert before["northguard_store_segments"] == RANGES
    # The first writes opened RANGES segments together: creations and their journal ops are
    # group-committed, a few syncs for all of them, not one per segment.
    opened = {
        name: before[name] - created[name]
        for name in ("northguard_journal_fsyncs_total", "northguard_store_create_batches_total")
    }
    assert all(0 < count <= 16 for count in opened.values()), opened

    if how == "sigterm":
        await asyncio.to_thread(private_broker.stop)
    else:
        await asyncio.to_thread(private_broker.kill)  # acknowledged appends may be in the WAL only
    await asyncio.to_thread(private_broker.restart)

    after = broker_metrics(private_broker)
    # Recovery wrote nothing to the journal: no seal per active segment, not even one batch.
    assert after["northguard_journal_writes_total"] == 0
    assert after["northguard_journal_fsyncs_total"] == 0
    assert after["northguard_store_segments"] == RANGES
    if how == "sigterm":  # a clean stop checkpointed: the store had nothing to replay
        assert after["northguard_store_recovered_frames_total"] == 0

    assert await read_all(address, "wide", RANGES) == {s: [(0, b"1/%d" % s)] for s in range(RANGES)}
    second = await write_every_range(address, "wide", 2)  # into the same segments
    assert second == dict.fromkeys(range(RANGES), 1)
    now = broker_metrics(private_broker)
    assert now["northguard_store_segments"] == RANGES
    assert now["northguard_journal_writes_total"] == 0  # no segment opened
    assert await read_all(address, "wide", 2 * RANGES) == {
        s: [(0, b"1/%d" % s), (1, b"2/%d" % s)] for s in range(RANGES)
    }


async def test_a_seal_cut_by_a_crash_is_recorded_at_restart_and_the_range_moves_on(
    tmp_path: Path,
) -> None:
    """Sealed in the store, still active in the journal (a roll cut between its two steps): the
    restart records that one seal, in one journal write, and leaves the other ranges' segments."""
    broker = await in_process_broker(tmp_path / "data")
    try:
        await broker.coordinator.create_topic("cut", shard_ranges(3), {})
        ranges = broker.coordinator.topic("cut").ranges
        for rid in ranges:
            await broker.coordinator.range_log("cut", rid).append(
                encode_batch([Record(value=b"a")], 0), 1
            )
        cut = broker.coordinator.state.ranges[ranges[0]].segments[-1]
        await broker.store.seal(cut)  # the roll's first step; the process dies before the second
    finally:
        await broker.stop()
    broker = await in_process_broker(tmp_path / "data")
    try:
        coordinator = broker.coordinator
        assert coordinator.journal_writes == 1 and coordinator.journal_ops == 1
        segments = coordinator.state.segments
        assert segments[cut].state is State.SEALED and segments[cut].end_offset == 1
        for rid in ranges:
            offset = await coordinator.range_log("cut", rid).append(
                encode_batch([Record(value=b"b")], 0), 1
            )
            assert offset == 1
        assert len(coordinator.state.ranges[ranges[0]].segments) == 2  # it moved to a new one
        assert [len(coordinator.state.ranges[rid].segments) for rid in ranges[1:]] == [1, 1]
        entries = await coordinator.range_log("cut", ranges[0]).read(0, 1 << 20)
        entries += await coordinator.range_log("cut", ranges[0]).read(1, 1 << 20)
        assert [e.end_offset for e in entries] == [1, 2]
    finally:
        await broker.stop()


async def test_a_segment_no_metadata_names_is_deleted_at_restart_and_the_others_kept(
    tmp_path: Path,
) -> None:
    """In the store, unknown to the journal (a create cut by a crash before its op was
    recorded): the restart deletes it and keeps every segment the metadata names."""
    broker = await in_process_broker(tmp_path / "data")
    try:
        await broker.coordinator.create_topic("kept", shard_ranges(2), {})
        for rid in broker.coordinator.topic("kept").ranges:
            await broker.coordinator.range_log("kept", rid).append(
                encode_batch([Record(value=b"a")], 0), 1
            )
        await broker.store.create_segment("orphan-1", 0)
        await broker.store.append("orphan-1", 0, 1, encode_batch([Record(value=b"x")], 0))
        named = set(broker.coordinator.state.segments)
    finally:
        await broker.stop()
    broker = await in_process_broker(tmp_path / "data")
    try:
        held = {info.segment_id for info in broker.store.segments()}
        assert "orphan-1" not in held
        assert held == named
        for rid in broker.coordinator.topic("kept").ranges:
            entries = await broker.coordinator.range_log("kept", rid).read(0, 1 << 20)
            assert [e.end_offset for e in entries] == [1]
    finally:
        await broker.stop()
