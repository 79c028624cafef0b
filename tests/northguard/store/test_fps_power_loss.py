"""Crash consistency of the fps store under power loss, and proof that the check detects a missing fsync.

A SIGKILL keeps the page cache, so it cannot tell a store that fsyncs from
one that does not.  These tests run the store on ``PowerLossDisk`` (through
the runtime seam), pull the plug, reopen on the surviving bytes only, and
require every acknowledged append back at its offsets.  The negative cases
run the same workload with one kind of sync turned into a no-op that still
reports success (the WAL's fsync in a flush, the segment files' fsync in a
checkpoint, the offset index's sync, the directory sync of a rename): each
must lose acknowledged appends, or the positive test would prove nothing.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from backends.northguard.power_loss import PowerLossIndex, PowerLossRuntime
from backends.northguard.store import Entry, FpsStore
from backends.northguard.store.fps import SYNC_ALL_FILES_MIN
from xinfra.errors import CorruptData, NotFound, OffsetOutOfRange, StorageError, Unavailable

DATA = Path("/power-loss/data")
SEGMENTS = ("s1", "s2", "s3")
MANY_SEGMENTS = tuple(f"m{n}" for n in range(SYNC_ALL_FILES_MIN + 4))  # synced in one call
RECORDS_PER_BATCH = 10


@dataclass
class Outcome:
    acknowledged: list[tuple[str, Entry]] = field(default_factory=list)
    lost: list[tuple[str, Entry]] = field(default_factory=list)
    fsyncs_skipped: int = 0
    sync_alls: int = 0
    recovery_sync_alls: int = 0  # by the reopened store's recovery


def batch_of(segment_id: str, number: int) -> bytes:
    return (f"<{segment_id} batch {number}>".encode() * 40)[:333]


def open_store(runtime: PowerLossRuntime, index: PowerLossIndex) -> FpsStore:
    """Checkpoints only when the test asks (``checkpoint_ms`` far away), so the phases are exact."""
    return FpsStore(
        runtime,
        DATA,
        group_commit_ms=1.0,
        index_interval_bytes=512,
        checkpoint_ms=3_600_000.0,
        wal_file_bytes_max=1 << 20,
        index=index,
    )


async def append_round(
    store: FpsStore, ends: dict[str, int], batches: int, outcome: Outcome
) -> None:
    """``batches`` appends per segment, all in flight together (one or a few group commits)."""
    tasks: list[tuple[str, asyncio.Future[Entry]]] = []
    for _ in range(batches):
        for sid in ends:
            base = ends[sid]
            ends[sid] = base + RECORDS_PER_BATCH
            data = batch_of(sid, base)
            tasks.append(
                (sid, asyncio.ensure_future(store.append(sid, base, RECORDS_PER_BATCH, data)))
            )
    for sid, task in tasks:
        outcome.acknowledged.append((sid, await task))


async def survives(store: FpsStore, sid: str, entry: Entry) -> bool:
    try:
        found = await store.read(sid, entry.base_offset, 1)
    except (CorruptData, NotFound, OffsetOutOfRange):
        return False
    return bool(found) and found[0] == entry


async def run_and_pull_the_plug(
    *,
    skip_fsync: tuple[str, ...] = (),
    skip_directory_sync: bool = False,
    segments: tuple[str, ...] = SEGMENTS,
) -> Outcome:
    """Acknowledged appends in three phases (checkpointed, checkpointed again, in the WAL only),
    appends still queued, then a power loss and a restart: which acknowledged appends survive.
    With ``MANY_SEGMENTS`` a checkpoint syncs its files in one ``sync_all``."""
    runtime = PowerLossRuntime()
    disk = runtime.disk
    disk.skip_fsync = skip_fsync
    disk.skip_directory_sync = skip_directory_sync
    index = disk.index()
    outcome = Outcome()
    store = open_store(runtime, index)
    await store.open()
    for sid in segments:
        await store.create_segment(sid, 0)
    ends = dict.fromkeys(segments, 0)
    await append_round(store, ends, 8, outcome)
    assert await store.checkpoint()  # segment files synced, the WAL released
    await append_round(store, ends, 8, outcome)
    assert await store.checkpoint()  # its WAL roll makes the first release durable
    await append_round(store, ends, 8, outcome)  # acknowledged, in the WAL only
    queued = [
        asyncio.ensure_future(store.append(sid, ends[sid], RECORDS_PER_BATCH, b"never acked"))
        for sid in segments
    ]
    disk.power_loss()
    await store.crash()
    for task in queued:  # never acknowledged: the plug was pulled before their flush
        with pytest.raises((StorageError, Unavailable)):
            await task
    outcome.fsyncs_skipped = disk.fsyncs_skipped
    outcome.sync_alls = disk.sync_alls
    disk.skip_fsync, disk.skip_directory_sync = (), False  # the next boot's disk is sound

    reopened = open_store(runtime, index.reopened())
    await reopened.open()
    outcome.recovery_sync_alls = disk.sync_alls - outcome.sync_alls
    try:
        for sid, entry in outcome.acknowledged:
            if not await survives(reopened, sid, entry):
                outcome.lost.append((sid, entry))
    finally:
        await reopened.close()
    return outcome


async def test_every_acknowledged_append_survives_power_loss() -> None:
    outcome = await run_and_pull_the_plug()
    assert len(outcome.acknowledged) == 3 * 8 * len(SEGMENTS)
    assert outcome.lost == []
    assert outcome.fsyncs_skipped == 0
    assert outcome.sync_alls == 0  # three files: an fsync each


async def test_checkpoints_syncing_many_files_in_one_call_lose_nothing() -> None:
    outcome = await run_and_pull_the_plug(segments=MANY_SEGMENTS)
    assert len(outcome.acknowledged) == 3 * 8 * len(MANY_SEGMENTS)
    assert outcome.lost == []
    assert outcome.sync_alls >= 2  # both checkpoints
    assert outcome.recovery_sync_alls == 1  # the files its WAL replay wrote: one sync of them all


async def test_the_check_fails_when_the_one_sync_of_many_files_skips_them() -> None:
    """The teeth of the test above: a ``sync_all`` that leaves the segment files as they were."""
    outcome = await run_and_pull_the_plug(skip_fsync=(".seg",), segments=MANY_SEGMENTS)
    assert outcome.sync_alls >= 2
    assert len(outcome.lost) >= 8 * len(MANY_SEGMENTS), len(outcome.lost)


@pytest.mark.parametrize(
    ("skipped", "lost_at_least"),
    [
        pytest.param({"skip_fsync": (".wal",)}, 8 * len(SEGMENTS), id="flush-skips-wal-fsync"),
        pytest.param(
            {"skip_fsync": (".seg",)}, 8 * len(SEGMENTS), id="checkpoint-skips-segment-fsync"
        ),
        pytest.param({"skip_fsync": ("index",)}, 3 * 8 * len(SEGMENTS), id="index-sync-skipped"),
        pytest.param(
            {"skip_directory_sync": True}, 3 * 8 * len(SEGMENTS), id="rename-skips-dir-sync"
        ),
    ],
)
async def test_the_check_fails_when_a_sync_is_skipped(
    skipped: dict[str, object], lost_at_least: int
) -> None:
    """The teeth: with one sync a no-op, the store acknowledges appends a power loss then takes."""
    outcome = await run_and_pull_the_plug(**skipped)  # type: ignore[arg-type]
    assert outcome.fsyncs_skipped > 0
    assert len(outcome.lost) >= lost_at_least, (len(outcome.lost), len(outcome.acknowledged))


async def test_power_loss_mid_stream_keeps_every_acknowledged_append() -> None:
    """Producers append back to back; the plug is pulled from inside an acknowledgement, with a
    flush and a checkpoint possibly running in worker threads: whatever was acknowledged stays."""
    runtime = PowerLossRuntime()
    index = runtime.disk.index()
    store = FpsStore(
        runtime, DATA, group_commit_ms=1.0, checkpoint_ms=5.0, index=index, index_interval_bytes=512
    )
    await store.open()
    for sid in SEGMENTS:
        await store.create_segment(sid, 0)
    acknowledged: list[tuple[str, Entry]] = []
    plug = asyncio.Event()

    async def produce(sid: str) -> None:
        offset = 0
        while not plug.is_set():
            try:
                entry = await store.append(sid, offset, RECORDS_PER_BATCH, batch_of(sid, offset))
            except (StorageError, Unavailable):
                return
            acknowledged.append((sid, entry))
            offset = entry.end_offset
            if len(acknowledged) == 150 and not plug.is_set():
                runtime.disk.power_loss()
                plug.set()

    await asyncio.gather(*(produce(sid) for sid in SEGMENTS))
    await store.crash()
    reopened = open_store(runtime, index.reopened())
    await reopened.open()
    try:
        lost = [(sid, e) for sid, e in acknowledged if not await survives(reopened, sid, e)]
    finally:
        await reopened.close()
    assert len(acknowledged) >= 150
    assert lost == []
