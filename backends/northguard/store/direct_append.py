"""Appending at a file's logical end through O_DIRECT: the segment files' and the WAL's writes.

Direct I/O wants 4 KiB-aligned buffers, offsets and lengths.  The writer
keeps its file's partial last block (``tail``, under 4 KiB) in memory; an
append copies ``tail`` and then the parts it is given into this thread's
page-aligned buffer (an anonymous ``mmap``), pads the last block with zeros
and writes whole blocks from the block where the tail starts, so the
acknowledged prefix of the last block is rewritten with the same bytes.  The
file's physical size is therefore a multiple of 4 KiB and may run past the
logical end by up to 4095 zero bytes.

The parts are copied straight into the buffer, never joined first: the copy
into the buffer is the only one an append makes (a buffered write's copy
into the page cache was the WAL's largest cost with 10 KB appends to 512
ranges, and a join before it one more pass over every byte).

This relies on a 4 KiB block write being atomic under power loss (true of the
4Kn/NVMe devices we target); on a device where it is not, a torn rewrite of
the last block shows up as a failed CRC on the last acknowledged frame, never
as wrong bytes.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Sequence

from backends.northguard.runtime import File

BLOCK_BYTES = 4096
REUSED_BUFFER_BYTES_MAX = 1 << 20
"""Direct writes go through one aligned buffer per thread, reused, of at most this size; a
larger write goes through it in pieces.  A map of its own per write cost a map, an unmap and a
page fault per page: an eighth of the store's CPU with 10 KB appends to 512 segments, and
100,000 faults per 4,000,000 records of 100 B to one range, whose writes of 1.2 MB each mapped
their own (measured)."""
_ZEROS = bytes(BLOCK_BYTES)
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


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def append_direct(
    writer: File, tail: bytes, end: int, parts: Sequence[bytes | memoryview]
) -> bytes:
    """Write ``tail`` and then ``parts`` from the block where ``tail`` starts (``end - len(tail)``,
    ``end`` the logical end before the append); return the new tail.

    A buffer-full goes out as whole blocks, the rest padded with zeros to the
    next block.  The caller keeps its tail until this returns: a failed write
    leaves the file to be written again from the same place."""
    total = len(tail) + sum(len(part) for part in parts)
    buffer = _aligned_buffer(min(round_up(total, BLOCK_BYTES), REUSED_BUFFER_BYTES_MAX))
    capacity = len(buffer)  # a power of two, so whole blocks
    position = end - len(tail)
    filled = len(tail)
    buffer[:filled] = tail
    for part in parts:
        with memoryview(part) as view:
            taken = 0
            while taken < len(view):
                size = min(capacity - filled, len(view) - taken)
                buffer[filled : filled + size] = view[taken : taken + size]
                filled += size
                taken += size
                if filled == capacity:
                    with memoryview(buffer) as blocks:
                        writer.pwrite(blocks, position)
                    position += capacity
                    filled = 0
    if not filled:
        return b""
    block_bytes = round_up(filled, BLOCK_BYTES)
    # past the logical end: zeros, never the bytes of an earlier write
    buffer[filled:block_bytes] = _ZEROS[: block_bytes - filled]
    with memoryview(buffer) as view, view[:block_bytes] as blocks:
        writer.pwrite(blocks, position)
    return buffer[filled - filled % BLOCK_BYTES : filled]
