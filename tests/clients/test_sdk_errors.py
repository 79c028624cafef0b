"""Bad input gives a clear exception at once, and the SDK's own retries produce nothing twice.

Unknown topic, unknown virtual cluster, bad or revoked token, shard out of
range, oversized record, the service unreachable at start: each one raises the
``xinfra.errors`` exception that names it, with a message that says what to do.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import pytest
from sdk_live import ADMIN_TOKEN, VC, LiveService, needs_kafka, read_all
from waiting import wait_until

from clients import (
    XinfraConsumerOptions,
    XinfraProducerOptions,
    connect_producer,
    open_consumer,
    open_producer,
)
from xinfra.errors import (
    Backpressure,
    Forbidden,
    NotFound,
    RecordTooLarge,
    ShardOutOfRange,
    TopicNotFound,
    Unauthenticated,
    Unavailable,
)
from xinfra.model import Record
from xinfra.services.ports import free_port

QUICK = XinfraProducerOptions(metadata_timeout_s=1.0)


async def test_service_unreachable_at_start_is_unavailable_naming_the_url() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(Unavailable, match=r"127\.0\.0\.1") as caught:
        await open_producer(url, token="x", virtual_cluster=VC, options=QUICK, topics=["t"])
    assert "XINFRA_METADATA_URL" in caught.value.message
    assert time.monotonic() - started < 30, "the bound is metadata_timeout_s, not forever"
    with pytest.raises(Unavailable):
        await open_consumer(
            url,
            token="x",
            virtual_cluster=VC,
            options=XinfraConsumerOptions(metadata_timeout_s=1.0),
        )


async def test_first_send_without_a_service_is_unavailable_not_a_hang() -> None:
    producer = connect_producer(
        f"http://127.0.0.1:{free_port()}", token="x", virtual_cluster=VC, options=QUICK
    )
    try:
        with pytest.raises(Unavailable):
            await producer.send("t", b"v")
    finally:
        await producer.close()


async def test_unknown_topic_and_unknown_virtual_cluster(live: LiveService) -> None:
    token = await live.client_token("app")
    with pytest.raises(TopicNotFound, match="nope"):
        await open_producer(live.url, token, VC, options=QUICK, topics=["nope"])
    with pytest.raises(TopicNotFound):
        await open_consumer(live.url, token, VC, topics=["nope"])
    with pytest.raises(Forbidden, match="scoped"):
        await open_producer(live.url, token, "elsewhere", options=QUICK)
    with pytest.raises(NotFound):
        await open_producer(live.url, ADMIN_TOKEN, "no-such-vc", options=QUICK)


async def test_bad_and_revoked_tokens_are_unauthenticated(live: LiveService) -> None:
    with pytest.raises(Unauthenticated):
        await open_producer(live.url, "not-a-token", VC, options=QUICK)
    token = await live.client_token("short-lived")
    producer = await open_producer(live.url, token, VC, options=QUICK)
    await producer.close()
    await live.revoke_token("short-lived")
    with pytest.raises(Unauthenticated):
        await open_consumer(live.url, token, VC)


@needs_kafka
async def test_shard_out_of_range_and_oversized_record_queue_nothing(
    live: LiveService, kafka: str, cleanup: list[Any]
) -> None:
    await live.create_topic("small", kafka, 2)
    token = await live.client_token("app")
    options = XinfraProducerOptions(record_bytes_max=1000)
    producer = await open_producer(live.url, token, VC, options=options, topics=["small"])
    cleanup.append(producer)
    with pytest.raises(ShardOutOfRange, match=r"shard 2 .* 2 shards"):
        await producer.send("small", b"v", shard=2)
    with pytest.raises(ShardOutOfRange):
        await producer.send("small", b"v", shard=-1)
    with pytest.raises(RecordTooLarge, match="record_bytes_max=1000"):
        await producer.send("small", b"x" * 1001)
    with pytest.raises(RecordTooLarge):
        await producer.send("small", b"x" * 600, key=b"k" * 401)
    ok = await producer.produce("small", b"fits", shard=1)
    assert (ok.epoch, ok.shard) == (0, 1)
    await producer.flush()

    consumer = await open_consumer(live.url, token, VC)
    cleanup.append(consumer)
    await consumer.assign("small")
    records = await read_all(consumer, 1)
    assert [r.value for r in records] == [b"fits"], "nothing refused may be stored"
    with pytest.raises(ShardOutOfRange):
        await consumer.assign("small", [5])


@needs_kafka
async def test_revoked_token_stops_a_running_producer_and_consumer(
    live: LiveService, kafka: str, cleanup: list[Any]
) -> None:
    await live.create_topic("guarded", kafka, 1)
    token = await live.client_token("revocable")
    producer = await open_producer(
        live.url, token, VC, options=QUICK, topics=["guarded"], lease_s=1.5
    )
    cleanup.append(producer)
    consumer = await open_consumer(live.url, token, VC, topics=["guarded"], lease_s=1.5)
    cleanup.append(consumer)
    await consumer.assign("guarded")
    await producer.produce("guarded", b"before")
    await live.revoke_token("revocable")

    async def producer_refused() -> bool:
        try:
            await producer.send("guarded", b"after")
        except Unauthenticated:
            return True
        return False

    async def consumer_refused() -> bool:
        try:
            await consumer.poll(10, timeout_s=0.05)
        except Unauthenticated:
            return True
        return False

    # The heartbeat (every lease/3) or the long-poll meets the revocation.
    await wait_until(producer_refused, timeout_s=20)
    await wait_until(consumer_refused, timeout_s=20)


@needs_kafka
async def test_retries_against_a_dead_broker_fail_cleanly_and_store_nothing_twice(
    live: LiveService, doomed_kafka: tuple[str, Any], cleanup: list[Any]
) -> None:
    """Records to a broker that went away fail with Timeout after delivery_timeout_s; back-pressure
    bounds what waits; and records acknowledged before appear exactly once."""
    cluster, process = doomed_kafka
    await live.create_topic("fragile", cluster, 1)
    token = await live.client_token("app")
    options = XinfraProducerOptions(
        delivery_timeout_s=3.0, send_timeout_s=0.5, buffer_bytes_max=64 * 1024, linger_ms=1
    )
    producer = await open_producer(live.url, token, VC, options=options, topics=["fragile"])
    cleanup.append(producer)
    acked = [await producer.produce("fragile", f"r{i}".encode(), key=b"k") for i in range(20)]
    consumer = await open_consumer(live.url, token, VC, topics=["fragile"])
    cleanup.append(consumer)
    await consumer.assign("fragile")
    values = Counter(r.value for r in await read_all(consumer, 20))
    assert values == Counter(f"r{i}".encode() for i in range(20)), "acknowledged once each"
    assert [p.offset for p in acked] == sorted(p.offset for p in acked)

    process.stop()
    futures = []
    with pytest.raises(Backpressure, match="buffer_bytes_max"):
        for _ in range(10_000):
            futures.append(await producer.send("fragile", b"x" * 1000, key=b"k"))
    assert producer._buffered_bytes <= options.buffer_bytes_max
    await producer.flush()
    assert futures and all(f.done() for f in futures)
    errors = [f.exception() for f in futures]
    assert all(isinstance(e, Unavailable) for e in errors), {type(e) for e in errors}


@needs_kafka
async def test_direct_writes_to_a_dead_broker_fail_and_free_the_buffer(
    live: LiveService, doomed_kafka: tuple[str, Any], cleanup: list[Any]
) -> None:
    """``send_batch`` calls in flight at once, straight to the backend, when the broker dies:
    each call fails with the backend's error once the delivery deadline passes (the backend
    retried until then; the SDK holds no records to re-send), nothing hangs, and the buffer
    they reserved is free again."""
    cluster, process = doomed_kafka
    await live.create_topic("gone", cluster, 2)
    token = await live.client_token("app")
    options = XinfraProducerOptions(delivery_timeout_s=3.0)
    producer = await open_producer(live.url, token, VC, options=options, topics=["gone"])
    cleanup.append(producer)
    before = await producer.send_batch("gone", [Record(b"before", b"k")])
    assert len(await before) == 1
    process.stop()
    futures = [
        await producer.send_batch("gone", [Record(b"%d" % i, b"k%d" % i) for i in range(j, j + 50)])
        for j in range(0, 500, 50)
    ]
    await producer.flush()
    assert all(f.done() for f in futures)
    errors = [f.exception() for f in futures]
    assert all(isinstance(e, Unavailable) for e in errors), {type(e) for e in errors}
    assert producer._buffered_bytes == 0
