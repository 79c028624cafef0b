"""Executor side: read one slice through the backend interface, as Arrow record batches.

A task reads the shard from ``start`` and stops at ``end`` through the
backend of the slice's cluster (``xinfra.backend.open_backend``, found
through the ``xinfra.backends`` entry points), kept open between the slices
a Spark worker reads (``reader_pool``); it never calls the metadata service.  Each
poll becomes one Arrow batch (columns built from the poll's records in one
pass each, no Python object per row beyond the backend's record tuple), so
Spark receives columns, not rows.

Records are delivered in offset order.  In a migration target the records
mirroring a source offset below the source's end are skipped: they were read
from the source.  The mirrored records form a prefix of the shard, so once a
record is past it the check stops.

Bounds: a poll takes at most ``POLL_RECORDS_MAX`` records; the reader
buffers at most ``ReaderOptions.fetch_bytes_max``.  A shard that yields
nothing for ``STALL_S_MAX`` while its end is not reached is an error, not a
hang.

The cyclic collector is paused while a poll is taken and turned into its
Arrow batch, and runs again before the batch goes to Spark.  A poll makes
two to four GC-tracked tuples a record (the backend's decoding, the
``ConsumedRecord``), all alive until the batch is built: with the collector
on, they outlive young collections, are promoted, and set off full
collections that rescan every object of the Python worker (Spark's, ours,
the interpreter's).  Measured in process, 200k records a backend, CPU per
record: Kafka 2,500 ns with the collector on, 1,500 paused per poll;
Northguard 2,200 and 1,100.  The pause is bounded by one poll
(``POLL_RECORDS_MAX`` records, at most a poll timeout of waiting); what the
poll leaves for the collector is collected at the next allocation after it.

Spark's Python worker also runs a full collection after every task
(``pyspark/daemon.py``), rescanning every object the worker holds: some
78,000 once Spark, pyarrow, the SDK and the backends are imported, about
30 ms of CPU a task here, paid by each of the plan's tasks.  So the first
slice a worker reads moves the objects alive then (after one collection) out
of the collector's reach for good (``freeze_worker_heap``, called only from
Spark's ``read``).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import sys
import time
from bisect import bisect_left
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from operator import attrgetter, itemgetter

import pyarrow as pa
import pyarrow.compute as pc

from clients.spark.plan import Slice
from clients.spark.reader_pool import ReaderPool, private_lease
from xinfra.backend import ShardReader
from xinfra.errors import OffsetOutOfRange, Timeout
from xinfra.model import ConsumedRecord, mirrored_position

log = logging.getLogger(__name__)

POLL_RECORDS_MAX = 10_000
"""Records per backend poll, hence per Arrow batch handed to Spark."""
POLL_TIMEOUT_S = 1.0
STALL_S_MAX = 60.0
"""How long a task waits on a shard that yields nothing though its planned end is not reached."""

_BY_OFFSET = attrgetter("offset")
_MS = pa.timestamp("ms", tz="UTC")
_US = pa.timestamp("us", tz="UTC")
HEADER_TYPE = pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))


def arrow_schema(include_headers: bool) -> pa.Schema:
    fields = [pa.field("key", pa.binary()), pa.field("value", pa.binary())]
    if include_headers:
        fields.append(pa.field("headers", HEADER_TYPE))
    fields += [
        pa.field("topic", pa.string()),
        pa.field("epoch", pa.int32()),
        pa.field("shard", pa.int32()),
        pa.field("offset", pa.int64()),
        pa.field("timestamp", _US),
    ]
    return pa.schema(fields)


_worker_heap_frozen = False


def freeze_worker_heap() -> None:
    """Once per process: collect, then ``gc.freeze()`` what is alive (module docstring: why).

    Only in a process Spark started for Python work (its ``__main__`` is
    ``pyspark.daemon`` or a ``pyspark`` worker module): the executors' workers
    and the planner's (Spark's daemon collects after each of their calls too),
    never an application's own process.  What it keeps beyond its time:
    objects alive at the first call that die later inside a reference cycle,
    once per worker.
    """
    global _worker_heap_frozen
    if _worker_heap_frozen:
        return
    _worker_heap_frozen = True
    main = getattr(sys.modules.get("__main__"), "__spec__", None)
    if main is None or not main.name.startswith("pyspark."):
        return
    gc.collect()
    gc.freeze()


def read_slice(
    piece: Slice,
    include_headers: bool,
    fail_on_data_loss: bool,
    pool: ReaderPool | None = None,
) -> Iterator[pa.RecordBatch]:
    """The records of ``piece`` as Arrow batches, read on the task's thread.

    With a ``pool`` (Spark's ``read`` passes its worker's), the reader comes
    from it and goes back to it once the slice is read to its end; without,
    the read opens and closes its own event loop, backend and reader.
    """
    lease = pool.lease(piece) if pool is not None else private_lease(piece)
    reusable = False
    try:
        columns = _Columns(piece, include_headers)
        lease.reader.assign({piece.shard: piece.start})
        cursor = _Cursor(piece, fail_on_data_loss)
        while cursor.next < piece.end:
            batch = _next_batch(lease.loop, cursor, lease.reader, columns)
            if batch is not None:
                yield batch
        reusable = True
    finally:
        lease.release(reusable)


def _next_batch(
    loop: asyncio.AbstractEventLoop, cursor: _Cursor, reader: ShardReader, columns: _Columns
) -> pa.RecordBatch | None:
    """One poll as one Arrow batch (None when it brought nothing), the collector paused for it.

    The poll's records die when this returns, before the batch is handed on.
    """
    with _collector_paused():
        records = loop.run_until_complete(cursor.poll(reader))
        return columns.batch(records) if records else None


def _collector_paused() -> AbstractContextManager[None]:
    """Disable the cyclic collector for the block, if it is on (module docstring: why).

    Process-wide state: a thread that turns the collector off or on meanwhile
    may see it turned on again at the block's end (a cost, never a wrong result).
    """
    return _Paused() if gc.isenabled() else nullcontext()


class _Paused:
    def __enter__(self) -> None:
        gc.disable()

    def __exit__(self, *_exc: object) -> None:
        gc.enable()


class _Cursor:
    """Where the task is in its slice, and what to do when the shard stops yielding."""

    def __init__(
        self,
        piece: Slice,
        fail_on_data_loss: bool,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.piece = piece
        self.next = piece.start
        self.fail_on_data_loss = fail_on_data_loss
        self.in_mirror = piece.mirror is not None
        self.clock = clock
        self.sleep = sleep
        self.idle_since = clock()

    async def poll(self, reader: ShardReader) -> list[ConsumedRecord]:
        piece = self.piece
        try:
            # No more than the slice still holds: a backend may wait to fill a poll (librdkafka
            # does), and a poll asking for exactly what is left returns as soon as it is there.
            wanted = max(1, min(POLL_RECORDS_MAX, piece.end - self.next))
            raw = await reader.poll(wanted, POLL_TIMEOUT_S)
        except OffsetOutOfRange:
            # Below the shard's first retained offset (retention) or past its end (records
            # lost on the cluster): ``_idle`` decides both.
            at = self.next
            await self._idle(reader)
            if self.next == at:
                # Refused, yet the shard's offsets say it holds ``next`` (the listing lags the
                # fetch that saw a deletion, or the refusal was transient).  A refusal comes back
                # at once: wait a poll's timeout, as an empty poll would, before asking again, so
                # this is no busy loop and the stall timeout is reached in time; re-assigning
                # restarts a fetcher the error stopped (librdkafka's does stop).
                reader.assign({piece.shard: self.next})
                await self.sleep(POLL_TIMEOUT_S)
            return []
        kept = self._mirror_skipped(raw) if self.in_mirror else self._in_range(raw)
        if raw:
            self.idle_since = self.clock()
        elif self.next < piece.end:
            await self._idle(reader)
        return kept

    def _in_range(self, raw: list[ConsumedRecord]) -> list[ConsumedRecord]:
        """The records of ``raw`` in [next, end), found by bisection: a poll of one shard is in
        offset order, so no per-record Python is needed."""
        if not raw:
            return raw
        end = self.piece.end
        low = 0 if raw[0].offset >= self.next else bisect_left(raw, self.next, key=_BY_OFFSET)
        high = len(raw) if raw[-1].offset < end else bisect_left(raw, end, key=_BY_OFFSET)
        kept = raw if low == 0 and high == len(raw) else raw[low:high]
        if high < len(raw):
            self.next = end
        elif kept:
            self.next = kept[-1].offset + 1
        return kept

    def _mirror_skipped(self, raw: list[ConsumedRecord]) -> list[ConsumedRecord]:
        """Like ``_in_range``, record by record, skipping the mirrored prefix of a migration target."""
        piece = self.piece
        assert piece.mirror is not None
        kept: list[ConsumedRecord] = []
        for record in raw:
            offset = record.offset
            if offset < self.next:
                continue
            if offset >= piece.end:
                self.next = piece.end
                break
            self.next = offset + 1
            if self.in_mirror:
                mirrored = mirrored_position(record.headers)
                if (
                    mirrored is not None
                    and mirrored.epoch == piece.mirror[0]
                    and mirrored.offset < piece.mirror[1]
                ):
                    continue  # read from the source epoch already
                self.in_mirror = False
            kept.append(record)
        return kept

    async def _check_retained(self, reader: ShardReader) -> None:
        """The shard's first retained record is past ``next``: fail, or skip to it."""
        piece = self.piece
        retained = (await reader.start_offsets([piece.shard]))[piece.shard]
        if retained <= self.next:
            return
        message = (
            f"{min(retained, piece.end) - self.next} records of {piece.topic!r} epoch {piece.epoch} "
            f"shard {piece.shard} (from offset {self.next}) were removed by retention while "
            "the query read them"
        )
        if self.fail_on_data_loss:
            raise OffsetOutOfRange(
                f"{message}; set option 'failOnDataLoss' to false to skip them and go on"
            )
        log.warning("%s; skipped (failOnDataLoss is false)", message)
        self.next = min(retained, piece.end)
        self.idle_since = self.clock()  # the cursor moved: progress, for the stall timeout
        reader.assign({piece.shard: self.next})

    async def _idle(self, reader: ShardReader) -> None:
        piece = self.piece
        await self._check_retained(reader)
        if self.next >= piece.end:
            return
        high = (await reader.end_offsets([piece.shard]))[piece.shard]
        if high <= self.next:
            message = (
                f"{piece.topic!r} epoch {piece.epoch} shard {piece.shard} ends at {high}, "
                f"below the planned end {piece.end}: records were lost on the cluster"
            )
            if self.fail_on_data_loss:
                raise OffsetOutOfRange(
                    f"{message}; set option 'failOnDataLoss' to false to skip them and go on"
                )
            log.warning("%s; skipped (failOnDataLoss is false)", message)
            self.next = piece.end
            return
        if self.clock() - self.idle_since > STALL_S_MAX:
            raise Timeout(
                f"{piece.topic!r} epoch {piece.epoch} shard {piece.shard} yielded nothing for "
                f"{STALL_S_MAX:.0f} s at offset {self.next} (planned end {piece.end}, high "
                f"watermark {high}); check the cluster {piece.physical_topic!r} lives on"
            )


