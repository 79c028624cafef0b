"""``XinfraConsumer.poll`` rides through broker restarts and reports an outage past its bound.

Issue 10 item 5: a routine Northguard broker restart made ``poll`` raise
``BackendUnavailable``, so ``while True: await consumer.poll()`` crashed.
Retriable errors are now retried inside the consumer, with backoff and
jitter, for up to ``XinfraConsumerOptions.unavailable_s_max``; only an
outage longer than that reaches the application, as the backend's
``Unavailable`` error.

The broker is a real process (``start_northguard_broker``) stopped with
SIGTERM and started again on the same port and data directory while a
consumer task polls without pause; the test waits for the consumer to have
polled across each outage, never for a time.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from sdk_live import (
    LiveService,
    assert_exactly_once,
    assert_per_key_order,
    keyed_value,
    needs_northguard,
    read_all,
)
from waiting import wait_until

from clients import (
    Positions,
    XinfraConsumer,
    XinfraConsumerOptions,
    open_consumer,
    open_producer,
)
from xinfra.errors import Unavailable
from xinfra.model import Record

pytestmark = needs_northguard

RESTARTS = 3
RECORDS_PER_PHASE = 200
SHARDS = 2


@pytest.fixture
def restartable(live: LiveService, tmp_path: Path) -> Iterator[tuple[str, object]]:
    """A Northguard broker process registered as ``ngr``; the test stops and starts it."""
    from backends.northguard.launcher import start_northguard_broker

    process = start_northguard_broker(tmp_path / "ngr-data", log_path=tmp_path / "ngr.log")
    try:
        live.register_cluster("ngr", "northguard", process.url)
        yield "ngr", process
    finally:
        process.stop()


class Poller:
    """Polls without pause in a task of its own, as ``while True: await consumer.poll()`` does."""

    def __init__(self, consumer: XinfraConsumer) -> None:
        self.consumer = consumer
        self.values: list[bytes | None] = []
        self.polls = 0
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            records = await self.consumer.poll(100, timeout_s=0.2)
            self.polls += 1
            self.values += [record.value for record in records]

    async def polled_more(self, polls: int) -> None:
        """Wait until ``polls`` more polls have returned (or the task died: its error surfaces)."""
        target = self.polls + polls
        await wait_until(lambda: self.task.done() or self.polls >= target, timeout_s=60)
        self.check()

    async def read(self, count: int) -> None:
        """Wait until ``count`` records have been read (or the task died: its error surfaces)."""
        await wait_until(lambda: self.task.done() or len(self.values) >= count, timeout_s=60)
        self.check()

    def check(self) -> None:
        if self.task.done():
            self.task.result()  # the poll's exception, if it raised
            raise AssertionError("the polling task ended")

    async def stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


async def produce(live: LiveService, token: str, topic: str, values: list[bytes]) -> None:
    producer = await open_producer(live.url, token, topics=[topic])
    try:
        futures = [await producer.send(topic, value, key=value) for value in values]
        await asyncio.gather(*futures)
    finally:
        await producer.close()


async def test_poll_rides_through_broker_restarts_and_reads_every_record_once(
    live: LiveService, restartable: tuple[str, object]
) -> None:
    cluster, process = restartable
    await live.create_topic("restarts", cluster, SHARDS)
    token = await live.client_token("app")
    consumer = await open_consumer(live.url, token, topics=["restarts"])
    await consumer.assign("restarts")
    poller = Poller(consumer)
    expected: list[bytes] = []
    try:
        for phase in range(RESTARTS + 1):
            values = [f"p{phase}-{i}".encode() for i in range(RECORDS_PER_PHASE)]
            await produce(live, token, "restarts", values)
            expected += values
            await poller.read(len(expected))
            if phase < RESTARTS:
                await asyncio.to_thread(process.stop)  # type: ignore[attr-defined]
                await poller.polled_more(5)  # polled while the broker is down
                await asyncio.to_thread(process.restart)  # type: ignore[attr-defined]
                await poller.polled_more(5)  # and after it came back
        await poller.polled_more(3)  # anything extra would be a duplicate
        poller.check()
    finally:
        await poller.stop()
        await consumer.close()
    assert sorted(poller.values) == sorted(expected), "every record once, none twice"  # type: ignore[type-var]


async def test_a_broker_down_past_the_bound_surfaces_unavailable(
    live: LiveService, restartable: tuple[str, object]
) -> None:
    cluster, process = restartable
    await live.create_topic("outage", cluster, SHARDS)
    token = await live.client_token("app")
    await produce(live, token, "outage", [b"a", b"b", b"c"])
    options = XinfraConsumerOptions(unavailable_s_max=1.0)
    consumer = await open_consumer(live.url, token, options=options, topics=["outage"])
    try:
        await consumer.assign("outage")
        got: list[bytes | None] = []
        while len(got) < 3:
            got += [record.value for record in await consumer.poll(100, timeout_s=0.5)]
        await asyncio.to_thread(process.stop)  # type: ignore[attr-defined]
        empty_polls = 0
        with pytest.raises(Unavailable, match="unavailable_s_max") as caught:
            while empty_polls < 1000:
                assert await consumer.poll(100, timeout_s=0.2) == []
                empty_polls += 1
        assert empty_polls >= 1, "the first failures are retried inside poll, not raised"
        assert caught.value.retriable
    finally:
        await consumer.close()


async def test_send_batch_writes_in_flight_ride_through_a_broker_restart_once_and_in_order(
    live: LiveService, restartable: tuple[str, object]
) -> None:
    """``send_batch`` writes go straight to the Northguard client, many in flight per shard; the
    client, not the SDK, resends what a restart left unacknowledged (same producer id and
    sequence numbers).  Every call resolves, each record is stored once, each key in order."""
    cluster, process = restartable
    await live.create_topic("bulk-restart", cluster, SHARDS)
    token = await live.client_token("app")
    producer = await open_producer(live.url, token, topics=["bulk-restart"])
    calls: list[asyncio.Future[Positions]] = []
    expected: set[bytes] = set()
    try:
        for phase in range(3):
            for start in range(phase * 2000, phase * 2000 + 2000, 100):
                batch = [
                    Record(keyed_value(i % 5, i), b"%d" % (i % 5))
                    for i in range(start, start + 100)
                ]
                expected.update(r.value for r in batch if r.value is not None)
                calls.append(await producer.send_batch("bulk-restart", batch))
            if phase < 2:  # writes of this phase still in flight while the broker goes away
                await asyncio.to_thread(process.restart)  # type: ignore[attr-defined]
        await producer.flush()
        assert all(call.done() for call in calls)
        failed = [call.exception() for call in calls if call.exception() is not None]
        assert not failed, failed[:3]
    finally:
        await producer.close()
    consumer = await open_consumer(live.url, token, topics=["bulk-restart"])
    try:
        await consumer.assign("bulk-restart")
        values = [record.value for record in await read_all(consumer, len(expected))]
    finally:
        await consumer.close()
    assert_exactly_once(values, expected)
    assert_per_key_order(values)
