"""A bounded pool of open segment files: descriptors opened on demand, the least recently used closed.

A broker holds one file per segment replica, sealed ones included, and a
topic of thousands of ranges reaches tens of thousands of segments after a
few restarts.  Keeping every file open would exhaust the process's
``RLIMIT_NOFILE`` (2 descriptors per segment with O_DIRECT), and a failed
``open`` used to stop the whole store.  Here a file is opened when an
operation needs it (``use``), stays open while the pool has room (the next
read of a tailing consumer or the next append finds it open), and the least
recently used idle one is closed when the pool is over ``descriptors_max``.
A file in use (``pins > 0``: a flush writing it, a reader thread, an fsync)
is never closed; the pool may then run over its bound by the files in use,
which the thread pools keep small.

Running out anyway (the bound is too close to the process limit, or sockets
took the rest) raises ``NoDescriptor`` for that one operation: the store
fails that read, append or seal with a clear error and keeps serving the
others (see ``fps``).  Closing a written file loses nothing: its dirty pages
stay in the page cache and the next ``fsync`` of the inode, through any
descriptor, makes them durable.

Thread-safe: flushes, reads and fsyncs use it from worker threads.
"""

from __future__ import annotations

import contextlib
import errno
import resource
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Protocol

DESCRIPTORS_PER_FILE_MAX = 2
"""A segment file written with O_DIRECT holds a direct writer and a buffered reader."""
DEFAULT_DESCRIPTORS_MAX = 4096
"""The pool's bound when not set: this, or a quarter of the process limit when that is lower."""
LIMIT_SHARE_MAX = 0.5
"""A bound set explicitly may take at most this share of ``RLIMIT_NOFILE``: sockets, the index,
the WAL and the interpreter need the rest."""
DESCRIPTORS_MIN = 8


class NoDescriptor(OSError):
    """No file descriptor was left to open a segment file: one operation fails, not the store."""


class PooledFile(Protocol):
    pins: int

    def open_handles(self) -> int:
        """Open the file's descriptors; return how many were opened."""

    def close_handles(self) -> int:
        """Close them; return how many were closed."""

    @property
    def is_open(self) -> bool: ...


def process_descriptor_limit() -> int:
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def check_descriptors_max(descriptors_max: int | None, limit: int | None = None) -> int:
    """The pool's bound: ``descriptors_max`` checked against ``RLIMIT_NOFILE``, or a default under it.

    Raises ``ValueError`` (a clear message, at start) when the bound asked for
    is not well under the process limit: a broker that would run out of
    descriptors later is refused before it serves.
    """
    limit = process_descriptor_limit() if limit is None else limit
    if descriptors_max is None or descriptors_max <= 0:
        return max(DESCRIPTORS_MIN, min(DEFAULT_DESCRIPTORS_MAX, limit // 4))
    if descriptors_max < DESCRIPTORS_MIN:
        raise ValueError(
            f"the segment file pool needs at least {DESCRIPTORS_MIN} descriptors, "
            f"not {descriptors_max}"
        )
    if descriptors_max > limit * LIMIT_SHARE_MAX:
        raise ValueError(
            f"segment file pool bound {descriptors_max} is not well under the process's open-file "
            f"limit (RLIMIT_NOFILE {limit}): set it to at most {int(limit * LIMIT_SHARE_MAX)} "
            "or raise the limit (ulimit -n)"
        )
    return descriptors_max


class FilePool:
    def __init__(self, descriptors_max: int) -> None:
        assert descriptors_max > 0
        self.descriptors_max = descriptors_max
        self.descriptors = 0  # open right now, by the files of this pool
        self.opens = 0
        self.closes = 0
        self.refusals = 0  # opens that failed for want of a descriptor
        self._lock = threading.Lock()
        self._open: OrderedDict[PooledFile, None] = OrderedDict()  # least recently used first

    @contextlib.contextmanager
    def use(self, file: PooledFile) -> Iterator[None]:
        """Open ``file`` if needed and keep it open (pinned) for the block."""
        with self._lock:
            if file.is_open:
                self._open.move_to_end(file)
            else:
                self._open_locked(file)
            file.pins += 1
        try:
            yield
        finally:
            with self._lock:
                file.pins -= 1
                if self.descriptors > self.descriptors_max:
                    self._evict_locked(0)

    def _open_locked(self, file: PooledFile) -> None:
        self._evict_locked(DESCRIPTORS_PER_FILE_MAX)
        for attempt in range(2):
            try:
                opened = file.open_handles()
            except OSError as error:
                if error.errno not in (errno.EMFILE, errno.ENFILE):
                    raise
                if attempt == 0 and self._open:  # make room by half the pool, then once more
                    self._evict_locked(DESCRIPTORS_PER_FILE_MAX, keep=len(self._open) // 2)
                    continue
                self.refusals += 1
                raise NoDescriptor(
                    error.errno,
                    f"no file descriptor left to open a segment file ({error.strerror}; "
                    f"{self.descriptors} held by the segment file pool, bound {self.descriptors_max}, "
                    f"process limit {process_descriptor_limit()}); this operation failed, retry it",
                ) from error
            self.descriptors += opened
            self.opens += 1
            self._open[file] = None
            return

    def _evict_locked(self, room: int, keep: int | None = None) -> None:
        """Close idle files, oldest first, until ``room`` more fit (or only ``keep`` files stay open)."""
        if self.descriptors + room <= self.descriptors_max and keep is None:
            return
        pinned: list[PooledFile] = []  # met at the front: put back there, in order
        while self._open:
            if keep is None and self.descriptors + room <= self.descriptors_max:
                break
            if keep is not None and len(self._open) + len(pinned) <= keep:
                break
            candidate, _ = self._open.popitem(last=False)  # O(1): no copy of the whole pool
            if candidate.pins:
                pinned.append(candidate)
                continue
            self.descriptors -= candidate.close_handles()
            self.closes += 1
        for file in reversed(pinned):
            self._open[file] = None
            self._open.move_to_end(file, last=False)

    def descriptors_released(self, count: int) -> None:
        """A file closed ``count`` of its handles by itself (an O_DIRECT write refused)."""
        with self._lock:
            self.descriptors -= count

    def forget(self, file: PooledFile) -> None:
        """Close ``file`` now (it is being deleted); the caller guarantees nobody uses it."""
        with self._lock:
            if file in self._open:
                del self._open[file]
                self.descriptors -= file.close_handles()
                self.closes += 1

    def close_all(self) -> None:
        with self._lock:
            for file in list(self._open):
                self.descriptors -= file.close_handles()
            self._open.clear()

    def open_files(self) -> int:
        return len(self._open)
