"""One segment's file: appends at the logical end, with O_DIRECT where the filesystem grants it.

Direct I/O wants 4 KiB-aligned buffers, offsets and lengths.  The file keeps
its partial last block (``tail``, under 4 KiB) in memory; an append writes
``tail + data`` padded with zeros to whole blocks, from an anonymous
``mmap`` (page-aligned), at the block where the tail starts, so the
acknowledged prefix of the last block is rewritten with the same bytes.  The
file's physical size is therefore a multiple of 4 KiB and may run past the
logical end by up to 4095 zero bytes; the logical end (``length``) is the
truth, is recorded in the offset index after each flush, and recovery
truncates the file back to it.  Nothing past ``length`` is ever read as data.

This relies on a 4 KiB block write being atomic under power loss (true of the
4Kn/NVMe devices we target); on a device where it is not, a torn rewrite of
the last block shows up as ``CorruptData`` on the last acknowledged entry,
never as wrong bytes.

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
import mmap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from backends.northguard.runtime import Disk, File
from backends.northguard.store.file_pool import FilePool

BLOCK_BYTES = 4096
REUSED_BUFFER_BYTES_MAX = 1 << 20
"""Direct writes go through one aligned buffer per thread, reused, of at most this size; a
larger write goes through it in pieces.  A map of its own per write cost a map, an unmap and a
page fault per page: an eighth of the store's CPU with 10 KB appends to 512 segments, and
100,000 faults per 4,000,000 records of 100 B to one range, whose writes of 1.2 MB each mapped
their own (measured)."""
_ZEROS = bytes(BLOCK_BYTES)
log = logging.getLogger(__name__)
_buffers = threading.local()


def _aligned_buffer(size: int) -> mmap.mmap:
    """This thread's page-aligned buffer, of at least ``size`` bytes (at most
    ``REUSED_BUFFER_BYTES_MAX``), kept for its next write."""
    assert size <= REUSED_BUFFER_BYTES_MAX, size
    buffer: mmap.mmap | None = getattr(_buffers, "buffer", None)
    if buffer is None or len(buffer) < size:
        grown = 1 << max(16, (size - 1).bit_length())  # powers of two from 64 KiB: few regrowths
        buffer = mmap.mmap(-1, min(grown, REUSED_BUFFER_BYTES_MAX))
        _buffers.buffer = buffer  # the smaller one goes with its last reference
    return buffer


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


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

    def append(self, data: bytes) -> int:
        """Write ``data`` at the logical end (not durable until ``fsync``); return where it starts."""
        position = self.length
        with self._pool.use(self):
            reader, writer = self._handles()
            if writer is not None:
                try:
                    self._append_direct(writer, data)
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
                    reader.pwrite(data, position)
            else:
                reader.pwrite(data, position)
        self.length = position + len(data)
        return position

    def _append_direct(self, writer: File, data: bytes) -> None:
        """``tail + data`` from the tail's block on, through the thread's buffer: in pieces of
        its size when larger, each but the last whole blocks.  The tail moves only once all
        are written (a failed piece leaves the file to be written again from the same place)."""
        tail = self._tail
        position = self.length - len(tail)
        taken = 0
        with memoryview(data) as rest:
            while True:
                piece = rest[taken : taken + REUSED_BUFFER_BYTES_MAX - len(tail)]
                taken += len(piece)
                payload_bytes = len(tail) + len(piece)
                block_bytes = _round_up(payload_bytes, BLOCK_BYTES)
                buffer = _aligned_buffer(block_bytes)
                buffer[: len(tail)] = tail
                buffer[len(tail) : payload_bytes] = piece
                piece.release()
                # past the logical end: zeros, never the bytes of an earlier write
                buffer[payload_bytes:block_bytes] = _ZEROS[: block_bytes - payload_bytes]
                with memoryview(buffer) as view, view[:block_bytes] as blocks:
                    writer.pwrite(blocks, position)
                if taken >= len(data):
                    break
                position += block_bytes  # a whole buffer: the next piece starts a block
                tail = b""
        new_tail_start = payload_bytes - payload_bytes % BLOCK_BYTES
        self._tail = buffer[new_tail_start:payload_bytes]

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
