"""The Kafka shard reader: a librdkafka consumer that ``assign``s partitions, never joins a group.

Threads.  A poll first takes what librdkafka has already fetched, on the
event loop (``consume`` with no wait does not block): a reader that keeps up
with a busy topic makes no thread hop at all, like a bare loop (a hop is two
thread wake-ups per poll, each of which a busy machine may delay by a
scheduling slice).  When nothing is ready, or an assignment is to be applied,
the waiting ``consume`` runs on one worker thread owned by the reader (a
single-thread executor: polls are serialised, and an assignment is applied
on that same thread just before the consume that follows it).  Offset
queries (``ListOffsets``) are independent requests and run on
``asyncio.to_thread``; librdkafka's handle is thread-safe.

Assignment.  ``assign`` only records the wanted positions and bumps a
generation; the next ``poll`` applies them and consumes.  A poll that was
already running when ``assign`` was called returns records of the old
generation: they are dropped, and nothing is lost because the new assignment
carries explicit offsets.  librdkafka itself purges prefetched records of
partitions no longer assigned (its op versions), so stale data never comes
back later either.

End offsets.  ``end_offsets`` asks the brokers (ListOffsets latest, one
request for all shards), then reads the high watermark of a Fetch response
(``watermark.WatermarkProbe``, see why there) and, for shards this reader
has fetched, the high watermark of its own last Fetch; it answers the
largest.  All are end offsets the partition had during the call and the high
watermark never moves back, so the largest is the freshest true answer, on
Kafka and on brokers whose ListOffsets lags (tansu 0.6.0).  Readers use the
default ``isolation.level=read_committed``: the end offset is the last stable
offset, equal to the high watermark as Xinfra writes no transactions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Final

from confluent_kafka import (
    OFFSET_END,
    Consumer,
    KafkaError,
    KafkaException,
    TopicPartition,
)

from backends.kafka.admin import partition_count
from backends.kafka.config import METADATA_TIMEOUT_S_MAX, NO_SETTINGS, reader_config
from backends.kafka.errors import from_exception, to_xinfra
from backends.kafka.records import to_records
from backends.kafka.watermark import WatermarkProbe
from xinfra.backend import ReaderOptions, ShardReader
from xinfra.errors import InvalidRequest, ShardOutOfRange, XinfraError
from xinfra.model import ConsumedRecord

log = logging.getLogger(__name__)

_Consumed = tuple[list[ConsumedRecord], XinfraError | None]
"""What one consume on the worker thread yields: records, and an error to report after them."""

POLL_RECORDS_MAX: Final = 100_000
"""The most records one ``poll`` may return (librdkafka allows up to 1M per consume)."""

CONSUME_CHUNK_RECORDS: Final = 128
"""librdkafka messages taken per ``consume`` call, each chunk converted and dropped at once.

Why chunks.  A ``Message`` is a GC-tracked object.  Taken 10k at a time, the
messages outlive several young collections while they are converted, get
promoted, and feed the full collections that then rescan every record the
application holds (measured: the collector took more time than the
conversion).  Why 128, not 256: a young collection resets the collector's
allocation count, so the messages of the chunk being converted, which die
after it, are never counted off; the smaller the chunk, the fewer such lost
decrements.  Reading 300k records with the bench's loop: 533 young and 5
full collections with chunks of 256, 427 and 4 with 128 (and 32), against
390 and 4 for a bare consumer holding its messages.  A ``consume`` call
costs a few microseconds: a few hundredths of a microsecond per record.

