"""Recovery of the fps store: restart, crash, torn WAL tails, corruption, seal and delete across restarts."""

from __future__ import annotations

import asyncio
import logging
import random
from pathlib import Path

import pytest
from store_faults import FaultyRuntime, StoreFactory

from backends.northguard.store import Entry, FpsStore, SegmentState
from backends.northguard.store.framing import FrameStatus, decode_frame, encode_frame
from xinfra.errors import CorruptData, OffsetOutOfRange, Sealed, StorageError, Unavailable


def payload(number: int, size: int = 300) -> bytes:
    return (f"<entry {number}>".encode() * size)[:size]


async def fill(
    store: FpsStore, segment_id: str, start: int, count: int, size: int = 300
) -> list[Entry]:
    tasks = [
        asyncio.ensure_future(store.append(segment_id, start + n * 10, 10, payload(n, size)))
        for n in range(count)
    ]
    entries = await asyncio.gather(*tasks)
    assert [e.base_offset for e in entries] == [start + n * 10 for n in range(count)]
    return list(entries)


def wal_files(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "data" / "wal").glob("*.wal"))


def append_to(path: Path, data: bytes) -> None:
    """Write ``data`` where the WAL's next group would go: after its last frame, over the zeros
    that pad its last block under O_DIRECT."""
    content = path.read_bytes()
    end = 0
    while (decoded := decode_frame(content, end)).status is FrameStatus.OK:
        end += decoded.frame_bytes
    with path.open("r+b") as handle:
        handle.seek(end)
        handle.write(data)


def flip_byte(path: Path, needle: bytes, skip: int = 5) -> None:
    data = bytearray(path.read_bytes())
    at = data.find(needle)
    assert at >= 0, "needle not found"
    data[at + skip] ^= 0x40
    path.write_bytes(bytes(data))


async def test_close_and_reopen_keeps_everything(open_fps: StoreFactory) -> None:
    store = await open_fps(index_interval_bytes=512)
    await store.create_segment("s1", 100)
    await store.create_segment("s2", 0)
    one = await fill(store, "s1", 100, 50)
    two = await fill(store, "s2", 0, 7)
    await store.close()
    store = await open_fps(index_interval_bytes=512)
    assert store.segment("s1").end_offset == 600
    assert store.segment("s2").end_offset == 70
    assert await store.read("s1", 100, 1 << 30) == one
    assert await store.read("s2", 0, 1 << 30) == two
    assert await store.read("s1", 455, 1) == [one[35]]  # through the sparse index
    await store.append("s1", 600, 1, b"more")


async def test_crash_with_queued_appends_keeps_only_acknowledged_ones(
    open_fps: StoreFactory,
) -> None:
    store = await open_fps(group_commit_ms=600_000.0, group_commit_records_max=30)
    await store.create_segment("s1", 0)
    acked = await fill(store, "s1", 0, 3)  # 30 records: the record bound flushes them
    queued = [
        asyncio.ensure_future(store.append("s1", 30 + n * 10, 10, b"never")) for n in range(2)
    ]
    await store.crash()
    results = await asyncio.gather(*queued, return_exceptions=True)
    assert all(isinstance(r, StorageError | Unavailable) for r in results)
    store = await open_fps()
    assert store.segment("s1").end_offset == 30
    assert await store.read("s1", 0, 1 << 20) == acked


