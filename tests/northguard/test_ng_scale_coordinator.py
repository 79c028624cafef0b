"""The coordinator with many ranges: batched journal writes, a restart without per-segment work,
snapshots built off the event loop, and a bound on the sealed segments a range keeps."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from ng_harness import in_process_broker, wait_for

from backends.northguard.batch import encode_batch
from backends.northguard.broker.coordinator import _PendingOp
from backends.northguard.broker.server import Broker
from backends.northguard.broker.state import State
from xinfra.errors import Sealed
from xinfra.keyspace import shard_ranges
from xinfra.model import Record

RANGES = 300


async def _write(broker: Broker, topic: str, range_id: int, value: bytes) -> int:
    range_log = broker.coordinator.range_log(topic, range_id)
    return await range_log.append(encode_batch([Record(value=value)], 0), 1)


async def _write_all(broker: Broker, topic: str, value: bytes) -> None:
    ranges = broker.coordinator.topic(topic).ranges
    await asyncio.gather(*(_write(broker, topic, rid, value) for rid in ranges))


async def test_first_writes_and_a_restart_batch_their_journal_writes(tmp_path: Path) -> None:
    broker = await in_process_broker(tmp_path / "data")
    try:
        await broker.coordinator.create_topic("wide", shard_ranges(RANGES), {})
        writes_before = broker.coordinator.journal_writes
        await _write_all(broker, "wide", b"one")  # a new segment in every range
        assert broker.coordinator.journal_writes - writes_before < RANGES / 10
        assert broker.store.stats.create_batches < RANGES / 10  # type: ignore[attr-defined]
    finally:
        await broker.stop()
    broker = await in_process_broker(tmp_path / "data")
    try:
        store = broker.store
        # A clean stop left nothing to redo, and the restart wrote nothing: every active
        # segment stays active, continued by its range once used.
        assert store.stats.recovered_frames == store.stats.adopted_frames == 0  # type: ignore[attr-defined]
        assert store.pool.opens == 0  # type: ignore[attr-defined]
        assert broker.coordinator.journal_writes == broker.coordinator.journal_fsyncs == 0
        segments = broker.coordinator.state.segments.values()
        assert len(segments) == RANGES and all(s.state is State.ACTIVE for s in segments)
        assert broker.coordinator.logs.keys() == set()  # range logs are built on first use
        await _write_all(broker, "wide", b"two")
        assert broker.coordinator.journal_writes == 0  # no segment sealed or opened
        for rid in broker.coordinator.topic("wide").ranges:
            range_log = broker.coordinator.range_log("wide", rid)
            entries = await range_log.read(0, 1 << 20)
            entries += await range_log.read(entries[-1].end_offset, 1 << 20)
            assert [e.end_offset for e in entries] == [1, 2]
            assert len(broker.coordinator.state.ranges[rid].segments) == 1  # both in one segment
    finally:
        await broker.stop()


async def test_snapshots_are_built_off_the_loop_and_a_restart_loads_them(tmp_path: Path) -> None:
    broker = await in_process_broker(tmp_path / "data")
    coordinator = broker.coordinator
    coordinator.config.snapshot_ops_max = 100
    try:
        await coordinator.create_topic("snap", shard_ranges(RANGES), {})
        for round_ in range(2):
            await _write_all(broker, "snap", b"%d" % round_)
            for rid in coordinator.topic("snap").ranges:
                await coordinator.logs[rid].seal_active()  # a seal op per range

        async def snapshotted() -> bool:
            return coordinator.snapshots >= 1

        await wait_for(snapshotted, "a snapshot")
        assert coordinator.snapshot_bytes > 0
        expected = coordinator.state.to_json()
    finally:
        await broker.stop()
    broker = await in_process_broker(tmp_path / "data")
    try:
        state = broker.coordinator.state.to_json()
        # The restart sealed nothing (all were sealed): the same state, from snapshot + journal.
        assert state == expected
    finally:
        await broker.stop()


async def test_a_range_keeps_at_most_sealed_segments_max(tmp_path: Path) -> None:
    broker = await in_process_broker(tmp_path / "data", maintenance_s=3600)  # passes run here
    coordinator = broker.coordinator
    try:
        await coordinator.create_topic("few", shard_ranges(1), {})
        (rid,) = coordinator.topic("few").ranges
        for n in range(6):
            await _write(broker, "few", rid, b"%d" % n)
            await coordinator.logs[rid].seal_active()
        assert len(coordinator.state.ranges[rid].segments) == 6
        coordinator.config.sealed_segments_max = 2
        await coordinator.maintain()
        kept = coordinator.state.ranges[rid].segments
        assert len(kept) == 2
        assert coordinator.state.ranges[rid].start_offset == 4  # the oldest went first
        assert sorted(s.segment_id for s in broker.store.segments()) == sorted(kept)
    finally:
        await broker.stop()


async def test_an_op_queued_behind_a_seal_in_one_journal_write_sees_the_seal(
    tmp_path: Path,
) -> None:
    """Preconditions run against the state before a batch: an op whose precondition an
    earlier op of the same batch invalidates waits for the next write (found by the fuzz
    test: ``segment opened in sealed range``)."""
    broker = await in_process_broker(tmp_path / "data")
    coordinator = broker.coordinator
    try:
        await coordinator.create_topic("doomed", shard_ranges(1), {})
        (range_id,) = coordinator.topic("doomed").ranges
        loop = asyncio.get_running_loop()

        def still_active() -> None:
            if coordinator.state.ranges[range_id].state is not State.ACTIVE:
                raise Sealed(f"range {range_id} is sealed")

        seal = _PendingOp({"op": "seal_topic", "name": "doomed"}, None, loop.create_future())
        open_segment = _PendingOp(
            {
                "op": "open_segment",
                "range_id": range_id,
                "segment_id": "late",
                "start_offset": 0,
                "replicas": ["1"],
                "created_ms": 0,
            },
            still_active,
            loop.create_future(),
        )
        coordinator._queue_ops([seal, open_segment])  # one batch, as concurrent callers make
        await seal.done
        with pytest.raises(Sealed):
            await open_segment.done
        assert "late" not in coordinator.state.segments
    finally:
        await broker.stop()


async def test_maintenance_finds_what_comes_due_after_a_pass_that_found_nothing(
    tmp_path: Path,
) -> None:
    """A pass looks at every range only when something can be due: a segment opened after a
    pass that found nothing active must still age out, and one sealed after a pass that found
    nothing sealed must still expire.  The passes run here, one per poll."""
    broker = await in_process_broker(tmp_path / "data", segment_age_s_max=0.3, maintenance_s=3600)
    coordinator = broker.coordinator
    try:
        await coordinator.create_topic("aging", shard_ranges(1), {})
        await coordinator.create_topic("expiring", shard_ranges(1), {"retention.ms": "1"})
        (aging,) = coordinator.topic("aging").ranges
        (expiring,) = coordinator.topic("expiring").ranges
        await coordinator.maintain()  # nothing active, nothing sealed: nothing due yet

        await _write(broker, "aging", aging, b"a")

        async def aged() -> bool:
            await coordinator.maintain()
            (sid,) = coordinator.state.ranges[aging].segments
            return coordinator.state.segments[sid].state is State.SEALED

        await wait_for(aged, "a segment opened after that pass to age out")

        await _write(broker, "expiring", expiring, b"e")
        await coordinator.logs[expiring].seal_active()

        async def expired() -> bool:
            await coordinator.maintain()
            return not coordinator.state.ranges[expiring].segments

        await wait_for(expired, "a segment sealed after that pass to expire")
        assert coordinator.state.ranges[expiring].start_offset == 1
    finally:
        await broker.stop()