Waiting.  ``consume(n, timeout)`` returns when it has *n* messages or the
timeout passed, not when the first arrives: a poll asking for 256 with 10
records ready returned them only after its whole ``timeout_s`` (measured:
``poll(1000, timeout_s=2.0)`` answered 10 records after 2.0 s).  So a poll
first takes what is ready without waiting, and when nothing is, waits for
one record only, then takes what came with it."""

OFFSET_EARLIEST_QUERY: Final = -2
"""``offsets_for_times`` with this timestamp asks ListOffsets for the earliest offset."""
OFFSET_LATEST_QUERY: Final = -1
"""``offsets_for_times`` with this timestamp asks ListOffsets for the latest offset."""


class KafkaShardReader(ShardReader):
    """Reads assigned partitions of one Kafka topic; see the module docstring."""

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        options: ReaderOptions,
        request_timeout_s: float,
        on_close: Callable[[KafkaShardReader], None] | None = None,
        connection: Mapping[str, str] = NO_SETTINGS,
    ) -> None:
        self.topic = topic
        self._on_close = on_close
        self.bootstrap = bootstrap
        self.request_timeout_s = request_timeout_s
        self._down: KafkaError | None = None
        self._consumer = Consumer(
            {**reader_config(bootstrap, options, connection), "error_cb": self._on_error}
        )
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"kafka-reader-{topic}")
        self._probe = WatermarkProbe(bootstrap, topic, connection)
        self._partitions: int | None = None
        self._generation = 0
        self._pending: dict[int, int] | None = None
        self._assigned: dict[int, int] = {}
        self._deferred: XinfraError | None = None
        self._buffer: list[ConsumedRecord] = []
        self._record_type, self._record_prefix = options.record_type, options.record_prefix
        self._in_flight: tuple[int, dict[int, int] | None, asyncio.Future[_Consumed]] | None = None
        self._closed = False

    # -- assignment and polling ----------------------------------------------------------------

    def assign(self, positions: Mapping[int, int]) -> None:
        self._check_open()
        wanted = dict(positions)
        for shard, offset in wanted.items():
            if shard < 0 or (self._partitions is not None and shard >= self._partitions):
                raise self._out_of_range(shard)
            if offset < 0:
                raise InvalidRequest(f"offset {offset} for shard {shard} is negative")
        self._generation += 1
        self._pending = wanted
        self._assigned = wanted
        self._deferred = None
        self._buffer = []

    async def poll(self, max_records: int = 1000, timeout_s: float = 1.0) -> list[ConsumedRecord]:
        self._check_open()
        if not 1 <= max_records <= POLL_RECORDS_MAX:
            raise InvalidRequest(f"max_records must be 1..{POLL_RECORDS_MAX}, got {max_records}")
        if self._buffer:
            return self._take(max_records)
        if self._deferred is not None:
            deferred, self._deferred = self._deferred, None
            raise deferred
        if self._in_flight is None and self._pending is None:
            # What librdkafka holds already is taken here, on the loop: no thread hop.
            records, error = self._consume(max_records, None)
            if records or error is not None:
                return self._deliver(records, error, max_records)
        if self._in_flight is None:
            # A poll cancelled while librdkafka consumed leaves its consume in flight: the
            # next poll picks its records up instead of losing them.
            generation, pending = self._generation, self._pending
            self._pending = None
            consumed = asyncio.wrap_future(
                self._executor.submit(
                    self._poll_blocking, pending, max_records, max(0.0, timeout_s)
                )
            )
            self._in_flight = (generation, pending, consumed)
        generation, pending, consumed = self._in_flight
        try:
            records, error = await asyncio.shield(consumed)
        except asyncio.CancelledError:
            if consumed.cancelled():
                self._in_flight = None
            raise
        except BaseException:
            self._in_flight = None
            if pending is not None and self._generation == generation:
                self._pending = pending  # not applied: the next poll tries again
            raise
        self._in_flight = None
        if self._generation != generation:
            return []  # assign() ran meanwhile: these belong to the old assignment
        return self._deliver(records, error, max_records)

    def _deliver(
        self, records: list[ConsumedRecord], error: XinfraError | None, max_records: int
    ) -> list[ConsumedRecord]:
        """The records of one consume, up to ``max_records``; its error now, or after them."""
        if error is not None:
            if not records:
                raise error
            self._deferred = error
        self._buffer = records
        return self._take(max_records)

    def _take(self, max_records: int) -> list[ConsumedRecord]:
        """Up to ``max_records`` of the buffered records (a carried-over consume may hold more)."""
        if len(self._buffer) <= max_records:
            taken, self._buffer = self._buffer, []
        else:
            taken, self._buffer = self._buffer[:max_records], self._buffer[max_records:]
        return taken

    def _poll_blocking(
        self, pending: dict[int, int] | None, max_records: int, timeout_s: float
    ) -> _Consumed:
        """Runs on the reader's worker thread: apply a new assignment, then consume."""
        if pending is not None:
            self._apply(pending)
        return self._consume(max_records, timeout_s)

    def _consume(self, max_records: int, timeout_s: float | None) -> _Consumed:
        """Up to ``max_records``: what is ready, or when nothing is, the first within ``timeout_s``.

        ``None``: take what is ready and never block, which is how ``poll``
        calls it on the event loop; nothing ready is then no answer yet (a
        cluster found down is reported by the waiting consume that follows,
        on the worker thread).
        """
        consume = self._consumer.consume
        chunk = min(max_records, CONSUME_CHUNK_RECORDS)
        messages = consume(chunk, 0)  # what is ready, without waiting
        if not messages and timeout_s:
            # librdkafka's consume waits for its whole count: wait for one record, never more.
            chunk = 1
            messages = consume(chunk, timeout_s)
        cls, prefix = self._record_type, self._record_prefix
        records, failed = to_records(messages, cls, prefix)
        while len(messages) == chunk and not failed and len(records) < max_records:
            chunk = min(max_records - len(records), CONSUME_CHUNK_RECORDS)
            del messages  # dropped before the next chunk is made
            messages = consume(chunk, 0)
            more, failed = to_records(messages, cls, prefix)
            records += more
        error: XinfraError | None = None
        if failed:
            message = failed[0]
            kafka_error = message.error()
            assert kafka_error is not None
            error = to_xinfra(
                kafka_error, self.bootstrap, f"reading {self.topic}/{message.partition()}"
            )
        if records:
            self._down = None
        elif error is None and self._down is not None and timeout_s is not None:
            down, self._down = self._down, None
            error = to_xinfra(down, self.bootstrap, f"reading {self.topic!r}")
        return records, error

    def _apply(self, positions: dict[int, int]) -> None:
        """Assign first, then check the shards against the partition count.

        The first fetch does not wait behind the metadata request: librdkafka
        connects, finds the leaders and fetches while the count is read (a
        new client's first metadata answer took ~50 ms here, as long as the
        whole first fetch).  A shard out of range is unassigned again before
        any record is consumed; librdkafka reports nothing for a partition
        that does not exist, it only waits for it.
        """
        if not positions:
            self._consumer.unassign()
            return
        self._consumer.assign(
            [TopicPartition(self.topic, shard, offset) for shard, offset in positions.items()]
        )
        try:
            count = self._partition_count()
            for shard in positions:
                if shard >= count:
                    raise self._out_of_range(shard)
        except BaseException:
            self._consumer.unassign()
            raise

    def _on_error(self, error: KafkaError) -> None:
        """librdkafka's error callback: remember that every broker is down, log the rest."""
        if error.code() == KafkaError._ALL_BROKERS_DOWN:
            self._down = error
        log.debug("kafka %s: reader for %r: %s", self.bootstrap, self.topic, error)

    # -- offsets -------------------------------------------------------------------------------

    async def start_offsets(self, shards: Sequence[int] | None = None) -> dict[int, int]:
        self._check_open()
        return await asyncio.to_thread(self._list_offsets, shards, OFFSET_EARLIEST_QUERY)

    async def end_offsets(self, shards: Sequence[int] | None = None) -> dict[int, int]:
        self._check_open()
        return await asyncio.to_thread(self._end_offsets_blocking, shards)

    def _end_offsets_blocking(self, shards: Sequence[int] | None) -> dict[int, int]:
        listed = self._list_offsets(shards, OFFSET_LATEST_QUERY)
        answers = self._probe.high_watermarks(listed, self.request_timeout_s)
        for shard, offset in answers.items():
            fetched = self._fetched_high_watermark(shard)
            if fetched > offset:
                answers[shard] = fetched
        return answers

    async def offset_for_timestamp(self, shard: int, timestamp_ms: int) -> int:
        self._check_open()
        if timestamp_ms < 0:
            raise InvalidRequest(f"timestamp {timestamp_ms} ms is negative")
        found = await asyncio.to_thread(self._list_offsets, [shard], timestamp_ms)
        offset = found[shard]
        if offset < 0:  # no record at or after the timestamp yet
            return (await self.end_offsets([shard]))[shard]
        return offset

    def _fetched_high_watermark(self, shard: int) -> int:
        """The high watermark of the last Fetch response for the shard, or -1 when none came."""
        if shard not in self._assigned:
            return -1
        try:
            _, high = self._consumer.get_watermark_offsets(
                TopicPartition(self.topic, shard), cached=True
            )
        except KafkaException:
            return -1
        return high if high is not None and high >= 0 else -1

    def _list_offsets(self, shards: Sequence[int] | None, query: int) -> dict[int, int]:
        """One ListOffsets request for the shards: ``query`` is a timestamp, -1 latest, -2 earliest."""
        count = self._partition_count()
        wanted = list(range(count)) if shards is None else list(shards)
        for shard in wanted:
            if not 0 <= shard < count:
                raise self._out_of_range(shard)
        if not wanted:
            return {}
        what = f"listing offsets of {self.topic!r}"
        try:
            answers = self._consumer.offsets_for_times(
                [TopicPartition(self.topic, shard, query) for shard in wanted],
                timeout=self.request_timeout_s,
            )
        except KafkaException as exc:
            raise from_exception(exc, self.bootstrap, what) from None
        offsets: dict[int, int] = {}
        for answer in answers:
            if answer.error is not None:
                raise to_xinfra(answer.error, self.bootstrap, what)
            offset = answer.offset
            offsets[answer.partition] = -1 if offset == OFFSET_END else offset
        return offsets

    def _partition_count(self) -> int:
        if self._partitions is None:
            timeout_s = min(self.request_timeout_s, METADATA_TIMEOUT_S_MAX)
            self._partitions = partition_count(
                self._consumer, self.bootstrap, self.topic, timeout_s
            )
        return self._partitions

    def _out_of_range(self, shard: int) -> ShardOutOfRange:
        return ShardOutOfRange(
            f"shard {shard} out of range: topic {self.topic!r} has {self._partitions} shards"
        )

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidRequest(f"reader for {self.topic!r} is closed; open a new one")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._in_flight is not None:  # a cancelled poll's consume: let it finish first
            with contextlib.suppress(Exception):
                await self._in_flight[2]
            self._in_flight = None
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._executor, self._consumer.close)
            await asyncio.to_thread(self._probe.close)
        finally:
            self._executor.shutdown(wait=False)
            if self._on_close is not None:
                self._on_close(self)
