"""Reading a range whose last segment is sealed and that has no active segment (real processes).

Topic metadata names the broker a reader streams a range from.  A member broker serves a
range only while it leads its active segment: its mirror of the range's metadata comes with
``lead_segment`` and is lost when its process restarts.  Once a range has no active segment
(its segment sealed on demand, or the range sealed), only the coordinator holds the whole
range: naming the sealed segment's first replica sent readers to a broker that answered
``not_leader`` on every reopen, and a read from offset 0 returned nothing until it gave up.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from ng_harness import backend_for, read_until
from test_ng_cluster import request

from xinfra.backend import ProducerOptions
from xinfra.keyspace import shard_ranges
from xinfra.model import Record

REQUEST_TIMEOUT_S = 10.0
"""The readers' request timeout: a read must end within one, not after retrying forever."""
RECORDS = 5


@pytest.mark.parametrize("brokers", [1, 3])
async def test_a_range_with_no_active_segment_is_read_within_one_request_timeout(
    clusters: Any, brokers: int
) -> None:
    """Two ranges (with three brokers one is led by the coordinator, the other by a member),
    a few records each, every segment sealed on demand; the member that led one restarts (it
    comes back live, knowing nothing of the range).  From offset 0, each range's records
    arrive within one request timeout."""
    processes = clusters(brokers, replication_factor=brokers)
    coordinator = processes[0]
    backend = backend_for(coordinator.url, request_timeout_s=str(REQUEST_TIMEOUT_S))
    try:
        await backend.create_topic("sealed", shard_ranges(2))
        producer = backend.producer("sealed", ProducerOptions(linger_ms=1))
        for n in range(RECORDS):
            await asyncio.gather(
                *(producer.send(s, [Record(value=b"%d-%d" % (s, n))]) for s in range(2))
            )
        await producer.close()
        ranges = request(coordinator, "topic_metadata", name="sealed")["ranges"]
        leaders = sorted(r["leader"] for r in ranges)
        assert leaders == (["1", "2"] if brokers == 3 else ["1", "1"])
        for range_ in ranges:
            request(coordinator, "seal_segment", name="sealed", range_id=range_["range_id"])
        for process in processes[1:]:
            process.kill()
            process.restart()
        status = request(coordinator, "cluster_status")
        assert all(row["live"] for row in status["brokers"])  # so the metadata may name them
        for shard in range(2):
            reader = backend.reader("sealed")
            reader.assign({shard: 0})
            got = await read_until(reader, RECORDS, timeout_s=REQUEST_TIMEOUT_S)
            await reader.close()
            assert [r.value for r in got] == [b"%d-%d" % (shard, n) for n in range(RECORDS)]

        # the ranges go on: a first append reaching the coordinator opens the next segment
        # (led by a live replica of the last, elsewhere: not_leader, and the producer follows)
        producer = backend.producer("sealed", ProducerOptions(linger_ms=1))
        offsets = await asyncio.gather(
            *(producer.send(s, [Record(value=b"%d-%d" % (s, RECORDS))]) for s in range(2))
        )
        await producer.close()
        assert offsets == [[RECORDS], [RECORDS]]
    finally:
        await backend.close()