async def test_a_torn_wal_tail_is_dropped_quietly(
    open_fps: StoreFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = await open_fps()
    await store.create_segment("s1", 0)
    acked = await fill(store, "s1", 0, 5)
    await store.crash()
    frame = encode_frame("s1", 50, 10, payload(99, 2000))
    append_to(wal_files(tmp_path)[-1], frame[: len(frame) - 700])  # a flush cut by the crash
    with caplog.at_level(logging.WARNING):
        store = await open_fps()
    assert "never acknowledged" in caplog.text
    assert store.segment("s1").end_offset == 50
    assert await store.read("s1", 0, 1 << 20) == acked
    entry = await store.append("s1", 50, 10, b"after the torn tail")
    assert (await store.read("s1", 50, 100)) == [entry]


async def test_a_direct_wal_pads_its_last_block_and_replays_it_without_a_torn_tail(
    open_fps: StoreFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = await open_fps()
    await store.create_segment("s1", 0)
    if not store.direct_io("s1"):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")
    acked = []
    for n, size in enumerate((1, 4000, 5000, 97)):  # each its own flush: the last block rewritten
        acked.append(await store.append("s1", n * 10, 10, payload(n, size)))
    await store.crash()  # no checkpoint: the WAL is all they are in
    (wal,) = wal_files(tmp_path)
    logical = sum(len(encode_frame("s1", e.base_offset, 10, e.batch)) for e in acked)
    assert wal.stat().st_size % 4096 == 0 and wal.stat().st_size > logical
    with caplog.at_level(logging.INFO):
        store = await open_fps()
    assert "0 torn bytes dropped" in caplog.text and "ignoring" not in caplog.text
    assert await store.read("s1", 0, 1 << 20) == acked
    acked.append(await store.append("s1", 40, 10, payload(4, 300)))  # a new file, padded
    await store.crash()
    assert wal_files(tmp_path)[-1].stat().st_size == 4096
    frame = encode_frame("s1", 50, 10, payload(7, 2000))
    append_to(wal_files(tmp_path)[-1], frame[: len(frame) - 700])  # a write cut, zeros after it
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        store = await open_fps()
    assert "never acknowledged" in caplog.text and "CRC mismatch" not in caplog.text
    assert not list((tmp_path / "data" / "wal").glob("*.corrupt"))  # a torn tail, not corruption
    assert await store.read("s1", 0, 1 << 20) == acked


async def test_a_torn_header_and_zero_fill_are_dropped_too(
    open_fps: StoreFactory, tmp_path: Path
) -> None:
    store = await open_fps()
    await store.create_segment("s1", 0)
    await fill(store, "s1", 0, 2)
    await store.crash()
    append_to(wal_files(tmp_path)[-1], encode_frame("s1", 20, 10, b"x" * 50)[:20])
    store = await open_fps()
    assert store.segment("s1").end_offset == 20
    await store.crash()
    append_to(wal_files(tmp_path)[-1], bytes(8192))  # a file extended but never written
    store = await open_fps()
    assert store.segment("s1").end_offset == 20


async def test_wal_frames_missing_from_the_segment_are_reapplied(
    open_fps: StoreFactory, tmp_path: Path
) -> None:
    store = await open_fps(segment_write_bytes=1)  # each frame written to its file at once
    await store.create_segment("s1", 0)
    acked = await fill(store, "s1", 0, 3)
    await store.crash()
    # The WAL was fsynced but the crash came before the segment write: recovery finishes the flush.
    append_to(
        wal_files(tmp_path)[-1],
        encode_frame("s1", 30, 10, b"w1") + encode_frame("s1", 40, 5, b"w2"),
    )
    store = await open_fps()
    assert store.stats.recovered_frames == 2
    expected = [*acked, Entry(30, 10, b"w1"), Entry(40, 5, b"w2")]
    assert await store.read("s1", 0, 1 << 20) == expected
    await store.crash()
    store = await open_fps()  # the WAL is gone now: the frames were made durable in the segment
    assert await store.read("s1", 0, 1 << 20) == expected


async def test_an_unacknowledged_flush_may_reappear_after_restart(open_fps: StoreFactory) -> None:
    runtime = FaultyRuntime()
    store = await open_fps(runtime)
    await store.create_segment("s1", 0)
    acked = await fill(store, "s1", 0, 2)
    assert await store.checkpoint()  # nothing left for the background to write or sync
    runtime.faulty_disk.faults["fsync"] = (".wal",)  # the WAL is written, its fsync fails
    with pytest.raises(StorageError):
        await store.append("s1", 20, 10, b"written, never acknowledged")
    await store.crash()
    store = await open_fps()
    entries = await store.read("s1", 0, 1 << 20)
    assert entries[:2] == acked
    assert entries[2:] == [Entry(20, 10, b"written, never acknowledged")]  # at-least-once, whole


async def test_an_append_whose_segment_write_fails_is_acknowledged_and_replayed_from_the_wal(
    open_fps: StoreFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """The WAL's fsync acknowledges; the segment file is written after it, and a failure there is
    fail-stop but loses nothing: recovery replays the WAL into the segment file."""
    runtime = FaultyRuntime()
    store = await open_fps(runtime, checkpoint_ms=60_000.0)
    await store.create_segment("s1", 0)
    acked = await fill(store, "s1", 0, 2)
    assert await store.checkpoint()
    runtime.faulty_disk.faults["pwrite"] = (".seg",)
    entry = await store.append("s1", 20, 10, b"in the WAL only")
    assert entry == Entry(20, 10, b"in the WAL only")
    with caplog.at_level(logging.ERROR), pytest.raises(StorageError):
        await store.checkpoint()  # its writer pass fails on the segment file
    assert store.failed and "writing segment files" in caplog.text
    await store.crash()
    store = await open_fps()
    assert store.stats.recovered_frames == 1
    assert await store.read("s1", 0, 1 << 20) == [*acked, entry]
    await store.crash()
    store = await open_fps()  # replayed into the segment file and synced: the WAL is gone
    assert store.stats.recovered_frames == 0
    assert await store.read("s1", 0, 1 << 20) == [*acked, entry]


async def test_a_flipped_byte_in_a_segment_file_is_reported_and_never_served(
    open_fps: StoreFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = await open_fps(index_interval_bytes=1024)
    await store.create_segment("s1", 0)
    acked = await fill(store, "s1", 0, 20)
    await store.close()
    flip_byte(tmp_path / "data" / "segments" / "s1.seg", payload(7))
    store = await open_fps(index_interval_bytes=1024)  # recovery does not rescan: the read finds it
    with caplog.at_level(logging.ERROR), pytest.raises(CorruptData):
        await store.read("s1", 70, 1 << 20)
    assert "CRC mismatch" in caplog.text
    with pytest.raises(CorruptData):
        await store.read("s1", 75, 1)
    assert await store.read("s1", 0, 1 << 20) == acked[:7]  # the good prefix, then stop
    assert await store.read("s1", 80, 1 << 20) == acked[8:]  # the header was intact: skipped over


async def test_a_flipped_header_byte_is_corrupt_data_too(
    open_fps: StoreFactory, tmp_path: Path
) -> None:
    store = await open_fps()
    await store.create_segment("s1", 0)
    await fill(store, "s1", 0, 5)
    await store.close()
    segment_file = tmp_path / "data" / "segments" / "s1.seg"
    data = bytearray(segment_file.read_bytes())
    second = data.find(b"\x01\x46\x47\x4e", 1)  # the magic of the second frame
    data[second + 16] ^= 0x01  # its base offset
    segment_file.write_bytes(bytes(data))
    store = await open_fps()
    with pytest.raises(CorruptData):
        await store.read("s1", 10, 1 << 20)


async def test_a_flipped_byte_in_the_wal_is_reported_and_the_segment_copy_served(
    open_fps: StoreFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = await open_fps(segment_write_bytes=1)  # each frame written to its file at once
    await store.create_segment("s1", 0)
    acked = await fill(store, "s1", 0, 5)
    await store.crash()
    flip_byte(wal_files(tmp_path)[-1], payload(2))
    with caplog.at_level(logging.ERROR):
        store = await open_fps()
    assert "CRC mismatch" in caplog.text
    assert list((tmp_path / "data" / "wal").glob("*.corrupt"))  # kept for inspection
    assert await store.read("s1", 0, 1 << 20) == acked


async def test_a_corrupt_wal_frame_past_the_segment_end_is_lost_loudly(
    open_fps: StoreFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = await open_fps()
    await store.create_segment("s1", 0)
    acked = await fill(store, "s1", 0, 2)
    await store.crash()
    bad = bytearray(encode_frame("s1", 30, 10, b"damaged-batch"))
    bad[-3] ^= 0xFF
    append_to(
        wal_files(tmp_path)[-1],
        encode_frame("s1", 20, 10, b"good") + bytes(bad) + encode_frame("s1", 40, 10, b"after"),
    )
    with caplog.at_level(logging.ERROR):
        store = await open_fps()
    assert "CRC mismatch" in caplog.text and "lost" in caplog.text
    assert store.stats.recovery_lost_entries == 1
    assert store.segment("s1").end_offset == 30
    assert await store.read("s1", 0, 1 << 20) == [*acked, Entry(20, 10, b"good")]
    with pytest.raises(OffsetOutOfRange):
        await store.read("s1", 40, 100)


async def test_seal_survives_restart_and_refuses_appends(open_fps: StoreFactory) -> None:
    store = await open_fps()
    info = await store.create_segment("s1", 0)
    acked = await fill(store, "s1", 0, 10)
    await store.seal("s1", 40)
    await store.crash()
    store = await open_fps()
    sealed = store.segment("s1")
    assert (sealed.state, sealed.end_offset, sealed.created_ms) == (
        SegmentState.SEALED,
        40,
        info.created_ms,
    )
    with pytest.raises(Sealed):
        await store.append("s1", 40, 1, b"x")
    assert await store.read("s1", 0, 1 << 20) == acked[:4]


async def test_a_seal_cut_short_is_finished_by_recovery(open_fps: StoreFactory) -> None:
    runtime = FaultyRuntime()
    store = await open_fps(runtime)
    await store.create_segment("s1", 0)
    acked = await fill(store, "s1", 0, 10)
    runtime.faulty_disk.faults["truncate"] = (".seg",)  # the seal is durable, the cut is not done
    with pytest.raises(StorageError):
        await store.seal("s1", 60)
    await store.crash()
    store = await open_fps()
    assert (store.segment("s1").state, store.segment("s1").end_offset) == (SegmentState.SEALED, 60)
    assert await store.read("s1", 0, 1 << 20) == acked[:6]


async def test_delete_survives_restart_and_a_reused_id_starts_empty(
    open_fps: StoreFactory, tmp_path: Path
) -> None:
    store = await open_fps()
    await store.create_segment("s1", 0)
    await store.create_segment("keep", 0)
    kept = await fill(store, "keep", 0, 3)
    await fill(store, "s1", 0, 5)
    await store.delete_segment("s1")
    await store.crash()
    store = await open_fps()
    assert [s.segment_id for s in store.segments()] == ["keep"]
    assert not (tmp_path / "data" / "segments" / "s1.seg").exists()
    await store.create_segment("s1", 0)
    await store.crash()
    store = await open_fps()  # old WAL frames of the deleted s1 must not come back into the new one
    assert store.segment("s1").end_offset == 0
    assert await store.read("keep", 0, 1 << 20) == kept


async def test_wal_files_roll_and_are_removed_once_applied(
    open_fps: StoreFactory, tmp_path: Path
) -> None:
    store = await open_fps(wal_file_bytes_max=8192)
    await store.create_segment("s1", 0)
    for n in range(60):
        await store.append("s1", n, 1, payload(n, 700))
    assert len(wal_files(tmp_path)) <= 2
    await store.crash()
    store = await open_fps()
    assert [e.batch for e in await store.read("s1", 0, 1 << 30)] == [
        payload(n, 700) for n in range(60)
    ]


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_random_reads_match_a_model_before_and_after_restart(
    open_fps: StoreFactory, seed: int
) -> None:
    rng = random.Random(seed)
    options = {"index_interval_bytes": 700, "read_cache_bytes_max": 5_000}
    store = await open_fps(**options)
    await store.create_segment("s1", 1000)
    model: list[Entry] = []
    offset = 1000
    for _ in range(100):
        count = rng.randint(1, 20)
        data = rng.randbytes(rng.randint(1, 1500))
        model.append(await store.append("s1", offset, count, data))
        assert model[-1] == Entry(offset, count, data)
        offset += count

    async def check() -> None:
        for _ in range(100):
            wanted = rng.randrange(1000, offset)
            bytes_max = rng.randint(0, 6000)
            got = await store.read("s1", wanted, bytes_max)
            first = next(i for i, e in enumerate(model) if e.base_offset <= wanted < e.end_offset)
            assert got[0] == model[first]
            assert got == model[first : first + len(got)]
            assert len(got) == 1 or sum(len(e.batch) for e in got) <= bytes_max

    await check()
    await store.crash()
    store = await open_fps(**options)
    await check()
