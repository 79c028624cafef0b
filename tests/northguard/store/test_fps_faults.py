"""Disk faults: a failed fsync is fail-stop; O_DIRECT is used where granted and falls back cleanly."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
from store_faults import FaultyRuntime, StoreFactory

from xinfra.errors import StorageError


@pytest.mark.parametrize("failing_file", [".wal", ".seg"])
async def test_an_fsync_error_fails_the_group_and_stops_all_writes(
    open_fps: StoreFactory,
    faulty_runtime: FaultyRuntime,
    failing_file: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
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
    logical = store.segment("s1").size_bytes
    physical = _segment_file(tmp_path).stat().st_size
    assert logical % 4096 != 0 and physical % 4096 == 0 and physical > logical
    assert await store.read("s1", 0, 1 << 20) == written
    await store.crash()
    store = await open_fps()
    assert _segment_file(tmp_path).stat().st_size == logical  # recovery cut the padding off
    assert await store.read("s1", 0, 1 << 20) == written
    written.append(
        await store.append("s1", len(sizes), 1, b"z" * 6000)
    )  # rewrites the partial block
    await store.crash()
    store = await open_fps()
    assert await store.read("s1", 0, 1 << 20) == written


async def test_refused_o_direct_falls_back_to_buffered_io(
    open_fps: StoreFactory, tmp_path: Path
) -> None:
    runtime = FaultyRuntime()
    runtime.faulty_disk.refuse_direct = True  # as tmpfs on older kernels does
    store = await open_fps(runtime)
    await store.create_segment("s1", 0)
    assert not store.direct_io("s1")
    written = [await store.append("s1", n, 1, b"q" * (100 + n)) for n in range(5)]
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
    runtime.faulty_disk.einval_direct_writes = True  # e.g. a device with a 64 KiB logical block
    with caplog.at_level(logging.WARNING):
        first = await store.append("s1", 0, 1, b"first")
    assert "using buffered I/O" in caplog.text
    assert not store.direct_io("s1") and not store.failed
    second = await store.append("s1", 1, 1, b"second")
    await store.crash()
    store = await open_fps(runtime)
    assert await store.read("s1", 0, 100) == [first, second]


async def test_direct_io_can_be_turned_off(open_fps: StoreFactory) -> None:
    store = await open_fps(direct_io=False)
    await store.create_segment("s1", 0)
    assert not store.direct_io("s1")
