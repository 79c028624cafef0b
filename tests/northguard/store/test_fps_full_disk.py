"""A full disk: the store reports ENOSPC with its errno text (never ``BufferError``), on real tmpfs."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from backends.northguard.runtime import OsDisk, RealRuntime
from backends.northguard.store import FpsStore
from backends.northguard.store.segment_file import SegmentFile
from xinfra.errors import StorageError


def test_a_segment_file_on_a_full_disk_raises_enospc(small_disk: Path) -> None:
    file = SegmentFile(OsDisk(), small_disk / "s1.seg", direct=True)
    try:
        with pytest.raises(OSError) as caught:  # a BufferError here would escape this block
            for _ in range(100):  # 10 MB into a 2 MiB tmpfs
                file.append([b"x" * 100_000])
        assert caught.value.errno == errno.ENOSPC, caught.value
        assert file.length < 100 * 100_000
    finally:
        file.close()


async def test_a_store_on_a_full_disk_fails_with_the_errno_text(small_disk: Path) -> None:
    store = FpsStore(RealRuntime(seed=1), small_disk / "data", group_commit_ms=1.0)
    await store.open()
    try:
        await store.create_segment("s1", 0)
        with pytest.raises(StorageError) as caught:
            for offset in range(100):
                await store.append("s1", offset, 1, b"y" * 100_000)
        assert "No space left on device" in caught.value.message, caught.value
        assert "exported pointers" not in caught.value.message
        assert store.failed
    finally:
        await store.close()


async def test_a_failed_store_reopens_in_place_once_space_returns(small_disk: Path) -> None:
    store = FpsStore(RealRuntime(seed=1), small_disk / "data", group_commit_ms=1.0)
    await store.open()
    try:
        await store.create_segment("s1", 0)
        acked = [await store.append("s1", 0, 1, b"kept")]
        ballast = small_disk / "ballast"
        with ballast.open("wb") as handle, pytest.raises(OSError):
            while True:  # take every free byte
                handle.write(b"\0" * 65536)
                handle.flush()
        with pytest.raises(StorageError) as caught:
            for offset in range(1, 100):
                acked.append(await store.append("s1", offset, 1, b"z" * 100_000))
        assert "No space left on device" in caught.value.message
        with pytest.raises(StorageError):  # still full: the reopen fails, writes stay refused
            await store.reopen()
        assert store.failure is not None
        ballast.unlink()
        await store.reopen()
        assert store.failure is None
        entries = await store.read("s1", 0, 1 << 20)
        assert entries[: len(acked)] == acked  # every acknowledged entry survived
        end = store.segment("s1").end_offset
        await store.append("s1", end, 1, b"after reopen")
    finally:
        await store.close()
