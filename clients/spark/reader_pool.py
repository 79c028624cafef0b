"""Backends and shard readers kept open between the slices one Spark Python worker reads.

Spark reuses a Python worker for task after task (``spark.python.worker.reuse``,
on by default), and a plan has a task per slice.  Opening what a slice reads
through costs more than a small slice does: the backend (entry-point lookup;
Kafka's admin handle), the reader (a librdkafka consumer with its threads,
connection, metadata and first fetch; a Northguard admin connection and
topic view).  So a worker keeps them, like the consumer pool of Spark's own
Kafka source: the next slice of the same physical topic re-assigns an idle
reader instead of opening one.

Measured in process, 10-record slices, CPU a slice: Kafka (tansu) 30 ms
opened, 12 re-assigned; Northguard 12 and 9.  In Spark (local[2], 400k
records over 8 slices) the Python workers' CPU went from 1.4-1.75 to
1.25-1.4 us a record.  Waiting is not always shorter: a re-assigned
librdkafka consumer may first wait out the long-poll fetch it had in flight
for the last slice (``fetch.wait.max.ms``, 100 ms), about what opening a
new consumer waits (35 to 60 ms here).

Bounds.  ``IDLE_READERS_MAX`` idle readers and ``BACKENDS_MAX`` backends a
worker, least recently used closed first; a reader idle longer than
``IDLE_S_MAX`` is closed instead of reused, so what it knows of the topic
(partition count, range leaders) is never older than that at a slice's
start.  Between tasks nothing runs them: an idle reader has no assignment
and fetches nothing, and the worker's own lifetime (Spark stops idle Python
workers) bounds how long its connections stay open.

One slice at a time: a lease holds the pool until it is released, and a read
that finds the pool held (a second reader on another thread, or two slices
interleaved in one thread) opens and closes its own, as if there were no pool.
A slice that fails or is abandoned closes its reader rather than return it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from clients.spark.plan import Slice
from xinfra.backend import Backend, ShardReader, open_backend
from xinfra.model import PhysicalCluster

IDLE_READERS_MAX = 8
"""Idle readers a worker keeps (one per physical topic); the least recently used is closed."""
BACKENDS_MAX = 4
"""Backends (physical clusters) a worker keeps; closing one closes its readers."""
IDLE_S_MAX = 30.0
"""A reader idle longer than this is closed, not reused."""

T = TypeVar("T")
ReaderKey = tuple[str, str]
"""(cluster as JSON, physical topic)."""


class Lease:
    """A reader for one slice, on the event loop it must run on; ``release`` it once."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        reader: ShardReader,
        on_release: Callable[[Lease, bool], None],
    ) -> None:
        self.loop = loop
        self.reader = reader
        self._on_release = on_release
        self._released = False

    def release(self, reusable: bool) -> None:
        """``reusable``: the slice was read to its end without an error."""
        assert not self._released, "a lease is released once"
        self._released = True
        self._on_release(self, reusable)


def private_lease(piece: Slice) -> Lease:
    """A loop, backend and reader of the slice's own, all closed at release."""
    loop = asyncio.new_event_loop()
    try:
        backend = open_backend(PhysicalCluster.model_validate_json(piece.cluster))
        try:
            reader = loop.run_until_complete(_reader(backend, piece.physical_topic))
        except BaseException:
            loop.run_until_complete(backend.close())
            raise
    except BaseException:
        loop.close()
        raise

    def close(lease: Lease, _reusable: bool) -> None:
        try:
            loop.run_until_complete(reader.close())
            loop.run_until_complete(backend.close())
        finally:
            loop.close()

    return Lease(loop, reader, close)


async def _reader(backend: Backend, physical_topic: str) -> ShardReader:
    """Made on the loop that will run it (readers bind to their loop)."""
    return backend.reader(physical_topic)


class ReaderPool:
    """What one worker keeps between slices (module docstring); ``WORKER_POOL`` is Spark's."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._backends: OrderedDict[str, Backend] = OrderedDict()
        self._idle: OrderedDict[ReaderKey, tuple[ShardReader, float]] = OrderedDict()
        self.opened = 0
        """Readers opened (a reused one is not counted again): what the tests look at."""

    def lease(self, piece: Slice) -> Lease:
        """The slice's physical topic's idle reader, or a new one; a private lease if held."""
        if not self._lock.acquire(blocking=False):
            return private_lease(piece)
        try:
            return self._lease(piece)
        except BaseException:
            self._lock.release()
            raise

    def _lease(self, piece: Slice) -> Lease:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        loop = self._loop
        now = self._clock()
        for key, (idle, since) in list(self._idle.items()):
            if now - since > IDLE_S_MAX:
                del self._idle[key]
                self._close(idle)
        key = (piece.cluster, piece.physical_topic)
        found = self._idle.pop(key, None)
        if found is not None:
            reader = found[0]
            self._backends.move_to_end(piece.cluster)
        else:
            backend = self._backends.get(piece.cluster)
            if backend is None:
                backend = open_backend(PhysicalCluster.model_validate_json(piece.cluster))
                self._backends[piece.cluster] = backend
                while len(self._backends) > BACKENDS_MAX:
                    self._close_backend(next(iter(self._backends)))
            self._backends.move_to_end(piece.cluster)
            reader = loop.run_until_complete(_reader(backend, piece.physical_topic))
            self.opened += 1
        return Lease(loop, reader, lambda lease, reusable: self._release(key, lease, reusable))

    def _release(self, key: ReaderKey, lease: Lease, reusable: bool) -> None:
        try:
            reader = lease.reader
            if not reusable or key[0] not in self._backends:
                self._close(reader)
                return
            try:
                reader.assign({})
                # Applies the empty assignment (Kafka applies it at its next poll) and lets the
                # loop send what closing the streams queued: an idle reader fetches nothing.
                self._run(reader.poll(1, 0.0))
                self._run(asyncio.sleep(0))
            except Exception:
                self._close(reader)
                return
            self._idle[key] = (reader, self._clock())
            while len(self._idle) > IDLE_READERS_MAX:
                _, (oldest, _since) = self._idle.popitem(last=False)
                self._close(oldest)
        finally:
            self._lock.release()

    def _run(self, work: Coroutine[Any, Any, T]) -> T:
        assert self._loop is not None
        return self._loop.run_until_complete(work)

    def _close(self, reader: ShardReader) -> None:
        with contextlib.suppress(Exception):  # a reader that fails to close is dropped anyway
            self._run(reader.close())

    def _close_backend(self, cluster: str) -> None:
        backend = self._backends.pop(cluster)
        for key in [k for k in self._idle if k[0] == cluster]:
            del self._idle[key]  # the backend closes its readers
        with contextlib.suppress(Exception):
            self._run(backend.close())

    def close(self) -> None:
        """Close every reader and backend, and the loop (tests; a worker just exits)."""
        with self._lock:
            for reader, _since in self._idle.values():
                self._close(reader)
            self._idle.clear()
            for cluster in list(self._backends):
                self._close_backend(cluster)
            if self._loop is not None:
                self._loop.close()
                self._loop = None


WORKER_POOL = ReaderPool()
"""The pool of this process, used by Spark's ``read`` (``clients.spark.source``)."""
