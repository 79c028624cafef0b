"""``XinfraProducer``: produce to a virtual topic or to one of its shards.

The data path reads straight through: ``send`` routes the record to a shard
(key → shard by ``xinfra.keyspace``; keyless records stick to one shard per
batch, then rotate), the shard's queue lingers into a batch, and the batch goes
to ``ShardProducer.send`` of every write epoch, oldest first (during a
migration: source first, then the target, carrying the source positions it
mirrors).  The record's future resolves to its position in the first write
epoch.

Promises:

* **Per-shard order**, also across retries.  A ``send_batch`` to a topic with
  one write epoch, on a shard with nothing queued, goes straight to the
  backend (``_send_direct``): the backend keeps the order of its sends and
  retries them itself until ``delivery_timeout_s``, as Kafka's producer does,
  so such writes are pipelined and the SDK keeps no reference to their
  records (records held until acknowledged are what the collector rescans:
  holding them cost the SDK a sixth of its produce throughput).  A direct
  write that fails is reported failed, not re-sent: a later write of the
  shard may already be stored, and re-sending would reorder the shard.
  Everything else (``send``, records queued behind a batch, dual writes) goes
  through the shard's queue: one batch in flight at a time, a failed batch
  retried before the next is sent.  During dual writes that holds on the
  source; the target's copies follow in the same order, pipelined: batch N+1
  goes to the source while batch N's copy is in flight to the target (at most
  ``MIRROR_BATCHES_IN_FLIGHT_MAX``).  A copy that fails is re-sent, with every
  copy issued after it, before any new one, and a record is acknowledged only
  once every copy is durable.
* **At least once**: a retried batch may be stored twice (the backend said it
  may or may not have it); the SDK never drops one it was not told failed.
* **Bounded memory**: at most ``buffer_bytes_max`` payload bytes wait; ``send``
  waits for room up to ``send_timeout_s``, then raises ``Backpressure``.
* ``flush`` returns when every record sent before it is acknowledged or
  failed; ``close`` flushes first and loses nothing.
* Metadata changes (a new epoch, a sealed one) are followed without a restart:
  a batch refused with ``Sealed`` waits for the next metadata version and
  goes to the new write epochs.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from itertools import repeat
from operator import is_not
from typing import overload

from clients.metadata import MetadataSource, TopicWatch, fetch_metadata
from clients.pool import BackendPool
from xinfra.backend import ProducerOptions
from xinfra.backoff import equal_jitter
from xinfra.errors import (
    Backpressure,
    InvalidRequest,
    RecordTooLarge,
    Sealed,
    ShardOutOfRange,
    Timeout,
    XinfraError,
)
from xinfra.keyspace import KEYSPACE_BITS, KeyRange, key_hash, shard_of_key_in, shard_ranges
from xinfra.model import Epoch, Header, Position, Record, TopicMetadata, mirror_header

log = logging.getLogger(__name__)


RECORD_OVERHEAD_BYTES = 64
"""Memory a queued record costs beyond its payload (future, slots, list entry): counted against
``buffer_bytes_max`` so that a flood of empty records is bounded too."""


MIRROR_BATCHES_IN_FLIGHT_MAX = 8
"""Per (topic, shard) during dual writes: batches whose source write is acknowledged and whose
target writes are still in flight.  Past it the next batch waits (the buffer bounds memory too)."""


@dataclass(frozen=True, slots=True)
class XinfraProducerOptions:
    """Bounds and timings of a producer; each buffer has a limit and a designed behaviour at it."""

    linger_ms: float = 5.0
    """How long a partial batch waits for more records (a full one goes at once)."""
    batch_records_max: int = 5_000
    batch_bytes_max: int = 1 << 20
    buffer_bytes_max: int = 64 << 20
    """Payload (plus ``RECORD_OVERHEAD_BYTES`` per record) waiting for acknowledgement."""
    record_bytes_max: int = 1 << 20
    """A larger record raises ``RecordTooLarge`` at ``send`` and is never queued."""
    send_timeout_s: float = 30.0
    """How long ``send`` waits for buffer room before ``Backpressure``."""
    delivery_timeout_s: float = 120.0
    """How long a batch is retried before its records fail with ``Timeout``."""
    retry_backoff_s_max: float = 2.0
    metadata_timeout_s: float = 30.0
    """How long the first metadata of a topic (and ``start``) waits for an unreachable service."""
    long_poll_s: float = 20.0
    """One metadata long-poll; a change is seen at once, this only bounds an idle request."""

    def backend_options(self) -> ProducerOptions:
        """The SDK batches, so the backend sends what it gets at once; it retries a write until
        the SDK's delivery deadline (a direct write is retried by the backend alone)."""
        return ProducerOptions(
            linger_ms=1.0,
            batch_bytes_max=self.batch_bytes_max,
            buffer_bytes_max=self.buffer_bytes_max + (self.batch_bytes_max << 1),
            record_bytes_max=self.record_bytes_max,
            request_timeout_s=self.delivery_timeout_s,
        )


