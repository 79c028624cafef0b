"""A store's directories are made apart from their neighbours on disk (``OsDisk.makedirs``).

On an ext4 without a journal a new file's inode allocation skips every inode
freed lately in its directory's group; a data directory made where another
was deleted minutes before paid up to ~1.8 ms per segment file.  Each
directory the disk makes is flagged ``FS_TOPDIR_FL`` (what it makes inside is
spread over the groups) and renamed into place from a unique name (the spread
starts from the name's hash).  Real directories on the test's filesystem;
where it has no such flag (tmpfs), only the layout is checked.
"""

from __future__ import annotations

import fcntl
import os
import struct
from pathlib import Path

from store_faults import StoreFactory

from backends.northguard.runtime import OsDisk

_FS_IOC_GETFLAGS, _FS_TOPDIR_FL = 0x80086601, 0x00020000


def _flags(path: Path) -> int | None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return int(struct.unpack("i", fcntl.ioctl(fd, _FS_IOC_GETFLAGS, struct.pack("i", 0)))[0])
    except OSError:
        return None  # no inode flags here
    finally:
        os.close(fd)


def _supports_topdir(tmp_path: Path) -> bool:
    probe = tmp_path / "probe"
    probe.mkdir()
    try:
        flags = _flags(probe)
        if flags is None:
            return False
        fd = os.open(probe, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.ioctl(fd, 0x40086602, struct.pack("i", flags | _FS_TOPDIR_FL))
        except OSError:
            return False
        finally:
            os.close(fd)
        return bool((_flags(probe) or 0) & _FS_TOPDIR_FL)
    finally:
        probe.rmdir()


def test_made_directories_are_flagged_and_renamed_into_place(tmp_path: Path) -> None:
    target = tmp_path / "data" / "segments"
    OsDisk().makedirs(target)
    OsDisk().makedirs(target)  # there already: nothing made, nothing left behind
    assert sorted(os.listdir(tmp_path)) == ["data"]
    assert sorted(os.listdir(tmp_path / "data")) == ["segments"]  # no temporary name left
    if _supports_topdir(tmp_path):
        for made in (tmp_path / "data", target):
            assert (_flags(made) or 0) & _FS_TOPDIR_FL, made
    assert not (_flags(tmp_path) or 0) & _FS_TOPDIR_FL  # a directory it did not make: untouched


async def test_a_store_makes_its_directories_apart(open_fps: StoreFactory, tmp_path: Path) -> None:
    store = await open_fps()
    data_dir = store.data_dir
    assert {"index", "segments", "wal"} <= set(os.listdir(data_dir))
    assert not [name for name in os.listdir(data_dir) if name.startswith(".")]
    if _supports_topdir(tmp_path):
        assert (_flags(data_dir) or 0) & _FS_TOPDIR_FL
        assert (_flags(data_dir / "segments") or 0) & _FS_TOPDIR_FL
