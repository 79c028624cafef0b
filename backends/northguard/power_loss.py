"""A disk that forgets what was never synced: the runtime seam's power-loss model, for crash tests.

A SIGKILLed broker leaves the page cache intact, so a test that kills a
process still passes when ``fsync`` does nothing.  ``PowerLossDisk`` keeps,
per file, the bytes as written (what reads see) apart from the bytes as of
its last ``fsync`` (what survives), and per directory the entries as they are
apart from the entries as of its last sync.  ``power_loss()`` is the plug
being pulled:

* a file's content becomes what it was at its last ``fsync`` (writes and
  truncations after it are lost; a file never synced is empty);
* a directory's entries become what they were at its last sync (a file
  created, renamed or removed since comes back to where it was).  A
  directory is synced by ``rename`` only, whose contract includes it
  (``Runtime.Disk.rename``); ``makedirs`` is taken as durable at once
  (directories are made at start-up, not where a missing sync would hide).

Every handle opened before the power loss raises ``OSError(EIO)`` from then
on, so a flush that was running fails instead of writing into the next
boot; the store that used them is then stopped (``FpsStore.crash``) and a
new one opened on the same disk sees only the surviving bytes.

``PowerLossIndex`` does the same for the offset index (RocksDB in
production, whose ``sync`` is the fsync): writes are visible at once, and a
power loss of its disk takes it back to its last ``sync``.

**The check's teeth.**  ``skip_fsync`` (file name suffixes) and
``skip_directory_sync`` turn those syncs into no-ops that still report
success, as a broken flush would: the same tests must then lose
acknowledged records, which shows they detect a missing fsync.

Everything lives in memory behind one lock (the store flushes and
checkpoints from worker threads); ``O_DIRECT`` is granted when asked, so
the segment files' block-aligned write path runs as in production.
"""

from __future__ import annotations

import copy
import errno
import threading
from dataclasses import dataclass, field
from pathlib import Path

from backends.northguard.runtime import Disk, File, RealRuntime
from backends.northguard.store.offset_index import (
    IndexPoint,
    MemoryOffsetIndex,
    SegmentEnd,
    _MemorySegment,
)


@dataclass(eq=False)
class _Inode:
    content: bytearray = field(default_factory=bytearray)  # as written: what reads see
    durable: bytes = b""  # as of the last fsync: what survives a power loss


class _PowerLossFile(File):
    def __init__(self, disk: PowerLossDisk, path: Path, inode: _Inode, direct: bool) -> None:
        self._disk = disk
        self._path = path
        self._inode = inode
        self._boot = disk.boots
        self._closed = False
        self.direct = direct  # ``SegmentFile`` asks whether O_DIRECT was granted

    def _check(self) -> None:
        """Raise for a closed handle or one that was open when the power went."""
        if self._closed:
            raise OSError(errno.EBADF, f"{self._path}: closed")
        if self._boot != self._disk.boots:
            raise OSError(errno.EIO, f"{self._path}: the disk lost power")

    def pwrite(self, data: bytes | memoryview, offset: int) -> None:
        chunk = bytes(data)
        with self._disk.lock:
            self._check()
            content = self._inode.content
            if len(content) < offset:
                content.extend(bytes(offset - len(content)))
            content[offset : offset + len(chunk)] = chunk

    def pread(self, size: int, offset: int) -> bytes:
        with self._disk.lock:
            self._check()
            return bytes(self._inode.content[offset : offset + size])

    def fsync(self) -> None:
        with self._disk.lock:
            self._check()
            if self._path.name.endswith(self._disk.skip_fsync):
                self._disk.fsyncs_skipped += 1
                return
            self._inode.durable = bytes(self._inode.content)
            self._disk.fsyncs += 1

    def truncate(self, size: int) -> None:
        with self._disk.lock:
            self._check()
            content = self._inode.content
            if size < len(content):
                del content[size:]
            else:
                content.extend(bytes(size - len(content)))

    def size(self) -> int:
        with self._disk.lock:
            self._check()
            return len(self._inode.content)

    def close(self) -> None:
        self._closed = True