class _Columns:
    """Builds a slice's Arrow batches: one pass per column over a poll's records, no row objects.

    ``zip(*records)`` would build a tuple per field of every record (half a
    microsecond a record here); ``map(itemgetter(i))`` copies references only.
    The topic, epoch and shard columns are the same for every row of a slice:
    built once at the largest poll and sliced (no copy) to each batch.  So is
    the offset column when a poll's offsets are contiguous (the rule on one
    shard: first + 0..n-1, one vectorised add, about 8 ns a record against 50
    to 90 ns for an array of Python ints); gaps (a compacted Kafka topic, a
    skipped mirror prefix) take the per-record path.
    """

    def __init__(self, piece: Slice, include_headers: bool) -> None:
        self.schema = arrow_schema(include_headers)
        self.include_headers = include_headers
        self.constants = _constant_columns(piece.topic, piece.epoch, piece.shard)
        self.steps = _STEPS

    def batch(self, records: list[ConsumedRecord]) -> pa.RecordBatch:
        count = len(records)
        columns = [
            pa.array(list(map(_KEY, records)), pa.binary()),
            pa.array(list(map(_VALUE, records)), pa.binary()),
        ]
        if self.include_headers:
            columns.append(
                pa.array(
                    [[{"key": k, "value": v} for k, v in r.headers] for r in records],
                    type=HEADER_TYPE,
                )
            )
        # ms to us by two casts (Arrow scales in C): ~10 ns a record less than a multiply.
        timestamps = pa.array(list(map(_TIMESTAMP_MS, records)), pa.int64()).cast(_MS).cast(_US)
        columns += [constant.slice(0, count) for constant in self.constants]
        first = records[0].offset
        if count <= POLL_RECORDS_MAX and records[-1].offset - first == count - 1:
            # Offsets strictly increase within a poll of one shard, so a span of count - 1
            # means first, first + 1, ..., with no gap.
            offsets = pc.add(self.steps.slice(0, count), first)
        else:
            offsets = pa.array(list(map(_OFFSET, records)), pa.int64())
        columns += [offsets, timestamps]
        return pa.RecordBatch.from_arrays(columns, schema=self.schema)


_STEPS = pa.array(range(POLL_RECORDS_MAX), pa.int64())


@functools.lru_cache(maxsize=16)
def _constant_columns(topic: str, epoch: int, shard: int) -> tuple[pa.Array, pa.Array, pa.Array]:
    """The topic, epoch and shard columns of a largest poll, kept for the next slice of the same
    shard in this Python worker (Spark reuses workers): about 2 ms to build, 200 kB each."""
    return (
        pa.array([topic] * POLL_RECORDS_MAX, pa.string()),
        pa.array([epoch] * POLL_RECORDS_MAX, pa.int32()),
        pa.array([shard] * POLL_RECORDS_MAX, pa.int32()),
    )


_OFFSET = itemgetter(1)
_TIMESTAMP_MS = itemgetter(2)
_KEY = itemgetter(3)
_VALUE = itemgetter(4)