class Positions(Sequence[Position]):
    """The positions of one ``send_batch`` call, in call order, each made when read.

    A call of N records costs two lists of ints here, filled at the first
    read (and one epoch, unless its records landed in several), not N
    position tuples: every tuple would
    be an object the garbage collector tracks for as long as the application
    keeps the result, and on the producer's hot path that tracking costs more
    than the tuples.
    """

    __slots__ = ("_count", "_epoch", "_epochs", "_offsets", "_placed", "_shards")

    def __init__(self, count: int) -> None:
        self._count = count
        self._epoch = -1  # the one epoch of every record placed so far (-1: none yet)
        self._epochs: list[int] | None = None  # per record, once two epochs were seen
        self._shards: list[int] = []  # made at the first read
        self._offsets: list[int] = []
        self._placed: list[tuple[list[int], int, int, list[int]]] = []
        """``place`` calls not yet applied: applied at the first read, so an application
        that only counts its positions (or drops them) pays no step per record here
        (callgrind, the bench's send_batch loop: 220 instructions per record)."""

    def place(self, indices: list[int], epoch: int, shard: int, offsets: list[int]) -> None:
        """Record where the records at ``indices`` of the call were stored."""
        self._placed.append((indices, epoch, shard, offsets))

    def _apply(self) -> None:
        if not self._offsets:
            self._shards = [0] * self._count
            self._offsets = [0] * self._count
        placed, self._placed = self._placed, []
        for indices, epoch, shard, offsets in placed:
            self._apply_one(indices, epoch, shard, offsets)

    def _apply_one(self, indices: list[int], epoch: int, shard: int, offsets: list[int]) -> None:
        if self._epochs is None and self._epoch not in (-1, epoch):  # a second epoch: per record
            self._epochs = [self._epoch] * len(self._offsets)
        self._epoch = epoch
        if len(offsets) == len(self._offsets) and self._epochs is None:
            # The whole call went to one shard in one batch.
            self._shards = [shard] * len(offsets)
            self._offsets = offsets
            return
        # A loop of specialised list stores, cheaper per record than a C ``map`` of
        # ``list.__setitem__`` (a wrapper call that parses its arguments each time).
        epochs, shards, stored = self._epochs, self._shards, self._offsets
        for index, offset in zip(indices, offsets, strict=True):
            shards[index] = shard
            stored[index] = offset
        if epochs is not None:
            for index in indices:
                epochs[index] = epoch

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> Position: ...

    @overload
    def __getitem__(self, index: slice) -> list[Position]: ...

    def __getitem__(self, index: int | slice) -> Position | list[Position]:
        if self._placed:
            self._apply()
        epochs = self._epochs
        if isinstance(index, slice):
            shards = self._shards[index]
            return list(
                map(
                    Position,
                    repeat(self._epoch, len(shards)) if epochs is None else epochs[index],
                    shards,
                    self._offsets[index],
                )
            )
        epoch = self._epoch if epochs is None else epochs[index]
        return Position(epoch, self._shards[index], self._offsets[index])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Positions({list(self)!r})"


class _Chunk:
    """The records one ``send_batch`` call routed to one shard: they resolve its one future.

    The same object stands in the queue's sink list for each of those records,
    so a batch call costs no future per record.
    """

    __slots__ = ("call", "indices", "next")

    def __init__(self, call: _BatchCall, indices: list[int]) -> None:
        self.call = call
        self.indices = indices
        self.next = 0

    def resolve(self, epoch: int, shard: int, offsets: list[int]) -> None:
        """Where this chunk's next ``len(offsets)`` records went (a batch may cut a chunk)."""
        call = self.call
        done = self.next + len(offsets)
        whole = self.next == 0 and done == len(self.indices)
        call.positions.place(
            self.indices if whole else self.indices[self.next : done], epoch, shard, offsets
        )
        self.next = done
        call.remaining -= len(offsets)
        if call.remaining == 0 and not call.future.done():
            call.future.set_result(call.positions)


class _BatchCall:
    __slots__ = ("future", "positions", "remaining")

    def __init__(self, future: asyncio.Future[Positions], count: int) -> None:
        self.future = future
        self.positions = Positions(count)
        self.remaining = count


_Sink = asyncio.Future[Position] | _Chunk


class _Flight:
    """A batch with writes in flight that the shard's resolver completes in order.

    Either a batch whose first write epoch acknowledged it, with its later
    writes (the mirror) in flight: the shard's sender issues those writes and
    goes on to the next batch.  Or a direct write (``records`` None: the SDK
    keeps no reference to them), whose one write is its first.  The shard's
    resolver takes the flights in order and resolves each batch's records once
    every one of its writes is acknowledged.  ``settled``: the sender already
    resolved (or failed) the batch; only its place in the order remains, so
    that a shard's batches complete in order.
    """

    __slots__ = (
        "batch_bytes",
        "count",
        "deadline",
        "done",
        "first",
        "records",
        "settled",
        "sinks",
        "writes",
    )

    def __init__(
        self,
        records: list[Record] | None,
        sinks: list[_Sink],
        batch_bytes: int,
        deadline: float,
        first: tuple[int, list[int]] | None = None,
        done: set[int] | None = None,
        settled: bool = False,
    ) -> None:
        self.records = records
        self.count = len(sinks)
        self.sinks = sinks
        self.batch_bytes = batch_bytes
        self.deadline = deadline
        self.first = first
        self.done: set[int] = done if done is not None else set()
        self.settled = settled
        self.writes: list[tuple[int, asyncio.Future[list[int]]]] = []
        """(epoch number, the backend's future) of each later write, in write-epoch order."""