class PowerLossDisk(Disk):
    """An in-memory ``Disk`` whose ``power_loss`` keeps only what was synced; see the module docstring."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.boots = 0  # power losses so far: handles of an earlier boot refuse every call
        self.skip_fsync: tuple[str, ...] = ()  # file name suffixes whose fsync does nothing
        self.skip_directory_sync = False  # ``rename`` does not sync the directory
        self.fsyncs = 0
        self.sync_alls = 0  # ``sync_all`` calls: many files synced in one
        self.fsyncs_skipped = 0
        self.directory_syncs = 0
        self._names: dict[Path, _Inode] = {}  # the entries as they are
        self._durable_names: dict[Path, _Inode] = {}  # the entries as of each directory's last sync
        self._directories: set[Path] = set()
        self._indexes: list[PowerLossIndex] = []

    def open(self, path: Path, *, create: bool = True, direct: bool = False) -> File:
        with self.lock:
            inode = self._names.get(path)
            if inode is None:
                if not create or path.parent not in self._directories:
                    raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(path))
                inode = self._names[path] = _Inode()  # the entry is not durable until a dir sync
            return _PowerLossFile(self, path, inode, direct)

    def exists(self, path: Path) -> bool:
        with self.lock:
            return path in self._names or path in self._directories

    def remove(self, path: Path) -> None:
        with self.lock:
            self._names.pop(path, None)

    def listdir(self, path: Path) -> list[str]:
        with self.lock:
            files = [name.name for name in self._names if name.parent == path]
            directories = [name.name for name in self._directories if name.parent == path]
            return sorted(files + directories)

    def makedirs(self, path: Path) -> None:
        with self.lock:
            self._directories.update([path, *path.parents])

    def rename(self, source: Path, target: Path) -> None:
        with self.lock:
            inode = self._names.pop(source, None)
            if inode is None:
                raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(source))
            self._names[target] = inode
            for directory in dict.fromkeys([source.parent, target.parent]):
                self.sync_directory(directory)

    def sync_all(self, directory: Path) -> bool:
        """Every file under ``directory`` as if fsynced (``skip_fsync`` files too do nothing)."""
        with self.lock:
            for path, inode in self._names.items():
                if directory in path.parents and not path.name.endswith(self.skip_fsync):
                    inode.durable = bytes(inode.content)
            self.sync_alls += 1
        return True

    def sync_directory(self, directory: Path) -> None:
        """Make the entries of ``directory`` durable as they are now (created, renamed, removed)."""
        with self.lock:
            if self.skip_directory_sync:
                self.fsyncs_skipped += 1
                return
            self._durable_names = {
                p: i for p, i in self._durable_names.items() if p.parent != directory
            }
            self._durable_names.update(
                {p: i for p, i in self._names.items() if p.parent == directory}
            )
            self.directory_syncs += 1

    def index(self) -> PowerLossIndex:
        """An offset index that this disk's power losses take back to its last ``sync``."""
        index = PowerLossIndex(self)
        with self.lock:
            self._indexes.append(index)
        return index

    def power_loss(self) -> None:
        """Pull the plug: keep only synced bytes and entries; every open handle fails from now on."""
        with self.lock:
            self.boots += 1
            self._names = dict(self._durable_names)
            for inode in self._names.values():
                inode.content = bytearray(inode.durable)
            for index in self._indexes:
                index.lose_unsynced()


class PowerLossIndex(MemoryOffsetIndex):
    """``MemoryOffsetIndex`` whose ``sync`` is what survives its disk's power loss.

    Writes made after a power loss by the store that was running (its worker
    threads may still be finishing a step) raise ``OSError``, like its files.
    """

    def __init__(self, disk: PowerLossDisk) -> None:
        super().__init__()
        self._disk = disk
        self._boot = disk.boots
        self._synced: tuple[dict[str, _MemorySegment], dict[str, bytes]] = ({}, {})
        self.syncs = 0

    def _check(self) -> None:
        if self._boot != self._disk.boots:
            raise OSError(errno.EIO, "offset index: the disk lost power")

    def reopened(self) -> PowerLossIndex:
        """This index as the next boot's store sees it (handles of the earlier boot refuse writes)."""
        with self._disk.lock:
            self._boot = self._disk.boots
        return self

    def write(self, points: list[IndexPoint], ends: dict[str, SegmentEnd]) -> None:
        with self._disk.lock:
            self._check()
            super().write(points, ends)

    def put_metas(self, metas: dict[str, bytes]) -> None:
        with self._disk.lock:
            self._check()
            super().put_metas(metas)

    def truncate(self, segment_id: str, end: SegmentEnd) -> None:
        with self._disk.lock:
            self._check()
            super().truncate(segment_id, end)

    def delete_segment(self, segment_id: str) -> None:
        with self._disk.lock:
            self._check()
            super().delete_segment(segment_id)

    def sync(self) -> None:
        with self._disk.lock:
            self._check()
            if "index" in self._disk.skip_fsync:
                self._disk.fsyncs_skipped += 1
                return
            self._synced = (copy.deepcopy(self._segments), dict(self._metas))
            self.syncs += 1

    def lose_unsynced(self) -> None:
        """Go back to the last ``sync`` (called by the disk's ``power_loss``, under its lock)."""
        segments, metas = self._synced
        self._segments = copy.deepcopy(segments)
        self._metas = dict(metas)


class PowerLossRuntime(RealRuntime):
    """The real clock, loop and network with a ``PowerLossDisk``: a store under test runs as in
    production (worker threads, group commit timers) on a disk that can lose power."""

    disk: PowerLossDisk

    def __init__(self, seed: int | None = 1) -> None:
        super().__init__(seed)
        self.disk = PowerLossDisk()
