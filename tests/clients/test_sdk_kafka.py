"""Producer and consumer on the real Kafka backend (tansu) through a live metadata service.

Routing by the keyspace, even spread of keyless records, produce to a shard,
batching limits, back-pressure, flush/close that lose nothing, seeks, pause
and resume, commit hooks, and riding through a metadata service that is down.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections import Counter
from typing import Any

from sdk_live import (
    VC,
    LiveService,
    assert_exactly_once,
    assert_per_key_order,
    keyed_value,
    needs_kafka,
    read_all,
)
from waiting import wait_until

from clients import XinfraProducerOptions, XinfraRecord, open_consumer, open_producer
from clients.sync import SyncConsumer, SyncProducer
from xinfra.keyspace import shard_of_key
from xinfra.model import Position, Record

pytestmark = needs_kafka


async def _clients(
    live: LiveService, cleanup: list[Any], options: XinfraProducerOptions | None = None
) -> tuple[Any, Any]:
    token = await live.client_token(f"app-{len(cleanup)}")
    producer = await open_producer(live.url, token, VC, options=options)
    cleanup.append(producer)
    consumer = await open_consumer(live.url, token, VC)
    cleanup.append(consumer)
    return producer, consumer


async def test_keyed_records_go_to_their_keyspace_shard_in_order(
    live: LiveService, kafka: str, cleanup: list[Any]
) -> None:
    await live.create_topic("orders", kafka, 4)
    producer, consumer = await _clients(live, cleanup, XinfraProducerOptions(batch_records_max=64))
    sent: list[tuple[bytes, bytes, asyncio.Future[Position]]] = []
    for seq in range(1500):
        key = f"{seq % 37}".encode()
        value = keyed_value(seq % 37, seq)
        sent.append((key, value, await producer.send("orders", value, key=key)))
    await producer.flush()
    positions: dict[bytes, Position] = {}
    for key, value, future in sent:
        position = future.result()
        assert position.epoch == 0 and position.shard == shard_of_key(key, 4)
        positions[value] = position
    per_shard: dict[int, list[int]] = {}
    for _key, _value, future in sent:
        per_shard.setdefault(future.result().shard, []).append(future.result().offset)
    for offsets in per_shard.values():
        assert offsets == sorted(offsets) and len(set(offsets)) == len(offsets)

    await consumer.assign("orders")
    records: list[XinfraRecord] = await read_all(consumer, len(sent))
    assert_exactly_once([r.value for r in records], {v for _, v, _ in sent})
    assert_per_key_order([r.value for r in records])
    for record in records:
        assert record.value is not None
        assert record.position == positions[record.value], "a future names the record's position"
        assert record.key is not None and record.topic == "orders"


async def test_keyless_records_spread_evenly_and_produce_to_a_shard(
    live: LiveService, kafka: str, cleanup: list[Any]
) -> None:
    await live.create_topic("events", kafka, 4)
    producer, consumer = await _clients(live, cleanup, XinfraProducerOptions(batch_records_max=50))
    futures = [await producer.send("events", f"e{i}".encode()) for i in range(2000)]
    pinned = [await producer.send("events", f"p{i}".encode(), shard=2) for i in range(100)]
    await producer.flush()
    spread = Counter(f.result().shard for f in futures)
    assert set(spread) == {0, 1, 2, 3}
    assert all(300 <= n <= 700 for n in spread.values()), spread
    assert {f.result().shard for f in pinned} == {2}

    await consumer.assign("events", [2])
    records = await read_all(consumer, spread[2] + 100)
    assert [r.value for r in records if r.value and r.value.startswith(b"p")] == [
        f"p{i}".encode() for i in range(100)
    ], "records to one shard keep their order"


async def test_back_pressure_bounds_memory_and_close_loses_nothing(
    live: LiveService, kafka: str, cleanup: list[Any]
) -> None:
    await live.create_topic("bounded", kafka, 2)
    options = XinfraProducerOptions(buffer_bytes_max=16 * 1024, batch_records_max=20, linger_ms=2)
    producer, consumer = await _clients(live, cleanup, options)
    peak = 0
    futures = []
    for seq in range(3000):
        futures.append(
            await producer.send("bounded", keyed_value(seq % 5, seq), key=b"%d" % (seq % 5))
        )
        peak = max(peak, producer._buffered_bytes)
    assert peak <= options.buffer_bytes_max, "send waits for room instead of buffering more"
    await producer.close()  # flushes: nothing sent before close is lost
    assert all(f.done() and f.exception() is None for f in futures)
    await consumer.assign("bounded")
    records = await read_all(consumer, 3000)
    assert_exactly_once([r.value for r in records], {keyed_value(s % 5, s) for s in range(3000)})
    assert_per_key_order([r.value for r in records])


async def test_seek_to_latest_reads_only_new_records(
    live: LiveService, kafka: str, cleanup: list[Any], xfail_on: Any
) -> None:
    xfail_on("end_offsets")
    await live.create_topic("latest", kafka, 2)
    producer, consumer = await _clients(live, cleanup)
    await producer.send_batch("latest", [Record(b"a%d" % i) for i in range(20)])
    await producer.flush()
    await consumer.assign("latest", start="latest")
    assert await consumer.poll(100, timeout_s=0.3) == []
    later = [await producer.send("latest", b"b%d" % i, shard=i % 2) for i in range(6)]
    await producer.flush()
    got = await read_all(consumer, 6)
    assert sorted(r.value for r in got) == sorted(b"b%d" % i for i in range(6))
    assert {f.result().shard for f in later} == {0, 1}


async def test_seek_to_a_position_and_to_the_beginning_and_pause_resume(
    live: LiveService, kafka: str, cleanup: list[Any]
) -> None:
    await live.create_topic("seeks", kafka, 2)
    producer, consumer = await _clients(live, cleanup)
    first = [await producer.send("seeks", b"a%d" % i, shard=i % 2) for i in range(20)]
    await producer.flush()
    await consumer.assign("seeks")
    await read_all(consumer, 20)
    later = [await producer.send("seeks", b"b%d" % i, shard=i % 2) for i in range(6)]
    await producer.flush()
    got = await read_all(consumer, 6)
    assert sorted(r.value for r in got) == sorted(b"b%d" % i for i in range(6))

    middle = first[10].result()  # shard 0, offset 5
    consumer.seek("seeks", middle)
    got = await read_all(consumer, 8)
    shard0 = [r.value for r in got if r.position.shard == 0]
    assert shard0 == [b"a10", b"a12", b"a14", b"a16", b"a18", b"b0", b"b2", b"b4"]

    await consumer.seek_to_beginning("seeks")
    consumer.pause("seeks", [1])
    got = await read_all(consumer, 13)
    assert {r.position.shard for r in got} == {0}, "a paused shard returns nothing"
    consumer.resume("seeks", [1])
    got = await read_all(consumer, 13)
    assert {r.position.shard for r in got} == {1}
    assert [r.value for r in got][:3] == [b"a1", b"a3", b"a5"], "resume continues from the start"
    assert later[-1].result().shard == 1


async def test_seek_to_timestamp(
    live: LiveService, kafka: str, cleanup: list[Any], xfail_on: Any
) -> None:
    xfail_on("timestamp")
    await live.create_topic("times", kafka, 1)
    producer, consumer = await _clients(live, cleanup)
    now_ms = int(time.time() * 1000)
    for i in range(10):
        await producer.send("times", b"t%d" % i, timestamp_ms=now_ms + i * 1000)
    await producer.flush()
    await consumer.assign("times", start=now_ms + 4500)
    got = await read_all(consumer, 5)
    assert [r.value for r in got] == [b"t5", b"t6", b"t7", b"t8", b"t9"]
    assert got[0].timestamp_ms == now_ms + 5000


async def test_commit_hook_receives_positions_past_polled_records(
    live: LiveService, kafka: str, cleanup: list[Any]
) -> None:
    class Sink:
        def __init__(self) -> None:
            self.commits: list[dict[tuple[str, int], Position]] = []

        async def commit(self, positions: dict[tuple[str, int], Position]) -> None:
            self.commits.append(positions)

    await live.create_topic("commits", kafka, 1)
    token = await live.client_token("committer")
    producer = await open_producer(live.url, token, VC)
    cleanup.append(producer)
    sink = Sink()
    consumer = await open_consumer(live.url, token, VC, commit_sink=sink)
    cleanup.append(consumer)
    for i in range(5):
        await producer.send("commits", b"c%d" % i)
    await producer.flush()
    await consumer.assign("commits")
    got = await read_all(consumer, 5)
    committed = await consumer.commit()
    last = got[-1].position
    assert committed == {("commits", 0): Position(last.epoch, 0, last.offset + 1)}
    assert sink.commits == [committed]


async def test_data_flows_while_the_metadata_service_is_down(
    live: LiveService, kafka: str, cleanup: list[Any]
) -> None:
    await live.create_topic("resilient", kafka, 2)
    producer, consumer = await _clients(live, cleanup)
    await producer.produce("resilient", keyed_value(0, 0), key=b"0")
    await consumer.assign("resilient")
    await read_all(consumer, 1)

    await asyncio.to_thread(live.stop)
    futures = [
        await producer.send("resilient", keyed_value(s % 3, s), key=b"%d" % (s % 3))
        for s in range(1, 301)
    ]
    await producer.flush()
    assert all(f.exception() is None for f in futures), "the service is not on the data path"
    got = await read_all(consumer, 300)
    assert_exactly_once([r.value for r in got], {keyed_value(s % 3, s) for s in range(1, 301)})
    await asyncio.to_thread(live.start)
    # Back on its feet, the service learns the client's version again (heartbeat or long-poll).
    metadata = await live.metadata("resilient")
    assert metadata.version >= 1


def test_blocking_flavours(live: LiveService, kafka: str) -> None:
    with live.admin() as admin:
        admin.create_topic(VC, "blocking", kafka, 2)
        token = admin.request(
            "POST", "/v1/tokens", json={"name": "sync", "role": "client", "scope": VC}
        )["token"]
    with SyncProducer(lambda: open_producer(live.url, token, VC)) as producer:
        futures = [producer.send("blocking", b"s%d" % i, key=b"%d" % i) for i in range(50)]
        producer.flush()
        positions = [f.result(10) for f in futures]
        assert all(p.epoch == 0 for p in positions)
        assert producer.produce("blocking", b"last", shard=1, timeout_s=10).shard == 1
    with SyncConsumer(lambda: open_consumer(live.url, token, VC)) as consumer:
        consumer.assign("blocking")
        got: list[XinfraRecord] = []
        deadline = time.monotonic() + 30
        while len(got) < 51:
            assert time.monotonic() < deadline
            got.extend(consumer.poll(100, 0.5))
        assert sorted(r.value or b"" for r in got) == sorted(
            [b"s%d" % i for i in range(50)] + [b"last"]
        )
        consumer.pause("blocking", [0, 1])
        consumer.resume("blocking", [0])
        assert set(consumer.positions()) == {("blocking", 0), ("blocking", 1)}


async def test_consumer_follows_a_service_that_restarts(
    live: LiveService, kafka: str, cleanup: list[Any]
) -> None:
    await live.create_topic("watched", kafka, 1)
    producer, consumer = await _clients(live, cleanup)
    await consumer.assign("watched")
    await asyncio.to_thread(live.restart)
    await live.call(lambda c: c.update_topic_config(VC, "watched", {"note": "changed"}))
    await wait_until(lambda: consumer._watches["watched"].current.topic.config.get("note"), 30)
    await producer.produce("watched", b"after restart")
    assert [r.value for r in await read_all(consumer, 1)] == [b"after restart"]


async def test_send_batch_routes_each_record_and_resolves_positions_in_order(
    live: LiveService, kafka: str, cleanup: list[Any]
) -> None:
    await live.create_topic("bulk", kafka, 3)
    options = XinfraProducerOptions(batch_records_max=100, buffer_bytes_max=256 * 1024)
    producer, consumer = await _clients(live, cleanup, options)
    calls = []
    for start in range(0, 3000, 500):
        batch = [
            Record(keyed_value(i % 13, i), b"%d" % (i % 13)) for i in range(start, start + 500)
        ]
        calls.append((batch, await producer.send_batch("bulk", batch)))
    await producer.flush()
    expected: dict[bytes, Position] = {}
    for batch, future in calls:
        positions = future.result()
        assert len(positions) == len(batch)
        for record, position in zip(batch, positions, strict=True):
            assert record.key is not None and record.value is not None
            assert position.shard == shard_of_key(record.key, 3)
            expected[record.value] = position
    await consumer.assign("bulk")
    records = await read_all(consumer, 3000)
    assert_exactly_once([r.value for r in records], set(expected))
    assert_per_key_order([r.value for r in records])
    assert all(r.position == expected[r.value] for r in records if r.value is not None)


async def test_send_batch_hands_records_to_the_backend_and_keeps_no_reference(
    live: LiveService, kafka: str, cleanup: list[Any]
) -> None:
    """On a topic with one write epoch, ``send_batch`` writes straight through: every call is in
    flight at once, and once it returns neither the SDK nor the Kafka backend (librdkafka copies
    what it is given) holds a record, so the collector never rescans records awaiting their
    acknowledgement.  Order and positions are those of the calls."""
    await live.create_topic("through", kafka, 2)
    producer, consumer = await _clients(live, cleanup)
    await producer.metadata("through")  # the watch, routing and backend producer made first
    calls = []
    for start in range(0, 2000, 250):
        batch = [Record(keyed_value(i % 7, i), b"%d" % (i % 7)) for i in range(start, start + 250)]
        calls.append((batch, await producer.send_batch("through", batch)))
    for batch, _ in calls:
        holders = [h for h in gc.get_referrers(batch[-1]) if h is not batch]
        assert not holders, f"something besides the caller holds a record: {holders!r:.300}"
    await producer.flush()
    expected: dict[bytes, Position] = {}
    for batch, future in calls:
        for record, position in zip(batch, future.result(), strict=True):
            assert record.value is not None
            expected[record.value] = position
    await consumer.assign("through")
    records = await read_all(consumer, 2000)
    assert_exactly_once([r.value for r in records], set(expected))
    assert_per_key_order([r.value for r in records])
    assert all(r.position == expected[r.value] for r in records)