@dataclass
class _ShardQueue:
    """Records waiting for one shard of one topic, and the one task that sends them.

    ``appended`` counts records ever queued, ``completed`` those whose future is
    resolved (acknowledged or failed); both only grow, so ``flush`` waits for
    ``completed`` to reach the ``appended`` it saw.
    """

    topic: str
    shard: int
    records: list[Record] = field(default_factory=list)
    sinks: list[_Sink] = field(default_factory=list)
    """Where each record's position goes: its own future, or its ``send_batch`` call."""
    sizes: list[int] = field(default_factory=list)
    """Bytes reserved in the buffer for each record (payload + overhead)."""
    bytes: int = 0
    appended: int = 0
    completed: int = 0
    oldest_s: float = 0.0
    """Loop time at which the queue last went from empty to holding records: the linger clock."""
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    flights: deque[_Flight] = field(default_factory=deque)
    """During dual writes: batches whose later writes are in flight, oldest first."""
    flights_changed: asyncio.Event = field(default_factory=asyncio.Event)
    """Set (and replaced) whenever a flight completes or a repair ends."""
    repairing: bool = False
    """The resolver re-sends failed later writes, in order: nothing new is issued meanwhile."""
    delivering: bool = False
    """The sender holds a batch it took: nothing may go straight to the backend before it."""
    resolver: asyncio.Task[None] | None = None


