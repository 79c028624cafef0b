"""One segment's file: appends at the logical end, with O_DIRECT where the filesystem grants it.

Direct appends keep the file's partial last block in memory and rewrite it
with each append (``direct_append``), so the file's physical size may run
past the logical end by up to 4095 zero bytes; the logical end (``length``)
is the truth, is recorded in the offset index after each flush, and recovery
truncates the file back to it.  Nothing past ``length`` is ever read as data.

Reads go through a second, buffered handle: ``File.pread`` returns ``bytes``,
whose buffer is not aligned, so it cannot read an O_DIRECT descriptor.  Linux
keeps the two handles coherent (a direct write invalidates the cached pages it
covers).  A ``pread_into(aligned_buffer, offset)`` on the runtime's ``File``
would let reads bypass the page cache too.

Where O_DIRECT is refused, at open (tmpfs on older kernels, some network
filesystems) or by ``EINVAL`` on the first aligned write (a device with a
larger logical block), the file falls back to buffered writes on the read
handle and says so in ``direct``; nothing else changes.

Descriptors come from a ``FilePool``: the file opens its handles when an
operation needs them and the pool closes them when the file has been idle
longest, so a broker with tens of thousands of segments holds a bounded
number open.  The tail is reloaded from disk at each open (the bytes before
``length`` are on disk or in the page cache: a close loses nothing).

The file itself is made by its first open (``O_CREAT``): a new segment has
none until it is first written, so creating thousands of segments creates no
inode on the way (on ext4 an inode allocation costs 0.1-1.5 ms of CPU, more
where many were deleted lately).  ``on_disk`` says whether the file's
directory entry is known to be durable; the store syncs the directory before
it records an end for a file that is not (see ``fps``).  The opens that make
a file are counted and timed (``FileCreations``): a first write to 512 new
ranges makes 512 files, and that kernel time is otherwise invisible.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from backends.northguard.runtime import Disk, File
from backends.northguard.store.direct_append import BLOCK_BYTES, append_direct
from backends.northguard.store.file_pool import FilePool

log = logging.getLogger(__name__)


class FileCreations:
    """Segment files made by an open (``O_CREAT`` of a file not there yet) and the seconds those
    opens took; cumulative.

    On ext4 without a journal an inode allocation costs 0.02-0.9 ms of kernel
    CPU (its scan of recently deleted inodes), paid by the thread that opens
    the file, under the pool's lock.  Thread-safe: files are opened by a
    writer pass's threads side by side.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        """``clock``: seconds, monotonic (the runtime's, so a simulation times in its own)."""
        self._clock = clock
        self._lock = threading.Lock()
        self.files = 0
        self.seconds = 0.0

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        """Count the block as one file made, and its time, if it returns (a failed open made none)."""
        started_s = self._clock()
        yield
        elapsed_s = self._clock() - started_s
        with self._lock:
            self.files += 1
            self.seconds += elapsed_s


class SegmentFile:
    """Not thread-safe for writes: the store's flush lock serialises ``append``, ``truncate``, ``fsync``.

    ``length`` is the logical end the store knows to be good (from its index at
    recovery); the file is opened lazily, through ``pool``.
    """

    def __init__(
        self,
        disk: Disk,
        path: Path | tuple[Path, str],
        *,
        direct: bool,
        pool: FilePool | None = None,
        length: int = 0,
        on_disk: bool = True,
        exists: bool | None = None,
        creations: FileCreations | None = None,
    ) -> None:
        """``path`` may be ``(directory, name)``: joined on first use (a restart makes thousands).
        ``on_disk``: whether the file exists with a durable directory entry (False: a new segment,
        whose first open creates it).  ``exists``: whether the file is there at all (None: as
        ``on_disk``); the open that makes one that is not is counted in ``creations``."""
        self._path = path
        self._disk = disk
        self._pool = pool or FilePool(1 << 20)
        self._want_direct = direct
        self._reader: File | None = None
        self._writer: File | None = None
        self.pins = 0  # uses in progress (the pool never closes a pinned file)
        self.length = length  # logical end; every byte before it is a frame
        self._tail = b""  # bytes [length - length % BLOCK, length), only with direct I/O
        self.on_disk = on_disk  # set by the store once it has synced the directory
        self._exists = on_disk if exists is None else exists
        self._creations = creations or FileCreations()

    @property
    def path(self) -> Path:
        if isinstance(self._path, tuple):
            directory, name = self._path
            self._path = directory / name
        return self._path

    # -- the pool's side -------------------------------------------------------------------------

    @property
    def is_open(self) -> bool:
        return self._reader is not None

    def open_handles(self) -> int:
        """Open the buffered reader and, where granted, the direct writer; load the tail."""
        reader = self._open_reader()
        opened = 1
        writer: File | None = None
        try:
            if self._want_direct:
                writer = self._disk.open(self.path, direct=True)
                if getattr(writer, "direct", False):  # File reports whether O_DIRECT was granted
                    opened = 2
                else:
                    writer.close()
                    writer = None
                    self._want_direct = False  # refused here: never ask again for this file
            size = reader.size() if self.length else 0  # nothing recorded: nothing to check
            if size < self.length:
                log.error(
                    "segment file %s holds %d bytes but %d were recorded as durable: the tail is "
                    "lost and reads of it will raise CorruptData",
                    self.path, size, self.length,
                )  # fmt: skip
                reader.truncate(self.length)
            self._reader, self._writer = reader, writer
            self._load_tail()
        except BaseException:
            self._reader = self._writer = None
            if writer is not None:
                writer.close()
            reader.close()
            raise
        return opened

    def _open_reader(self) -> File:
        """The buffered handle; the open that makes the file (its first) is timed and counted."""
        if self._exists:
            return self._disk.open(self.path)
        with self._creations.timed():
            reader = self._disk.open(self.path)
        self._exists = True
        return reader

    def close_handles(self) -> int:
        """Close every handle (errors only logged: the pool closes idle files); return how many."""
        closed = 0
        for handle in (self._writer, self._reader):
            if handle is None:
                continue
            closed += 1
            try:
                handle.close()
            except OSError as error:
                log.warning("closing %s: %s", self.path, error)
        self._reader = self._writer = None
        return closed

    def _handles(self) -> tuple[File, File | None]:
        assert self._reader is not None, "segment file used outside its pool"
        return self._reader, self._writer

    # -- operations --------------------------------------------------------------------------------

    @property
    def direct(self) -> bool:
        """Whether appends use O_DIRECT (opens the file to find out when never opened)."""
        if self._want_direct and not self.is_open:
            with self._pool.use(self):
                pass
        return self._want_direct and (self._writer is not None or not self.is_open)

    def recover(self, length: int) -> int:
        """Cut the file to the logical ``length`` recorded as durable; return its size before."""
        with self._pool.use(self):
            reader, _ = self._handles()
            size_before = reader.size()
            reader.truncate(length)
            self.length = length
            self._load_tail()
        return size_before

    def truncate(self, length: int) -> None:
        assert 0 <= length <= self.length, (length, self.length)
        with self._pool.use(self):
            reader, _ = self._handles()
            reader.truncate(length)
            self.length = length
            self._load_tail()

    def _load_tail(self) -> None:
        reader, writer = self._handles()
        if writer is None:
            self._tail = b""
            return
        block_start = self.length - self.length % BLOCK_BYTES
        if block_start == self.length:  # ends on a block boundary (a new file): no partial block
            self._tail = b""
            return
        self._tail = reader.pread(self.length - block_start, block_start)
        if len(self._tail) != self.length - block_start:
            raise OSError(errno.EIO, f"{self.path}: short read of the last block")

    def append(self, parts: Sequence[bytes | memoryview]) -> int:
        """Write ``parts``, in order, at the logical end (not durable until ``fsync``); return where
        they start."""
        position = self.length
        with self._pool.use(self):
            reader, writer = self._handles()
            if writer is not None:
                try:
                    self._tail = append_direct(writer, self._tail, position, parts)
                except OSError as error:
                    if error.errno != errno.EINVAL:
                        raise
                    log.warning(
                        "%s: O_DIRECT write refused (%s); using buffered I/O", self.path, error
                    )
                    writer.close()
                    self._writer = None
                    self._want_direct = False
                    self._pool.descriptors_released(1)
                    self._tail = b""
                    reader.pwrite(b"".join(parts), position)
            else:
                reader.pwrite(b"".join(parts), position)
        self.length = position + sum(len(part) for part in parts)
        return position

    def read(self, position: int, size: int) -> bytes:
        """Up to ``size`` bytes at ``position``, never past the logical end the caller passes in."""
        with self._pool.use(self):
            reader, _ = self._handles()
            return reader.pread(size, position)

    def fsync(self) -> None:
        """Make every byte written so far durable (through a fresh descriptor if it was closed)."""
        with self._pool.use(self):
            reader, writer = self._handles()
            (writer or reader).fsync()

    def physical_size(self) -> int:
        with self._pool.use(self):
            reader, _ = self._handles()
            return reader.size()

    def close(self) -> None:
        self._pool.forget(self)
