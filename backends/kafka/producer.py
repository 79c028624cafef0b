"""The Kafka shard producer: one idempotent librdkafka producer, one future per ``send``.

Hot path, measured on this machine for 100-byte records: ``send`` costs
~0.85 us per record on the event loop (a bare ``Producer.produce`` with a
keyword callback 0.8 us, with a positional one 0.55 us), and each delivery
report ~0.3 us, so one core sustains ~800k records/s before the broker.
``bench/kafka_backend.py`` measures the ratio to a bare loop in the same run.

Delivery reports are served on the event loop, not on a thread of their own:
``send`` polls librdkafka once without waiting, and a timer polls every
``POLL_TICK_S`` while sends are in flight (every ``IDLE_POLL_S`` otherwise, so
errors and logs keep flowing).  A poll thread would take the GIL once per
delivery report (confluent-kafka re-acquires it per callback) and contend
with the loop that is producing: measured, that cost a quarter of the
throughput of a bare loop that polls inline.

* ``send`` checks the whole call up front (shard, record sizes, buffer room)
  and then hands every record to ``Producer.produce`` with the partition set
  explicitly (Kafka's partitioner is never used).  Nothing is queued when a
  check fails.
* One ``_Batch`` per ``send``: librdkafka reports each message; the report
  appends the offset to the batch's list, and nothing else.  After each poll
  the producer settles the batches that are complete, looking only at the
  oldest unsettled batch of each partition (reports come in produce order).
  So an awaiting task wakes once per ``send``, not once per record (M acks
  for N appends), and a record's report costs one list append.
* ``send``'s two passes over the records are C loops (``xinfra._records``):
  ``record_sizes`` (sizes, the largest, whether all are plain: no headers, no
  timestamp) before anything is queued, then ``produce_records`` calling
  ``Producer.produce`` positionally per record.  As Python loops they cost
  ~1.1k instructions per record (callgrind, bench produce loop: 12.3k per
  record with them, 11.2k in C, a bare confluent-kafka loop 10.5k).
* Per-partition order: librdkafka with ``enable.idempotence`` keeps a
  partition's messages in produce order across internal retries and reports
  them in that order, so a batch's offsets arrive sorted; ``_settle`` checks
  it, and relies on it to settle batches in order.

Bounds: ``buffer_bytes_max`` payload bytes and ``BUFFER_RECORDS_MAX`` records
unacknowledged; past either, ``send`` raises ``Backpressure`` at once.

The partition count is read once, when the producer is made (one metadata
request, bounded by ``METADATA_TIMEOUT_S_MAX``), so ``send`` can refuse a
shard out of range synchronously.  Kafka partitions are never removed; if
partitions are added out of band the producer keeps to the count it read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from itertools import islice
from operator import lt
from typing import Any, Final

from confluent_kafka import KafkaError, Message, Producer

from backends.kafka.admin import partition_count
from backends.kafka.config import (
    BUFFER_RECORDS_MAX,
    METADATA_TIMEOUT_S_MAX,
    NO_SETTINGS,
    producer_config,
)
from backends.kafka.errors import from_exception, to_xinfra
from xinfra._records import produce_records, record_sizes
from xinfra.backend import ProducerOptions, ShardProducer
from xinfra.errors import Backpressure, InvalidRequest, RecordTooLarge, ShardOutOfRange, XinfraError
from xinfra.model import Record

log = logging.getLogger(__name__)

POLL_TICK_S: Final = 0.001
"""How often the loop serves delivery reports while sends are in flight (bounds the added latency)."""
IDLE_POLL_S: Final = 0.1
"""How often the loop polls when nothing is in flight: errors and logs still flow, nothing piles up."""


class _Batch:
    """The records of one ``send``: filled by delivery reports, settled when the last arrives."""

    __slots__ = (
        "bytes",
        "count",
        "error",
        "expected",
        "failure",
        "future",
        "offsets",
        "report",
        "settled",
        "shard",
    )

    def __init__(self, shard: int, count: int, size: int, loop: Any) -> None:
        self.shard = shard
        self.count = count  # records sent, for the buffer bound
        self.expected = count  # delivery reports to wait for
        self.bytes = size
        self.offsets: list[int] = []
        self.error: KafkaError | None = None
        self.failure: XinfraError | None = None
        self.future: asyncio.Future[list[int]] = loop.create_future()
        self.settled: asyncio.Future[None] = loop.create_future()
        append = self.offsets.append

        def report(error: KafkaError | None, message: Message) -> None:
            """The delivery report of one record: a closure doing only what each record needs.

            Completion is checked by the producer after each poll, once per
            batch, not here once per record.
            """
            if error is None:
                append(message.offset())  # type: ignore[arg-type]
            else:
                if self.error is None:
                    self.error = error
                append(-1)

        self.report = report

    @property
    def complete(self) -> bool:
        return len(self.offsets) >= self.expected


class KafkaShardProducer(ShardProducer):
    """Sends to the partitions of one Kafka topic; see the module docstring for the hot path."""

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        options: ProducerOptions,
        on_close: Callable[[KafkaShardProducer], None] | None = None,
        connection: Mapping[str, str] = NO_SETTINGS,
    ) -> None:
        self.topic = topic
        self._on_close = on_close
        self.bootstrap = bootstrap
        self.options = options
        self._fatal: XinfraError | None = None
        self._producer = Producer(
            {**producer_config(bootstrap, options, connection), "error_cb": self.note_error}
        )
        timeout_s = min(options.request_timeout_s, METADATA_TIMEOUT_S_MAX)
        try:
            self.partitions = partition_count(self._producer, bootstrap, topic, timeout_s)
        except BaseException:
            self._producer.purge()
            raise
        self._batches: set[_Batch] = set()
        self._in_order: dict[int, deque[_Batch]] = {}
        """Unsettled batches per partition, oldest first: the order their reports arrive in."""
        self._buffered_bytes = 0
        self._buffered_records = 0
        self._closed = False
        self._tick: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        with contextlib.suppress(RuntimeError):  # made outside a loop: ticking starts at send
            self._start_ticking(asyncio.get_running_loop())

    # -- the event loop side ------------------------------------------------------------------

    def send(self, shard: int, records: Sequence[Record]) -> asyncio.Future[list[int]]:
        if self._closed:
            raise InvalidRequest(f"producer for {self.topic!r} is closed; open a new one")
        if self._fatal is not None:
            raise self._fatal
        if not 0 <= shard < self.partitions:
            raise ShardOutOfRange(
                f"shard {shard} out of range: topic {self.topic!r} has {self.partitions} shards "
                f"(0..{self.partitions - 1})"
            )
        loop = self._loop
        if loop is None:
            loop = self._start_ticking(asyncio.get_running_loop())
        count = len(records)
        size, largest, plain = record_sizes(records)  # one C pass; nothing queued yet
        record_bytes_max = self.options.record_bytes_max
        if largest > record_bytes_max:
            raise RecordTooLarge(
                f"record of {largest} bytes exceeds record_bytes_max={record_bytes_max} "
                f"for topic {self.topic!r}; split the value or raise the limit"
            )
        self._check_room(count, size)
        batch = _Batch(shard, count, size, loop)
        if not records:
            batch.future.set_result([])
            batch.settled.set_result(None)
            return batch.future
        self._batches.add(batch)
        self._in_order.setdefault(shard, deque()).append(batch)
        self._buffered_bytes += size
        self._buffered_records += count
        self._produce(batch, records, plain)
        self._poll()  # reports of earlier sends that are ready: no wait, no thread
        self._tick_soon()
        return batch.future

    def _check_room(self, count: int, size: int) -> None:
        buffer_bytes_max = self.options.buffer_bytes_max
        if size > buffer_bytes_max or count > BUFFER_RECORDS_MAX:
            raise InvalidRequest(
                f"one send of {count} records / {size} bytes exceeds the producer buffer "
                f"({BUFFER_RECORDS_MAX} records / buffer_bytes_max={buffer_bytes_max}); split it"
            )
        if (
            self._buffered_bytes + size > buffer_bytes_max
            or self._buffered_records + count > BUFFER_RECORDS_MAX
        ):
            raise Backpressure(
                f"producer for {self.topic!r} holds {self._buffered_records} records / "
                f"{self._buffered_bytes} bytes unacknowledged (limits {BUFFER_RECORDS_MAX} / "
                f"{buffer_bytes_max}); await earlier sends before sending more"
            )

    def _produce(self, batch: _Batch, records: Sequence[Record], plain: bool) -> None:
        topic = self.topic
        shard = batch.shard
        try:
            produce_records(self._producer.produce, topic, shard, batch.report, records, plain)
        except Exception as exc:
            # librdkafka refused a record after the checks passed (its queue is
            # sized above ours, so this is unexpected).  The records already
            # queued still get reports; the batch completes when they have.
            queued: int = getattr(exc, "records_queued", 0)
            error = from_exception(exc, self.bootstrap, f"producing to {topic}/{shard}")
            log.warning("%s", error)
            batch.failure = error
            batch.expected = queued

    def _poll(self) -> None:
        """Serve ready delivery reports, then settle the batches they completed.

        librdkafka reports a partition's records in produce order
        (idempotence), so a partition's batches complete in send order: only
        the oldest of each partition is looked at, once per poll, not once
        per record.
        """
        try:
            self._producer.poll(0)
        finally:
            for shard, waiting in list(self._in_order.items()):
                while waiting and waiting[0].complete:
                    self._settle(waiting.popleft())
                if not waiting:
                    del self._in_order[shard]

    def _settle(self, batch: _Batch) -> None:
        if batch.settled.done():
            return
        batch.settled.set_result(None)
        self._batches.discard(batch)
        self._buffered_bytes -= batch.bytes
        self._buffered_records -= batch.count
        if batch.future.done():  # cancelled by the application; the records may be stored
            return
        if batch.failure is not None:
            batch.future.set_exception(batch.failure)
        elif batch.error is None:
            offsets = batch.offsets
            assert all(map(lt, offsets, islice(offsets, 1, None))), (
                f"offsets of one send to {self.topic}/{batch.shard} not increasing: {offsets}"
            )
            batch.future.set_result(offsets)
        else:
            what = f"producing {batch.expected} records to {self.topic}/{batch.shard}"
            batch.future.set_exception(to_xinfra(batch.error, self.bootstrap, what))

    async def flush(self) -> None:
        pending = [batch.settled for batch in self._batches]
        if pending:
            await asyncio.wait(pending)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self.flush()
        if self._tick is not None:
            self._tick.cancel()
            self._tick = None
        self._poll()
        if self._on_close is not None:
            self._on_close(self)

    # -- polling on the event loop -------------------------------------------------------------

    def _start_ticking(self, loop: asyncio.AbstractEventLoop) -> asyncio.AbstractEventLoop:
        self._loop = loop
        self._tick_soon()
        return loop

    def _tick_soon(self) -> None:
        """Poll within ``POLL_TICK_S``: bring an idle-paced (or no) tick forward."""
        loop = self._loop
        assert loop is not None
        tick = self._tick
        if tick is None or tick.when() > loop.time() + POLL_TICK_S:
            if tick is not None:
                tick.cancel()
            self._tick = loop.call_later(POLL_TICK_S, self._on_tick)

    def _on_tick(self) -> None:
        """Serve delivery reports, errors and logs; again soon while sends are in flight.

        The next tick is scheduled even if this poll raises: a producer whose
        ticking stopped would leave every send in flight unresolved.
        """
        try:
            self._poll()
        finally:
            if self._closed and not self._batches:
                self._tick = None
            else:
                assert self._loop is not None
                self._tick = self._loop.call_later(
                    POLL_TICK_S if self._batches else IDLE_POLL_S, self._on_tick
                )

    def note_error(self, error: KafkaError) -> None:
        """librdkafka's error callback (inside a poll): remember fatal errors, log the rest."""
        if error.fatal():
            self._fatal = to_xinfra(error, self.bootstrap, f"producer for {self.topic!r} failed")
            log.error("%s", self._fatal)
        else:
            log.debug("kafka %s: %s", self.bootstrap, error)
