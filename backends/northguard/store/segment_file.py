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
"""

from __future__ import annotations

import errno
import logging
import mmap
from pathlib import Path

from backends.northguard.runtime import Disk, File

BLOCK_BYTES = 4096
log = logging.getLogger(__name__)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class SegmentFile:
    """Not thread-safe for writes: the store's flush lock serialises ``append``, ``truncate``, ``fsync``."""

    def __init__(self, disk: Disk, path: Path, *, direct: bool) -> None:
        self.path = path
        self._reader: File = disk.open(path)
        self._writer: File | None = None
        self._disk = disk
        if direct:
            writer = disk.open(path, direct=True)
            if getattr(writer, "direct", False):  # File reports whether O_DIRECT was granted
                self._writer = writer
            else:
                writer.close()
        self.length = 0  # logical end; every byte before it is a frame
        self._tail = b""  # bytes [length - length % BLOCK, length), only with direct I/O

    @property
    def direct(self) -> bool:
        return self._writer is not None

    def recover(self, length: int) -> int:
        """Cut the file to the logical ``length`` recorded as durable; return its size before."""
        size_before = self._reader.size()
        self._reader.truncate(length)
        self.length = length
        self._load_tail()
        return size_before

    def truncate(self, length: int) -> None:
        assert 0 <= length <= self.length, (length, self.length)
        self._reader.truncate(length)
        self.length = length
        self._load_tail()

    def _load_tail(self) -> None:
        if self._writer is None:
            self._tail = b""
            return
        block_start = self.length - self.length % BLOCK_BYTES
        self._tail = self._reader.pread(self.length - block_start, block_start)
        if len(self._tail) != self.length - block_start:
            raise OSError(errno.EIO, f"{self.path}: short read of the last block")

    def append(self, data: bytes) -> int:
        """Write ``data`` at the logical end (not durable until ``fsync``); return where it starts."""
        position = self.length
        if self._writer is not None:
            try:
                self._append_direct(data)
            except OSError as error:
                if error.errno != errno.EINVAL:
                    raise
                log.warning("%s: O_DIRECT write refused (%s); using buffered I/O", self.path, error)
                self._writer.close()
                self._writer = None
                self._tail = b""
                self._reader.pwrite(data, position)
        else:
            self._reader.pwrite(data, position)
        self.length = position + len(data)
        return position

    def _append_direct(self, data: bytes) -> None:
        assert self._writer is not None
        block_start = self.length - len(self._tail)
        payload_bytes = len(self._tail) + len(data)
        buffer = mmap.mmap(-1, _round_up(payload_bytes, BLOCK_BYTES))  # page-aligned, zero-filled
        try:
            buffer[: len(self._tail)] = self._tail
            buffer[len(self._tail) : payload_bytes] = data
            with memoryview(buffer) as view:
                self._writer.pwrite(view, block_start)
            new_tail_start = payload_bytes - payload_bytes % BLOCK_BYTES
            self._tail = buffer[new_tail_start:payload_bytes]
        finally:
            buffer.close()

    def read(self, position: int, size: int) -> bytes:
        """Up to ``size`` bytes at ``position``, never past the logical end the caller passes in."""
        return self._reader.pread(size, position)

    def fsync(self) -> None:
        (self._writer or self._reader).fsync()

    def physical_size(self) -> int:
        return self._reader.size()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self._reader.close()
