"""Disk faults: a failed fsync is fail-stop; O_DIRECT is used where granted and falls back cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
from pathlib import Path

import pytest
from store_faults import FaultyRuntime, StoreFactory

from backends.northguard.store import direct_append
from xinfra.errors import StorageError, Unavailable


@pytest.mark.parametrize("failing_file", [".wal"])
async def test_an_fsync_error_fails_the_group_and_stops_all_writes(
    open_fps: StoreFactory,
    faulty_runtime: FaultyRuntime,
    failing_file: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The WAL's fsync is what acknowledges a flush (segment files sync at checkpoints, below)."""
    store = await open_fps(faulty_runtime, group_commit_ms=5.0)
    await store.create_segment("s1", 0)
    await store.create_segment("s2", 0)
    acked = [await store.append("s1", n, 1, f"acked {n}".encode()) for n in range(3)]
    faulty_runtime.faulty_disk.faults["fsync"] = (failing_file,)
    tasks = [asyncio.ensure_future(store.append("s1", 3 + n, 1, b"doomed")) for n in range(20)]
    with caplog.at_level(logging.ERROR):
        results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, StorageError) for r in results), results
    assert faulty_runtime.faulty_disk.fsync_failures == 1
    assert store.failed and "refusing all writes" in caplog.text
    faulty_runtime.faulty_disk.faults.clear()  # the disk "recovers": the store must still refuse
    for write in (
        store.append("s1", 23, 1, b"x"),
        store.append("s2", 0, 1, b"x"),
        store.create_segment("s3", 0),
        store.seal("s2"),
        store.delete_segment("s2"),
    ):
        with pytest.raises(StorageError):
            await write
    assert store.segment("s1").end_offset == 3  # nothing unacknowledged is visible
    assert await store.read("s1", 0, 1 << 20) == acked  # acknowledged data is still served
    await store.close()
    store = await open_fps(faulty_runtime)
    assert not store.failed
    assert (await store.read("s1", 0, 1 << 20))[:3] == acked
    end = store.segment("s1").end_offset
    await store.append("s1", end, 1, b"after reopen")


async def test_a_failed_segment_sync_at_a_checkpoint_stops_writes_and_loses_nothing_acknowledged(
    open_fps: StoreFactory, faulty_runtime: FaultyRuntime, caplog: pytest.LogCaptureFixture
) -> None:
    """Segment files are fsynced side by side by a checkpoint; one failing is fail-stop, and the WAL
    that covers every acknowledged append stays until a checkpoint succeeds."""
    store = await open_fps(faulty_runtime, group_commit_ms=5.0, checkpoint_ms=60_000.0)
    for sid in ("s1", "s2", "s3"):
        await store.create_segment(sid, 0)
    faulty_runtime.faulty_disk.faults["fsync"] = ("s2.seg",)
    acked = {sid: await store.append(sid, 0, 1, sid.encode()) for sid in ("s1", "s2", "s3")}
    with caplog.at_level(logging.ERROR):
        await store.close()  # its checkpoint fails on s2
    assert faulty_runtime.faulty_disk.fsync_failures == 1
    assert store.failed and "refusing all writes" in caplog.text
    faulty_runtime.faulty_disk.faults.clear()
    store = await open_fps(faulty_runtime)
    for sid, entry in acked.items():
        assert await store.read(sid, 0, 1 << 20) == [entry]


@pytest.mark.parametrize(
    ("stop", "stuck"),
    [
        ("close", "checkpoint"),
        ("crash", "checkpoint"),
        ("close", "own checkpoint"),
        ("crash", "flush"),
    ],
)
async def test_close_and_crash_are_bounded_while_a_disk_call_hangs(
    open_fps: StoreFactory,
    faulty_runtime: FaultyRuntime,
    caplog: pytest.LogCaptureFixture,
    stop: str,
    stuck: str,
) -> None:
    """Work stuck in a hung fsync holds the store: closing gives up after its bound instead of
    hanging, the files are released once the fsync returns, and nothing acknowledged is lost."""
    store = await open_fps(faulty_runtime, close_timeout_ms=500.0, checkpoint_ms=60_000.0)
    await store.create_segment("s1", 0)
    entry = await store.append("s1", 0, 1, b"acked")
    disk = faulty_runtime.faulty_disk
    disk.faults["stall_fsync"] = (".wal",) if stuck == "flush" else (".seg",)
    work: asyncio.Future[object] | None = None
    if stuck == "checkpoint":
        work = asyncio.ensure_future(store.checkpoint())
    elif stuck == "flush":
        work = asyncio.ensure_future(store.append("s1", 1, 1, b"in a hung flush"))
    try:
        if work is not None:
            assert await asyncio.get_running_loop().run_in_executor(None, disk.stalled.wait, 10)
        with caplog.at_level(logging.ERROR):
            await (store.close() if stop == "close" else store.crash())
        assert f"{stop} gave up after 0.5 s" in caplog.text
        with pytest.raises(Unavailable):
            await store.append("s1", 1, 1, b"after closing")
    finally:
        disk.unstall.set()
    if work is not None:
        with contextlib.suppress(StorageError):  # the hung flush was failed by the crash
            await work
    await store.close()  # waits (bounded) for the files to be released now the fsync returned
    disk.faults.clear()
    store = await open_fps(faulty_runtime)
    assert (await store.read("s1", 0, 100))[:1] == [entry]


