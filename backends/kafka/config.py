"""librdkafka configurations of the Kafka backend, with every bound named and explained.

One place decides how Xinfra talks to Kafka, so that the producer, the reader
and the admin client agree: topics are never created by accident
(``allow.auto.create.topics=false``), no consumer group is joined (readers
``assign``).

Logs.  With a Python ``logger`` librdkafka queues its log lines until the
handle is polled, so only the producer, whose poll thread serves it all the
time, sends them to Python logging.  The admin client and consumers are
polled only when the application calls them; a queue there would grow
without bound while a broker is down and nobody calls, so they keep
librdkafka's direct stderr logging.

librdkafka's own buffers are set *above* the Xinfra bounds: the backend checks
its limits first and raises ``Backpressure`` or ``RecordTooLarge`` before a
record reaches librdkafka, so librdkafka's ``BufferError`` is a bug, not a
designed behaviour.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Final

from xinfra.backend import ProducerOptions, ReaderOptions

LIBRDKAFKA_LOGGER: Final = logging.getLogger("backends.kafka.librdkafka")

NO_SETTINGS: Final[Mapping[str, str]] = MappingProxyType({})
"""A plaintext cluster: no connection settings beyond the bootstrap."""

RECORD_OVERHEAD_BYTES_MAX: Final = 64 << 10
"""Framing a record or batch adds on the wire beyond its payload (headers, varints, batch header)."""

BUFFER_RECORDS_MAX: Final = 1_000_000
"""Unacknowledged records a producer may hold, whatever their size; ``Backpressure`` past it."""

FETCH_WAIT_MS_MAX: Final = 100
"""How long a broker may hold a fetch waiting for data: bounds read latency of new records."""

METADATA_TIMEOUT_S_MAX: Final = 10.0
"""The longest a metadata request (partition count, topic list) may take before ``Timeout``."""

FETCH_QUEUE_BACKOFF_MS: Final = 2
"""How soon a partition's fetcher looks again after pausing on a full prefetch queue.

librdkafka pauses fetching while the queue holds ``queued.max.messages.kbytes``
or ``queued.min.messages``, and looks again only after this backoff; its
default, 1000 ms, leaves a reader that drains the queue idle for up to a
second per refill (measured here: 130k records/s against 850k tuned).  A
few milliseconds cost one queue-length check each, on librdkafka's broker
thread; ``tests/contract/test_reader_prefetch.py`` catches a stall."""

QUEUED_RECORDS_MIN: Final = 100_000
"""``queued.min.messages``: records librdkafka keeps prefetched per partition.

As many as one ``poll`` may return (``POLL_RECORDS_MAX``), so a full poll is
served from memory; with small records the byte bound
(``fetch_bytes_max``) is what usually stops prefetching first."""

LIBRDKAFKA_QUEUE_KBYTES_MAX: Final = 2_097_151
"""librdkafka's ceiling for ``queue.buffering.max.kbytes``."""


CONNECTION_ATTRIBUTES: Final = ("security.protocol", "sasl.", "ssl.")
"""Cluster attributes that are librdkafka connection settings, passed to every client as given."""


def connection_settings(attributes: Mapping[str, str]) -> dict[str, str]:
    """The librdkafka settings among a cluster's attributes: ``security.protocol``, ``sasl.*``, ``ssl.*``.

    How a Kafka cluster wants to be reached (SASL mechanism and credentials,
    TLS trust) is the cluster's, so it is registered with the cluster and
    reaches the admin client, every producer, reader and probe alike.  Other
    attributes (``replication_factor``, ...) are Xinfra's, never librdkafka's.
    """
    return {
        key: value
        for key, value in attributes.items()
        if key == CONNECTION_ATTRIBUTES[0] or key.startswith(CONNECTION_ATTRIBUTES[1:])
    }


def common(bootstrap: str, connection: Mapping[str, str]) -> dict[str, Any]:
    return {
        "bootstrap.servers": bootstrap,
        "allow.auto.create.topics": False,
        "reconnect.backoff.ms": 100,
        "reconnect.backoff.max.ms": 2000,
        **connection,
    }


def producer_config(
    bootstrap: str, options: ProducerOptions, connection: Mapping[str, str] = NO_SETTINGS
) -> dict[str, Any]:
    """An idempotent, ``acks=all`` producer batching by ``linger_ms`` and ``batch_bytes_max``.

    Idempotence keeps each partition's order and drops duplicates when
    librdkafka retries internally, which is what the contract's *Order*
    promise needs.  Every message gets a delivery report within
    ``request_timeout_s`` (``message.timeout.ms``), so every ``send`` future
    resolves.
    """
    timeout_ms = max(1000, int(options.request_timeout_s * 1000))
    message_bytes_max = max(options.record_bytes_max, options.batch_bytes_max)
    queue_kbytes = min(LIBRDKAFKA_QUEUE_KBYTES_MAX, 2 * options.buffer_bytes_max // 1024 + 1024)
    return {
        **common(bootstrap, connection),
        "logger": LIBRDKAFKA_LOGGER,
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": options.linger_ms,
        "batch.size": options.batch_bytes_max,
        "message.max.bytes": message_bytes_max + RECORD_OVERHEAD_BYTES_MAX,
        "queue.buffering.max.kbytes": queue_kbytes,
        "queue.buffering.max.messages": 2 * BUFFER_RECORDS_MAX,
        "message.timeout.ms": timeout_ms,
        "request.timeout.ms": min(timeout_ms, 30_000),
    }


def reader_config(
    bootstrap: str, options: ReaderOptions, connection: Mapping[str, str] = NO_SETTINGS
) -> dict[str, Any]:
    """A consumer that only ``assign``s: a unique group id no one joins, nothing committed.

    ``auto.offset.reset=error`` makes a read from an offset the log no longer
    (or not yet) holds an ``OffsetOutOfRange`` instead of a silent jump.
    ``queued.max.messages.kbytes`` bounds what librdkafka prefetches over all
    assigned partitions by ``fetch_bytes_max``; ``queued.min.messages`` by
    ``QUEUED_RECORDS_MIN``; when either is reached the fetcher pauses for
    ``FETCH_QUEUE_BACKOFF_MS``, not librdkafka's second.
    """
    fetch_kbytes = max(1, options.fetch_bytes_max // 1024)
    return {
        **common(bootstrap, connection),
        "group.id": f"xinfra-reader-{uuid.uuid4().hex}",
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "enable.partition.eof": False,
        "auto.offset.reset": "error",
        "queued.max.messages.kbytes": fetch_kbytes,
        "queued.min.messages": QUEUED_RECORDS_MIN,
        "fetch.queue.backoff.ms": FETCH_QUEUE_BACKOFF_MS,
        "fetch.max.bytes": max(1 << 20, min(options.fetch_bytes_max, 50 << 20)),
        "fetch.wait.max.ms": FETCH_WAIT_MS_MAX,
    }


def admin_config(bootstrap: str, connection: Mapping[str, str] = NO_SETTINGS) -> dict[str, Any]:
    return common(bootstrap, connection)
