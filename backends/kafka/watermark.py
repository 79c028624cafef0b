"""End offsets read from a Fetch response's high watermark, not only from ListOffsets.

Why.  Kafka's answer to "where does this partition end" is ListOffsets
(latest).  Some Kafka-protocol brokers get it wrong: tansu 0.6.0 answers the
*base offset of the last batch + 1*, short by the rest of that batch, and
sealing an epoch at a short end offset would make readers skip records.  The
high watermark in a Fetch response is right on every broker measured, and on
Kafka it is the very definition of the end offset.

How.  ListOffsets gives ``listed`` per partition (one request for all).  For
every partition with ``listed > 0`` the probe consumer fetches from
``listed - 1``: on Kafka that is the last record, on tansu the first record of
the last batch; either way the fetch returns at least one record, and the
response carries the high watermark, which librdkafka caches before it hands
out the record.  The answer is ``max(listed, fetched high watermark)``.

Right on Kafka too.  Both values are end offsets the partition had during the
call, and the high watermark never moves back, so the larger one is the
fresher true answer.  When a partition's probe fetch fails or does not come
back in time (retention removed ``listed - 1``, a slow broker) its answer
falls back on ``listed``: Kafka's own contract.

Cost.  One extra fetch round trip per ``end_offsets`` call, of at most one
batch per partition (``max.partition.fetch.bytes`` is 1 byte, and Kafka still
returns one whole batch).  ``end_offsets`` is control-plane (seal, seek to
end, lag), never per record.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Final

from confluent_kafka import Consumer, KafkaError, TopicPartition

from backends.kafka.config import NO_SETTINGS, reader_config
from backends.kafka.errors import to_xinfra
from xinfra.backend import ReaderOptions

log = logging.getLogger(__name__)

PROBE_FETCH_BYTES: Final = 1
"""Per-partition fetch size of the probe: the broker still sends one whole batch."""

PROBE_RECORDS_MAX: Final = 1000
"""Records one probe ``consume`` takes; only the first per partition matters."""


class WatermarkProbe:
    """A private consumer that learns high watermarks by fetching one batch per partition.

    Thread-safe: calls are serialised by a lock, as the probe's assignment is
    its only state.
    """

    def __init__(
        self, bootstrap: str, topic: str, connection: Mapping[str, str] = NO_SETTINGS
    ) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.connection = connection
        self._lock = threading.Lock()
        self._consumer: Consumer | None = None
        self._closed = False

    def _open(self) -> Consumer:
        if self._consumer is None:
            config = reader_config(
                self.bootstrap, ReaderOptions(fetch_bytes_max=1 << 20), self.connection
            )
            config["max.partition.fetch.bytes"] = PROBE_FETCH_BYTES
            config["fetch.wait.max.ms"] = 10
            self._consumer = Consumer(config)
        return self._consumer

    def high_watermarks(self, listed: Mapping[int, int], timeout_s: float) -> dict[int, int]:
        """``max(listed, fetched high watermark)`` per partition; blocking, at most ``timeout_s``."""
        answers = dict(listed)
        wanted = {shard for shard, offset in listed.items() if offset > 0}
        if not wanted:
            return answers
        with self._lock:
            if self._closed:
                return answers
            consumer = self._open()
            consumer.assign(
                [TopicPartition(self.topic, shard, listed[shard] - 1) for shard in sorted(wanted)]
            )
            try:
                fetched = self._fetch_one_each(consumer, wanted, timeout_s)
                for shard in fetched:
                    _, high = consumer.get_watermark_offsets(
                        TopicPartition(self.topic, shard), cached=True
                    )
                    if high is not None and high > answers[shard]:
                        answers[shard] = high
            finally:
                consumer.unassign()
        return answers

    def _fetch_one_each(self, consumer: Consumer, wanted: set[int], timeout_s: float) -> set[int]:
        """The partitions a fetch answered (with a record) before the deadline."""
        fetched: set[int] = set()
        failed: set[int] = set()
        deadline = time.monotonic() + timeout_s
        while fetched | failed != wanted:
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                log.debug(
                    "kafka %s: no fetch answer for %s/%s in time; using ListOffsets",
                    self.bootstrap,
                    self.topic,
                    sorted(wanted - fetched - failed),
                )
                break
            for message in consumer.consume(PROBE_RECORDS_MAX, min(left_s, 0.5)):
                shard = message.partition()
                if shard is None:
                    continue
                error: KafkaError | None = message.error()
                if error is None:
                    fetched.add(shard)
                else:
                    failed.add(shard)
                    log.debug("%s", to_xinfra(error, self.bootstrap, "probing the high watermark"))
        return fetched

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._consumer is not None:
                self._consumer.close()
                self._consumer = None