def _segment_file(tmp_path: Path) -> Path:
    return tmp_path / "data" / "segments" / "s1.seg"


async def test_direct_io_pads_blocks_but_never_serves_padding(
    open_fps: StoreFactory, tmp_path: Path
) -> None:
    store = await open_fps()
    await store.create_segment("s1", 0)
    if not store.direct_io("s1"):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")
    sizes = [1, 4000, 5000, 97, 12_289, 3]
    written = [
        await store.append("s1", n, 1, bytes([65 + n]) * size) for n, size in enumerate(sizes)
    ]
    assert await store.checkpoint()  # acknowledged on the WAL's fsync; now in the segment file
    logical = store.segment("s1").size_bytes
    physical = _segment_file(tmp_path).stat().st_size
    assert logical % 4096 != 0 and physical % 4096 == 0 and physical > logical
    assert await store.read("s1", 0, 1 << 20) == written
    await store.crash()
    store = await open_fps()  # the WAL is empty: the file is not even opened, its padding stays
    assert store.segment("s1").size_bytes == logical  # the recorded end, not the padded size
    assert await store.read("s1", 0, 1 << 20) == written
    written.append(
        await store.append("s1", len(sizes), 1, b"z" * 6000)
    )  # rewrites the partial block
    await store.crash()
    store = await open_fps()  # the file is cut to its recorded end, then that append restored
    assert await store.read("s1", 0, 1 << 20) == written


async def test_a_direct_write_larger_than_the_thread_buffer_goes_through_it_in_pieces(
    open_fps: StoreFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A segment write of several MiB (one hot range between checkpoints) uses the thread's
    reused buffer piece by piece: a map of its own cost a map, an unmap and a fault per page."""
    maps: list[int] = []
    real_mmap = direct_append.mmap.mmap

    def counting_mmap(fileno: int, length: int) -> mmap.mmap:
        maps.append(length)
        return real_mmap(fileno, length)

    monkeypatch.setattr(direct_append.mmap, "mmap", counting_mmap)
    store = await open_fps()
    await store.create_segment("s1", 0)
    if not store.direct_io("s1"):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")
    written = [await store.append("s1", 0, 1, b"t" * 1000)]  # leaves a partial block
    assert await store.checkpoint()
    sizes = [700_000, 1_500_001, 650_003, 5]  # over the buffer even if written one by one
    appends = [store.append("s1", 1 + n, 1, bytes([66 + n]) * size) for n, size in enumerate(sizes)]
    written += await asyncio.gather(*appends)
    assert await store.checkpoint()
    assert maps and max(maps) <= direct_append.REUSED_BUFFER_BYTES_MAX
    assert await store.read("s1", 0, 1 << 23) == written
    await store.crash()
    store = await open_fps()
    assert await store.read("s1", 0, 1 << 23) == written
    written.append(await store.append("s1", 5, 1, b"after"))  # the tail after the pieces
    assert await store.checkpoint()
    assert await store.read("s1", 0, 1 << 23) == written


async def test_refused_o_direct_falls_back_to_buffered_io(
    open_fps: StoreFactory, tmp_path: Path
) -> None:
    runtime = FaultyRuntime()
    runtime.faulty_disk.refuse_direct = True  # as tmpfs on older kernels does
    store = await open_fps(runtime)
    await store.create_segment("s1", 0)
    assert not store.direct_io("s1")
    written = [await store.append("s1", n, 1, b"q" * (100 + n)) for n in range(5)]
    assert await store.checkpoint()  # acknowledged on the WAL's fsync; now in the segment file
    assert _segment_file(tmp_path).stat().st_size == store.segment("s1").size_bytes  # no padding
    await store.crash()
    store = await open_fps(runtime)
    assert await store.read("s1", 0, 1 << 20) == written


async def test_o_direct_rejected_at_write_time_falls_back_to_buffered_io(
    open_fps: StoreFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    runtime = FaultyRuntime()
    store = await open_fps(runtime)
    await store.create_segment("s1", 0)
    if not store.direct_io("s1"):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")
    zeroth = await store.append("s1", 0, 1, b"zeroth")  # a direct WAL write: its block padded
    runtime.faulty_disk.einval_direct_writes = True  # e.g. a device with a 64 KiB logical block
    with caplog.at_level(logging.WARNING):
        first = await store.append("s1", 1, 1, b"first")  # the WAL's, over its padding
        assert await store.checkpoint()  # the segment file is written after the acknowledgement
    assert "WAL" in caplog.text and caplog.text.count("using buffered I/O") == 2
    assert not store.direct_io("s1") and not store.failed
    second = await store.append("s1", 2, 1, b"second")
    await store.crash()
    store = await open_fps(runtime)
    assert await store.read("s1", 0, 100) == [zeroth, first, second]


async def test_direct_io_can_be_turned_off(open_fps: StoreFactory) -> None:
    store = await open_fps(direct_io=False)
    await store.create_segment("s1", 0)
    assert not store.direct_io("s1")
