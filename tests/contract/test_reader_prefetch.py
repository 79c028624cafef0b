"""A reader that overflows its prefetch bound keeps reading: it never idles for a backoff.

Why.  librdkafka pauses a partition's fetcher when its prefetch queue is full
and looks again only after ``fetch.queue.backoff.ms`` (1000 ms by default):
a reader that drains the queue then sits idle until the backoff ends.  The
defect is not an error and loses nothing, so only a measure of idleness
catches it.  The measure here is counted in polls, not seconds: while
records remain to be read, a poll that returns nothing waited its whole
``timeout_s`` with nothing arriving.  A reader that refills its prefetch as
it is drained has (almost) none; one that backs off after each of the
dozens of refills below has several per refill (a 1 s backoff spans ten
0.1 s polls; librdkafka's ``consume`` waits for its count, so the poll that
drains the queue returns short, and the ones after it return nothing).
"""

from __future__ import annotations

from xinfra.backend import Backend, ProducerOptions, ReaderOptions
from xinfra.keyspace import shard_ranges
from xinfra.model import ClusterKind, Record

PREFETCH_BYTES = 64 << 10
"""The reader's prefetch bound (``fetch_bytes_max``), far below what the topic holds."""

RECORD_BYTES = 1024
RECORDS = 6000
"""6 MB: about 90 refills of a 64 KiB prefetch (Kafka), about 20 of a 256 KiB window (Northguard)."""

POLL_RECORDS = 200
POLL_TIMEOUT_S = 0.1
"""Far above a fetch round trip to a local broker, far below the 1 s backoff."""

EMPTY_POLLS_MAX = 10
"""Polls allowed to return nothing while records remain (connecting, a busy neighbour).

A backoff of a second after each refill costs about nine per refill, hundreds in all."""


async def test_a_reader_past_its_prefetch_bound_never_idles(
    backend: Backend, kind: ClusterKind, topic_name: str
) -> None:
    await backend.create_topic(topic_name, shard_ranges(1))
    producer = backend.producer(topic_name, ProducerOptions(linger_ms=5.0))
    value = b"v" * RECORD_BYTES
    sends = [producer.send(0, [Record(value=value)] * 500) for _ in range(RECORDS // 500)]
    offsets = [offset for send in sends for offset in await send]
    await producer.close()
    assert offsets == list(range(RECORDS))

    reader = backend.reader(topic_name, ReaderOptions(fetch_bytes_max=PREFETCH_BYTES))
    reader.assign({0: 0})
    read: list[int] = []
    polls = empty = 0
    try:
        while len(read) < RECORDS and empty <= EMPTY_POLLS_MAX:
            records = await reader.poll(max_records=POLL_RECORDS, timeout_s=POLL_TIMEOUT_S)
            polls += 1
            empty += not records
            read += [record.offset for record in records]
    finally:
        await reader.close()
    assert empty <= EMPTY_POLLS_MAX, (
        f"{kind.value}: {empty} of {polls} polls returned nothing with "
        f"{RECORDS - len(read)} of {RECORDS} records still to read: the reader idles "
        "when its prefetch fills (fetch.queue.backoff.ms?)"
    )
    assert read == offsets