class XinfraProducer:
    """An asyncio producer over virtual topics.

    Build with ``clients.open_producer(...)`` (or ``connect_producer`` then
    ``await start()``).  All methods must be called from the event loop that
    runs the producer; ``clients.sync.SyncProducer`` serves blocking code.
    """

    def __init__(
        self,
        source: MetadataSource,
        options: XinfraProducerOptions | None = None,
        pool: BackendPool | None = None,
    ) -> None:
        self.source = source
        self.options = options or XinfraProducerOptions()
        self.pool = pool or BackendPool(producer_options=self.options.backend_options())
        self._watches: dict[str, TopicWatch] = {}
        self._watch_lock = asyncio.Lock()
        self._queues: dict[tuple[str, int], _ShardQueue] = {}
        self._sticky: dict[str, itertools.cycle[int]] = {}
        self._sticky_shard: dict[str, int] = {}
        self._routing_tables: dict[str, tuple[int, int, list[KeyRange] | None]] = {}
        self._loop = asyncio.get_running_loop()
        self._writes_in_flight: dict[tuple[str, int], int] = {}  # (topic, version) -> count
        self._writes_ended = asyncio.Event()  # set (and replaced) when a write ends
        self._progress = asyncio.Condition()
        self._buffered_bytes = 0
        self._room_waiters = 0
        self._room = asyncio.Condition()
        self._closed = False

    # -- metadata --------------------------------------------------------------------------

    async def start(self, topics: Sequence[str] = ()) -> XinfraProducer:
        """Check the service and the token now, fetch the metadata of ``topics`` and open their
        shard producers, so that the first ``send`` pays no connection set-up.

        Raises ``Unavailable`` when the service does not answer within
        ``metadata_timeout_s``, ``Unauthenticated``/``Forbidden`` for a bad token,
        ``TopicNotFound`` for an unknown topic; returns ``self``.
        """
        await self.source.connect(self.options.metadata_timeout_s)
        for topic in topics:
            metadata = await self.metadata(topic)
            for epoch in metadata.write_epochs:
                # A cluster that does not answer now is tried again by the first send.
                with contextlib.suppress(XinfraError):
                    self.pool.producer(metadata.clusters[epoch.cluster], epoch.physical_topic)
        return self

    async def metadata(self, topic: str) -> TopicMetadata:
        """The metadata this producer runs on for ``topic`` (fetched and watched on first use)."""
        watch = self._watches.get(topic)
        if watch is None:
            async with self._watch_lock:
                watch = self._watches.get(topic)
                if watch is None:
                    metadata = await fetch_metadata(
                        self.source, topic, self.options.metadata_timeout_s
                    )
                    watch = TopicWatch(
                        self.source,
                        metadata,
                        settle=self._settle,
                        long_poll_s=self.options.long_poll_s,
                    )
                    watch.listeners.append(self.pool.adopt)
                    watch.start()
                    self._watches[topic] = watch
                    with contextlib.suppress(XinfraError):
                        await self.source.acknowledge(topic, metadata.version)
        return watch.current

    # -- sending ---------------------------------------------------------------------------

    async def send(
        self,
        topic: str,
        value: bytes | None,
        *,
        key: bytes | None = None,
        headers: Sequence[Header] = (),
        timestamp_ms: int | None = None,
        shard: int | None = None,
    ) -> asyncio.Future[Position]:
        """Queue one record; the returned future resolves to its position once it is committed.

        Raises at once ``TopicNotFound``, ``ShardOutOfRange``, ``RecordTooLarge``,
        ``Backpressure`` (no room after ``send_timeout_s``), ``Unauthenticated``
        (the token was revoked) or ``InvalidRequest`` (closed).  Later failures
        (``Timeout`` after ``delivery_timeout_s``, a non-retriable backend
        error) arrive through the future; such a record may or may not be stored.
        """
        if self._closed:
            raise InvalidRequest("the producer is closed")
        record = Record(value, key, tuple(headers) if headers else (), timestamp_ms)
        size = len(value or b"") + len(key or b"")
        if headers:
            size = record.size_bytes()
        if size > self.options.record_bytes_max:
            raise RecordTooLarge(
                f"record of {size} bytes exceeds record_bytes_max={self.options.record_bytes_max}; "
                "split it or raise the limit (the broker's own limit applies too)"
            )
        watch = self._watches.get(topic)
        if watch is None:
            await self.metadata(topic)
            watch = self._watches[topic]
        if watch.error is not None:
            raise watch.error
        self.source.check()
        shard = self._route(watch.current, key, shard)
        size += RECORD_OVERHEAD_BYTES
        if self._room_waiters or self._buffered_bytes + size > self.options.buffer_bytes_max:
            await self._reserve(size)
        else:
            self._buffered_bytes += size
        future: asyncio.Future[Position] = self._loop.create_future()
        self._enqueue(topic, shard, record, future, size)
        return future

    async def send_batch(self, topic: str, records: Sequence[Record]) -> asyncio.Future[Positions]:
        """Queue many records at once; one future resolves to their ``Positions``, in order.

        The same routing, batching, order and bounds as ``send`` (each record
        goes to its key's shard, or to ``send``'s sticky shard when keyless),
        without a future per record: the way to go fast from Python.  Raises at
        once like ``send``, before queueing any record; the future fails with
        the first failure of any of its records (the others may be stored).
        """
        if self._closed:
            raise InvalidRequest("the producer is closed")
        watch = self._watches.get(topic)
        if watch is None:
            await self.metadata(topic)
            watch = self._watches[topic]
        if watch.error is not None:
            raise watch.error
        self.source.check()
        future: asyncio.Future[Positions] = self._loop.create_future()
        if not records:
            future.set_result(Positions(0))
            return future
        # One pass: size check and routing, inlined (this loop is the SDK's cost per record).
        count, ranges = self._routing(watch.current)
        record_bytes_max = self.options.record_bytes_max
        # Per shard: the call's indices, records and sizes of the records routed there, built
        # as the records are routed (appends, no regrouping pass afterwards).
        by_shard: list[tuple[list[int], list[Record], list[int]]] = [
            ([], [], []) for _ in range(count)
        ]
        keyless = -1
        total = 0
        for index, record in enumerate(records):
            key = record.key
            if record.headers:
                size = record.size_bytes()
            else:
                value = record.value
                size = (0 if key is None else len(key)) + (0 if value is None else len(value))
            if size > record_bytes_max:
                raise RecordTooLarge(
                    f"record of {size} bytes exceeds record_bytes_max={record_bytes_max}; "
                    "nothing of this batch was queued"
                )
            size += RECORD_OVERHEAD_BYTES
            total += size
            if key is None:
                if keyless < 0:
                    keyless = self._sticky_of(topic, count)
                indices, routed, sizes = by_shard[keyless]
            elif ranges is None:
                indices, routed, sizes = by_shard[(key_hash(key) * count) >> KEYSPACE_BITS]
            else:
                indices, routed, sizes = by_shard[shard_of_key_in(key, ranges)]
            indices.append(index)
            routed.append(record)
            sizes.append(size)
        if total > self.options.buffer_bytes_max:
            raise InvalidRequest(
                f"a batch of {total} bytes cannot fit buffer_bytes_max="
                f"{self.options.buffer_bytes_max}; split it"
            )
        # All or nothing: the whole call waits for room, so Backpressure queues none of it.
        if self._room_waiters or self._buffered_bytes + total > self.options.buffer_bytes_max:
            await self._reserve(total)
        else:
            self._buffered_bytes += total
        call = _BatchCall(future, len(records))
        metadata = watch.current
        epochs = metadata.write_epochs
        direct = epochs[0] if len(epochs) == 1 and not metadata.topic.sealed else None
        for shard, (indices, routed, sizes) in enumerate(by_shard):
            if indices:
                chunk = _Chunk(call, indices)
                if direct is None or not self._send_direct(
                    metadata, direct, shard, routed, chunk, sum(sizes)
                ):
                    self._enqueue_many(topic, shard, routed, chunk, sizes)
                elif routed[-1].key is None and self._sticky_shard.get(topic) == shard:
                    self._next_sticky(topic, count)
        return future

    def _send_direct(
        self,
        metadata: TopicMetadata,
        epoch: Epoch,
        shard: int,
        records: list[Record],
        chunk: _Chunk,
        reserved: int,
    ) -> bool:
        """Hand ``records`` to the backend now, as a flight; False (nothing sent) to queue them.

        Only when nothing of the shard may go before them: no records queued,
        no batch held by the sender, no flight but direct ones (whose order the
        backend keeps, ``xinfra.backend``'s *Order*).  The flight keeps the
        records' sinks and reserved bytes, not the records.
        """
        topic = metadata.topic.name
        queue = self._queues.get((topic, shard)) or self._queue(topic, shard)
        if (
            queue.records
            or queue.delivering
            or queue.repairing
            or (queue.flights and queue.flights[-1].records is not None)
        ):
            return False
        try:
            write = self._issue(metadata, epoch, shard, records, None)
        except XinfraError:  # refused at once (no room, no connection yet): the queue retries
            return False
        count = len(records)
        flight = _Flight(None, [chunk] * count, reserved, 0.0)
        flight.writes.append((epoch.number, write))
        queue.appended += count
        self._push_flight(queue, flight)
        return True

    def _enqueue_many(
        self, topic: str, shard: int, records: list[Record], chunk: _Chunk, sizes: list[int]
    ) -> None:
        queue = self._queues.get((topic, shard)) or self._queue(topic, shard)
        if not queue.records:
            queue.oldest_s = self._loop.time()
        queue.records.extend(records)
        queue.sinks.extend([chunk] * len(records))
        queue.sizes.extend(sizes)
        queue.bytes += sum(sizes)
        queue.appended += len(records)
        queue.wakeup.set()
        if records[-1].key is None and self._sticky_shard.get(topic) == shard:
            self._next_sticky(topic, len(self._watches[topic].current.current_epoch.shards))

    def _enqueue(self, topic: str, shard: int, record: Record, sink: _Sink, size: int) -> None:
        queue = self._queues.get((topic, shard)) or self._queue(topic, shard)
        queue.records.append(record)
        queue.sinks.append(sink)
        queue.sizes.append(size)
        queue.bytes += size
        queue.appended += 1
        count = len(queue.records)
        if count == 1:
            queue.oldest_s = self._loop.time()  # start the linger clock
            queue.wakeup.set()
        elif count >= self.options.batch_records_max or queue.bytes >= self.options.batch_bytes_max:
            queue.wakeup.set()
            if record.key is None and self._sticky_shard.get(topic) == shard:
                # A full batch of keyless records: stick to the next shard (an even spread
                # also when the sender has had no turn yet).
                self._next_sticky(topic, len(self._watches[topic].current.current_epoch.shards))

    async def produce(
        self,
        topic: str,
        value: bytes | None,
        *,
        key: bytes | None = None,
        headers: Sequence[Header] = (),
        timestamp_ms: int | None = None,
        shard: int | None = None,
    ) -> Position:
        """``send`` and wait for the position (one record at a time: slow, for tools and tests)."""
        future = await self.send(
            topic, value, key=key, headers=headers, timestamp_ms=timestamp_ms, shard=shard
        )
        return await future

    def _route(self, metadata: TopicMetadata, key: bytes | None, shard: int | None) -> int:
        count, ranges = self._routing(metadata)
        if shard is not None:
            if not 0 <= shard < count:
                raise ShardOutOfRange(
                    f"shard {shard} is out of range for topic {metadata.topic.name!r} "
                    f"with {count} shards (0..{count - 1})"
                )
            return shard
        if key is not None:
            if ranges is None:  # the N equal ranges: arithmetic, no search
                return (key_hash(key) * count) >> KEYSPACE_BITS
            return shard_of_key_in(key, ranges)
        return self._sticky_of(metadata.topic.name, count)

    def _routing(self, metadata: TopicMetadata) -> tuple[int, list[KeyRange] | None]:
        """The shard count, and the ranges unless they are the N equal ones; kept per version."""
        routing = self._routing_tables.get(metadata.topic.name)
        if routing is None or routing[0] != metadata.version:
            ranges = [s.key_range for s in metadata.current_epoch.shards]
            equal = ranges == shard_ranges(len(ranges))
            routing = (metadata.version, len(ranges), None if equal else ranges)
            self._routing_tables[metadata.topic.name] = routing
        return routing[1], routing[2]

    def _sticky_of(self, topic: str, count: int) -> int:
        """The shard keyless records of ``topic`` go to now."""
        sticky = self._sticky_shard.get(topic)
        if sticky is None or sticky >= count:
            sticky = self._next_sticky(topic, count)
        return sticky

    def _next_sticky(self, topic: str, count: int) -> int:
        """Keyless records stick to one shard per batch, then rotate: even spread, full batches."""
        cycle = self._sticky.get(topic)
        if cycle is None:
            start = hash(id(self)) % count
            cycle = itertools.cycle([(start + i) % count for i in range(count)])
            self._sticky[topic] = cycle
        shard = next(cycle) % count
        self._sticky_shard[topic] = shard
        return shard

    async def _reserve(self, size: int) -> None:
        """Wait for room in the buffer (first come, first served), up to ``send_timeout_s``."""
        self._room_waiters += 1
        try:
            async with self._room:
                try:
                    await asyncio.wait_for(
                        self._room.wait_for(
                            lambda: self._buffered_bytes + size <= self.options.buffer_bytes_max
                        ),
                        self.options.send_timeout_s,
                    )
                except TimeoutError:
                    raise Backpressure(
                        f"{self._buffered_bytes} bytes await acknowledgement (buffer_bytes_max="
                        f"{self.options.buffer_bytes_max}) for {self.options.send_timeout_s} s; "
                        "slow down, or raise the limit"
                    ) from None
                self._buffered_bytes += size
        finally:
            self._room_waiters -= 1

    async def _release(self, size: int) -> None:
        self._buffered_bytes -= size
        assert self._buffered_bytes >= 0, "released more buffer than was reserved"
        if self._room_waiters:
            async with self._room:
                self._room.notify_all()

    def _queue(self, topic: str, shard: int) -> _ShardQueue:
        queue = self._queues.get((topic, shard))
        if queue is None:
            queue = _ShardQueue(topic, shard)
            queue.task = asyncio.get_running_loop().create_task(
                self._sender(queue), name=f"producer:{topic}:{shard}"
            )
            self._queues[(topic, shard)] = queue
        return queue

    async def _sender(self, queue: _ShardQueue) -> None:
        """Linger, take a batch, deliver it to every write epoch; one batch in flight per shard.

        While a batch is in flight the queue fills, so under load the next
        batch is as large as the limits allow: throughput comes from batch
        size, order from having one batch in flight.  As in Kafka, the linger
        clock starts when the oldest waiting record arrived: records that
        waited out a batch in flight go at once.

        During dual writes "in flight" means on the first write epoch (the
        source): once the source acknowledged a batch, its later writes (the
        target's copy) are issued and left to the shard's resolver
        (``_resolve_flights``), and the next batch goes to the source while
        they are in flight.  Each cluster still receives the shard's batches
        in order, and a record is acknowledged only once every copy is.
        """
        linger_s = self.options.linger_ms / 1000
        loop = asyncio.get_running_loop()
        while True:
            await queue.wakeup.wait()
            if not queue.records:
                queue.wakeup.clear()
                if self._closed:
                    await self._drain(queue)
                    return
                continue
            full = (
                len(queue.records) >= self.options.batch_records_max
                or queue.bytes >= self.options.batch_bytes_max
            )
            linger_left_s = queue.oldest_s + linger_s - loop.time()
            if not full and not self._closed and linger_left_s > 0:
                queue.wakeup.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(queue.wakeup.wait(), linger_left_s)
            records, sinks, sizes = self._take_batch(queue)
            queue.delivering = True
            batch_bytes = sum(sizes)
            queue.bytes -= batch_bytes
            if self._sticky_shard.get(queue.topic) == queue.shard:
                count = len(self._watches[queue.topic].current.current_epoch.shards)
                self._next_sticky(queue.topic, count)
            if not queue.records:
                queue.wakeup.clear()
            pipelined = False
            try:
                pipelined = await self._deliver(
                    queue.topic, queue.shard, records, sinks, batch_bytes=batch_bytes, queue=queue
                )
            except asyncio.CancelledError:
                self._fail(sinks, InvalidRequest("the producer was cancelled before delivery"))
                raise
            except Exception as error:  # a bug: fail the batch loudly, keep the shard going
                log.exception("producer %s/%s: delivery failed", queue.topic, queue.shard)
                self._fail(sinks, error)
            finally:
                queue.delivering = False
                if not pipelined:
                    if queue.flights:  # complete in order, after the batches still in flight
                        flight = _Flight(records, sinks, batch_bytes, loop.time(), settled=True)
                        self._push_flight(queue, flight)
                    else:
                        await self._complete(queue, len(records), batch_bytes)

    async def _complete(self, queue: _ShardQueue, count: int, batch_bytes: int) -> None:
        """A batch is acknowledged or failed: count it, free its buffer, wake ``flush``."""
        queue.completed += count
        await self._release(batch_bytes)
        async with self._progress:
            self._progress.notify_all()

    def _push_flight(self, queue: _ShardQueue, flight: _Flight) -> None:
        queue.flights.append(flight)
        if queue.resolver is None:
            queue.resolver = self._loop.create_task(
                self._resolve_flights(queue), name=f"producer:{queue.topic}:{queue.shard}:mirror"
            )

    @staticmethod
    def _flights_changed(queue: _ShardQueue) -> None:
        changed, queue.flights_changed = queue.flights_changed, asyncio.Event()
        changed.set()

    async def _drain(self, queue: _ShardQueue, below: int = 1) -> None:
        """Wait until fewer than ``below`` flights of the shard remain and no repair runs."""
        while len(queue.flights) >= below or queue.repairing:
            await queue.flights_changed.wait()

    @staticmethod
    def _in_flight_on(queue: _ShardQueue, epoch: int) -> bool:
        """Whether a write of the shard to ``epoch`` is in flight (issued, not yet resolved)."""
        return any(number == epoch for flight in queue.flights for number, _ in flight.writes)

    async def _resolve_flights(self, queue: _ShardQueue) -> None:
        """Complete the shard's flights in order; a failed later write is re-sent before any after.

        A flight whose writes were all acknowledged resolves its records (to
        their positions in the first write epoch).  When one failed, nothing
        new is issued (``repairing``) until every write in flight has ended;
        then, oldest first, each flight re-sends what failed on an epoch and
        every later flight's write to that epoch (it was issued after the
        failed one, so keeping it would reorder the epoch), each through the
        serial retry loop of ``_deliver`` until its deadline.  A direct write
        is never re-sent (the SDK does not hold its records): it resolves, or
        fails with the backend's error.
        """
        try:
            while queue.flights:
                flight = queue.flights[0]
                pending = [future for _, future in flight.writes if not future.done()]
                if pending:
                    await asyncio.wait(pending)
                if (
                    flight.records is not None
                    and not flight.settled
                    and not all(_succeeded(f) for _, f in flight.writes)
                ):
                    await self._repair(queue)
                    continue
                queue.flights.popleft()
                try:
                    self._land(flight, queue.shard)
                finally:
                    await self._complete(queue, flight.count, flight.batch_bytes)
                    self._flights_changed(queue)
        finally:
            queue.resolver = None

    def _land(self, flight: _Flight, shard: int) -> None:
        """Resolve a flight whose writes all ended: to its first write's positions, or failed."""
        if flight.settled:
            return
        if flight.records is None:  # a direct write: its one write is the first
            number, write = flight.writes[0]
            if not _succeeded(write):
                self._fail(flight.sinks, _failure(write))
                return
            flight.first = (number, write.result())
        assert flight.first is not None, "a flight has its first write"
        number, offsets = flight.first
        self._resolve(flight.sinks, number, shard, offsets)

    async def _repair(self, queue: _ShardQueue) -> None:
        queue.repairing = True
        try:
            pending = [f for flight in queue.flights for _, f in flight.writes if not f.done()]
            if pending:
                await asyncio.wait(pending)
            broken: set[int] = set()
            while queue.flights:
                flight = queue.flights[0]
                try:
                    if flight.records is None:
                        self._land(flight, queue.shard)
                    elif not flight.settled:
                        for number, future in flight.writes:
                            if not _succeeded(future) or number in broken:
                                broken.add(number)
                            else:
                                flight.done.add(number)
                        await self._deliver(
                            queue.topic,
                            queue.shard,
                            flight.records,
                            flight.sinks,
                            batch_bytes=flight.batch_bytes,
                            deadline=flight.deadline,
                            first=flight.first,
                            done=flight.done,
                        )
                except Exception as error:  # a bug: fail the batch loudly, keep the shard going
                    log.exception("producer %s/%s: delivery failed", queue.topic, queue.shard)
                    self._fail(flight.sinks, error)
                finally:
                    queue.flights.popleft()
                    await self._complete(queue, flight.count, flight.batch_bytes)
        finally:
            queue.repairing = False
            self._flights_changed(queue)

    def _take_batch(self, queue: _ShardQueue) -> tuple[list[Record], list[_Sink], list[int]]:
        """The oldest records up to the batch limits (always at least one)."""
        records_max = self.options.batch_records_max
        bytes_max = self.options.batch_bytes_max
        if queue.bytes <= bytes_max and len(queue.records) <= records_max:
            taken = (queue.records, queue.sinks, queue.sizes)
            queue.records, queue.sinks, queue.sizes = [], [], []
            return taken
        # Running byte totals of the first records_max records (in C): the batch is the longest
        # prefix within bytes_max, and at least one record.
        count = max(
            1, bisect.bisect_right(list(itertools.accumulate(queue.sizes[:records_max])), bytes_max)
        )
        taken = (queue.records[:count], queue.sinks[:count], queue.sizes[:count])
        del queue.records[:count], queue.sinks[:count], queue.sizes[:count]
        return taken

    async def _deliver(
        self,
        topic: str,
        shard: int,
        records: list[Record],
        sinks: list[_Sink],
        *,
        batch_bytes: int = 0,
        deadline: float | None = None,
        first: tuple[int, list[int]] | None = None,
        done: set[int] | None = None,
        queue: _ShardQueue | None = None,
    ) -> bool:
        """Write the batch to each write epoch in order, retrying what failed, until the deadline.

        ``first`` and ``done`` carry what earlier attempts achieved (a repair).
        With ``queue`` (the sender), once the first write epoch acknowledged
        the batch its later writes are issued without waiting: the batch
        becomes a flight of the queue and True is returned; otherwise the
        records are resolved or failed before this returns False.
        """
        loop = asyncio.get_running_loop()
        if deadline is None:
            deadline = loop.time() + self.options.delivery_timeout_s
        done_epochs: set[int] = done if done is not None else set()
        # first: (epoch, offsets) in the first write epoch, the positions the records resolve to.
        backoff_s = 0.05
        while True:
            watch = self._watches[topic]
            metadata = watch.current
            changed = watch.changed
            try:
                if metadata.topic.sealed:
                    self._fail(
                        sinks, Sealed(f"topic {topic!r} is sealed: it takes no more records")
                    )
                    return False
                epochs = [e for e in metadata.write_epochs if e.number not in done_epochs]
                if queue is not None and epochs:
                    if first is not None and (
                        queue.repairing or len(queue.flights) >= MIRROR_BATCHES_IN_FLIGHT_MAX
                    ):
                        await self._drain(queue, MIRROR_BATCHES_IN_FLIGHT_MAX)
                        continue  # on the metadata current after the wait
                    if first is None and self._in_flight_on(queue, epochs[0].number):
                        # The epoch has copies in flight (e.g. the target, now the only write
                        # epoch): this batch goes after them, once they are acknowledged.
                        await self._drain(queue)
                        continue
                    if first is not None:
                        flight = _Flight(
                            records, sinks, batch_bytes, deadline, first, set(done_epochs)
                        )
                        self._issue_flight(queue, metadata, epochs, flight)
                        return True
                pipelining = False
                for epoch in epochs:
                    if queue is not None and first is not None:
                        pipelining = True  # the later writes: issued without waiting, below
                        break
                    offsets = await self._issue(metadata, epoch, shard, records, first)
                    done_epochs.add(epoch.number)
                    if first is None:
                        first = (epoch.number, offsets)
                if pipelining:
                    continue  # on the metadata current now that the first epoch has it
                assert first is not None, "a topic always has a write epoch"
                number, offsets = first
                self._resolve(sinks, number, shard, offsets)
                return False
            except Sealed:
                # The epoch was sealed under us: the next metadata version names the new one.
                timeout_s = deadline - loop.time()
                if timeout_s > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(changed.wait(), timeout_s)
            except XinfraError as error:
                if not error.retriable or loop.time() >= deadline:
                    self._fail(sinks, error)
                    return False
                delay_s = equal_jitter(backoff_s)
                log.info("producer %s/%s: %s; retrying in %.2f s", topic, shard, error, delay_s)
                await asyncio.sleep(delay_s)
                backoff_s = min(backoff_s * 2, self.options.retry_backoff_s_max)
            if loop.time() >= deadline:
                self._fail(sinks, Timeout(f"batch for {topic}/{shard} not acknowledged in time"))
                return False

    def _issue_flight(
        self, queue: _ShardQueue, metadata: TopicMetadata, epochs: list[Epoch], flight: _Flight
    ) -> None:
        """Issue the flight's writes to ``epochs`` (in order, not awaited) and queue it."""
        assert flight.records is not None, "a mirror flight holds its records"
        for epoch in epochs:
            try:
                future = self._issue(metadata, epoch, queue.shard, flight.records, flight.first)
            except XinfraError as error:  # refused at once: the resolver retries it in order
                future = self._loop.create_future()
                future.set_exception(error)
            flight.writes.append((epoch.number, future))
        self._push_flight(queue, flight)

    @staticmethod
    def _resolve(sinks: list[_Sink], number: int, shard: int, offsets: list[int]) -> None:
        """Resolve the records of a batch to their positions ``offsets`` in epoch ``number``."""
        assert len(offsets) == len(sinks), "one offset per record"
        start = 0
        count = len(sinks)
        while start < count:
            sink = sinks[start]
            if isinstance(sink, _Chunk):
                # A send_batch call's records are one run of the queue (enqueued together, taken
                # in order): its end found by bisection, not by a step per record.
                end = bisect.bisect_left(sinks, True, start + 1, count, key=partial(is_not, sink))
                sink.resolve(number, shard, offsets[start:end])
            else:  # a send() record: a future of its own
                if not sink.done():
                    sink.set_result(Position(number, shard, offsets[start]))
                end = start + 1
            start = end

    def _issue(
        self,
        metadata: TopicMetadata,
        epoch: Epoch,
        shard: int,
        records: list[Record],
        source: tuple[int, list[int]] | None,
    ) -> asyncio.Future[list[int]]:
        """Hand ``records`` to ``epoch``'s shard producer now; the future of their offsets.

        The write counts as in flight under ``metadata.version`` from this call
        until the future is done (``_settle``); in a mirror epoch each record
        carries the position it got in the first write epoch (``source``).
        """
        if source is not None and epoch.mirror_of is not None:
            source_epoch, source_offsets = source
            records = [
                replace(
                    record,
                    headers=(*record.headers, mirror_header(Position(source_epoch, shard, offset))),
                )
                for record, offset in zip(records, source_offsets, strict=True)
            ]
        producer = self.pool.producer(metadata.clusters[epoch.cluster], epoch.physical_topic)
        key = (metadata.topic.name, metadata.version)
        self._writes_in_flight[key] = self._writes_in_flight.get(key, 0) + 1
        try:
            future = producer.send(shard, records)
        except BaseException:
            self._write_ended(key)
            raise
        future.add_done_callback(lambda _: self._write_ended(key))
        return future

    def _write_ended(self, key: tuple[str, int]) -> None:
        self._writes_in_flight[key] -= 1
        if not self._writes_in_flight[key]:
            del self._writes_in_flight[key]
        ended, self._writes_ended = self._writes_ended, asyncio.Event()
        ended.set()

    async def _settle(self, metadata: TopicMetadata) -> None:
        """Wait until no write started under an older version of the topic is in flight."""
        topic = metadata.topic.name
        while any(t == topic and v < metadata.version for t, v in self._writes_in_flight):
            await self._writes_ended.wait()

    @staticmethod
    def _fail(sinks: list[_Sink], error: BaseException) -> None:
        for sink in sinks:
            future = sink.call.future if isinstance(sink, _Chunk) else sink
            if not future.done():
                future.set_exception(error)

    # -- lifecycle -------------------------------------------------------------------------

    async def flush(self) -> None:
        """Return when every record sent before this call is acknowledged or failed.

        Failures are reported through the records' futures, not raised here.
        """
        targets = [(queue, queue.appended) for queue in self._queues.values()]
        for queue, _ in targets:
            if queue.records:
                queue.wakeup.set()
        async with self._progress:
            await self._progress.wait_for(
                lambda: all(queue.completed >= target for queue, target in targets)
            )
        await self.pool.flush()

    async def close(self) -> None:
        """Flush, stop the watches and senders, close connections.  Idempotent; loses nothing."""
        if self._closed:
            return
        await self.flush()
        self._closed = True
        for queue in self._queues.values():
            queue.wakeup.set()
        tasks = [queue.task for queue in self._queues.values() if queue.task is not None]
        tasks += [q.resolver for q in self._queues.values() if q.resolver is not None]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for watch in self._watches.values():
            await watch.close()
        await self.pool.close()
        await self.source.close()

    async def __aenter__(self) -> XinfraProducer:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()


def _succeeded(future: asyncio.Future[list[int]]) -> bool:
    return future.done() and not future.cancelled() and future.exception() is None


def _failure(future: asyncio.Future[list[int]]) -> BaseException:
    """Why a write that ended did not succeed."""
    if future.cancelled():
        return InvalidRequest("the write was cancelled before it was acknowledged")
    error = future.exception()
    assert error is not None, "a failed write has its error"
    return error
