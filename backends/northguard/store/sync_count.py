"""Every fsync a component makes, counted where it is made: the figures behind "fsyncs per flush".

A metric that is computed (``1`` per flush, ``len(segments) + 1`` per
checkpoint) says what the code meant to do; this one says what it did.
``CountingDisk`` wraps the runtime's disk: each ``File.fsync`` that returns
counts once under the kind of file it synced, and each ``rename`` (whose
contract includes an fsync of the directory) counts one ``directory`` sync.
Syncs that do not go through the disk (RocksDB's) are added by their caller
with ``SyncCount.add``.

Kinds: ``wal`` (``*.wal`` files and their ``.tmp``), ``segment`` (``*.seg``),
``directory`` (renames, and the empty marker files whose creation makes a
directory entry durable), ``filesystem`` (one ``Disk.sync_all`` for many files),
``index`` (the offset index), ``journal``.

Thread-safe: flushes, writer passes and checkpoints fsync from worker
threads at once, so the counts are kept under a lock (an fsync costs
~1 ms; the lock ~100 ns).

**Whose fsync.**  A step's own fsyncs are not the difference of the totals
across it: a checkpoint syncs segment files and their directory while a
flush appends to the WAL, so the difference across the flush held the
checkpoint's directory syncs too.  ``tally`` counts, apart, the fsyncs made
in the calling context (its thread, and the threads it hands work to with
``contextvars.copy_context``) from its start to its end: what that step made.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backends.northguard.runtime import Disk, File

KINDS = ("wal", "segment", "directory", "filesystem", "index", "journal")


@dataclass(eq=False)
class Tally:
    """The fsyncs one step made (see ``SyncCount.tally``); read ``count`` once the step is over."""

    source: SyncCount
    count: int = 0


_tallies: contextvars.ContextVar[tuple[Tally, ...]] = contextvars.ContextVar(
    "fsync_tallies", default=()
)


class SyncCount:
    """fsync calls that returned, by kind; cumulative, never reset."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(KINDS, 0)

    def add(self, kind: str, count: int = 1) -> None:
        assert kind in self._counts, kind
        tallies = _tallies.get()
        with self._lock:  # a tally may be shared by the threads a step fans out to
            self._counts[kind] += count
            for tally in tallies:
                if tally.source is self:
                    tally.count += count

    @contextlib.contextmanager
    def tally(self) -> Iterator[Tally]:
        """Count, apart, the fsyncs made in this context until the block ends: by this thread,
        and by work it hands to other threads with its context (``copy_context().run``), not by
        steps running beside it.  Steps nest: an fsync counts in every tally open around it."""
        tally = Tally(self)
        token = _tallies.set((*_tallies.get(), tally))
        try:
            yield tally
        finally:
            _tallies.reset(token)

    def get(self, *kinds: str) -> int:
        """The calls of ``kinds`` (every kind when none is named)."""
        with self._lock:
            return sum(self._counts[kind] for kind in kinds or KINDS)

    def by_kind(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


def kind_of(path: Path, default: str) -> str:
    """The kind a file's fsync counts as, from its name."""
    name = path.name.removesuffix(".tmp")
    if name.endswith(".wal"):
        return "wal"
    if name.endswith(".seg"):
        return "segment"
    return default


class CountingDisk(Disk):
    """``disk``, with every fsync of a file it opens (and every rename) counted in ``count``."""

    def __init__(self, disk: Disk, count: SyncCount, kind: str | None = None) -> None:
        """``kind``: what every sync counts as (renames included); None: by file name."""
        self._disk = disk
        self.count = count
        self._kind = kind

    def open(self, path: Path, *, create: bool = True, direct: bool = False) -> File:
        handle = self._disk.open(path, create=create, direct=direct)
        kind = self._kind or kind_of(path, "directory")
        return _CountingFile(handle, lambda: self.count.add(kind))

    def exists(self, path: Path) -> bool:
        return self._disk.exists(path)

    def remove(self, path: Path) -> None:
        self._disk.remove(path)

    def listdir(self, path: Path) -> list[str]:
        return self._disk.listdir(path)

    def makedirs(self, path: Path) -> None:
        self._disk.makedirs(path)

    def rename(self, source: Path, target: Path) -> None:
        self._disk.rename(source, target)
        self.count.add(self._kind or "directory")

    def sync_all(self, directory: Path) -> bool:
        synced = self._disk.sync_all(directory)
        if synced:
            self.count.add(self._kind or "filesystem")
        return synced


class _CountingFile(File):
    def __init__(self, handle: File, synced: Callable[[], None]) -> None:
        self._handle = handle
        self._synced = synced

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)  # ``direct``: whether O_DIRECT was granted

    def pwrite(self, data: bytes | memoryview, offset: int) -> None:
        self._handle.pwrite(data, offset)

    def pread(self, size: int, offset: int) -> bytes:
        return self._handle.pread(size, offset)

    def fsync(self) -> None:
        self._handle.fsync()
        self._synced()

    def truncate(self, size: int) -> None:
        self._handle.truncate(size)

    def size(self) -> int:
        return self._handle.size()

    def close(self) -> None:
        self._handle.close()
