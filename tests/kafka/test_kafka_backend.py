"""What only the Kafka backend promises: equal ranges, config overrides, one wake per send,
assignment changes during a poll, the reader noticing a dead cluster."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from containers import KAFKA_IS_TANSU

from backends.kafka.backend import KafkaBackend
from backends.kafka.producer import KafkaShardProducer
from backends.kafka.reader import KafkaShardReader
from xinfra.backend import open_backend
from xinfra.errors import BackendUnavailable, InvalidRequest, Timeout, TopicNotFound
from xinfra.keyspace import KEYSPACE_SIZE, KeyRange, shard_ranges
from xinfra.model import ClusterKind, ConsumedRecord, PhysicalCluster, Record
from xinfra.services.kafka import start_kafka

WAIT_S = 30.0


def test_the_entry_point_builds_a_kafka_backend() -> None:
    cluster = PhysicalCluster(name="k", kind=ClusterKind.KAFKA, bootstrap="127.0.0.1:1")
    backend = open_backend(cluster)
    assert isinstance(backend, KafkaBackend)
    assert backend.kind is ClusterKind.KAFKA


async def test_unequal_ranges_are_refused_since_partitions_cannot_express_them(
    kafka_backend: KafkaBackend, topic_name: str
) -> None:
    half = KEYSPACE_SIZE // 2
    unequal = [KeyRange(0, half // 2), KeyRange(half // 2, half), KeyRange(half, KEYSPACE_SIZE)]
    with pytest.raises(InvalidRequest, match="equal key ranges"):
        await kafka_backend.create_topic(topic_name, unequal)
    assert topic_name not in await kafka_backend.list_topics()


async def test_illegal_topic_names_are_refused(kafka_backend: KafkaBackend) -> None:
    for name in ("", "a/b", "x" * 250, ".."):
        with pytest.raises(InvalidRequest, match="topic name"):
            await kafka_backend.create_topic(name, shard_ranges(1))


@pytest.mark.xfail(
    KAFKA_IS_TANSU,
    strict=True,
    reason="tansu 0.6.0 deviation: DescribeConfigs reports a topic's overrides with source "
    "DEFAULT_CONFIG, not DYNAMIC_TOPIC_CONFIG",
)
async def test_describe_reports_topic_config_overrides(
    kafka_backend: KafkaBackend, topic_name: str
) -> None:
    created = await kafka_backend.create_topic(
        topic_name, shard_ranges(2), {"retention.ms": "3600000"}
    )
    assert created.config == {"retention.ms": "3600000"}
    described = await kafka_backend.describe_topic(topic_name)
    assert described.config == created.config


async def test_one_send_wakes_the_event_loop_once(
    kafka_backend: KafkaBackend, topic_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    await kafka_backend.create_topic(topic_name, shard_ranges(1))
    wakes: list[int] = []
    original = KafkaShardProducer._settle

    def counting_settle(self: KafkaShardProducer, batch: object) -> None:
        wakes.append(1)
        original(self, batch)  # type: ignore[arg-type]

    monkeypatch.setattr(KafkaShardProducer, "_settle", counting_settle)
    producer = kafka_backend.producer(topic_name)
    offsets = await producer.send(0, [Record(value=b"v%d" % i) for i in range(2000)])
    assert offsets == list(range(2000))
    assert len(wakes) == 1
    await producer.close()


async def test_records_read_back_are_ordinary_consumed_records(
    kafka_backend: KafkaBackend, topic_name: str
) -> None:
    await kafka_backend.create_topic(topic_name, shard_ranges(1))
    producer = kafka_backend.producer(topic_name)
    await producer.send(0, [Record(value=b"v", key=b"k", headers=(("h", b"1"),), timestamp_ms=5)])
    await producer.close()
    reader = kafka_backend.reader(topic_name)
    reader.assign({0: 0})
    got: list[ConsumedRecord] = []
    deadline = time.monotonic() + WAIT_S
    while not got:
        assert time.monotonic() < deadline
        got = await reader.poll(timeout_s=0.5)
    await reader.close()
    expected = ConsumedRecord(0, 0, 5, b"k", b"v", (("h", b"1"),))
    assert got == [expected]
    assert hash(got[0]) == hash(expected) and repr(got[0]) == repr(expected)
    with pytest.raises(AttributeError):
        got[0].offset = 9  # type: ignore[misc]


async def test_one_send_mixing_plain_keyed_and_stamped_records_keeps_every_field(
    kafka_backend: KafkaBackend, topic_name: str
) -> None:
    """``send`` sizes a batch in one pass and takes the plain path only when no record of it
    carries headers or a timestamp: a stamped or headed record anywhere keeps its fields."""
    await kafka_backend.create_topic(topic_name, shard_ranges(1))
    producer = kafka_backend.producer(topic_name)
    before_ms = int(time.time() * 1000)
    records = [
        Record(value=b"plain"),
        Record(value=None, key=b"key-only"),
        Record(value=b"headed", headers=(("h", b"1"), ("h", b"2"))),
        Record(value=b"stamped", key=b"k", timestamp_ms=7),
        Record(value=b""),
    ]
    assert await producer.send(0, records) == [0, 1, 2, 3, 4]
    await producer.close()
    reader = kafka_backend.reader(topic_name)
    reader.assign({0: 0})
    got: list[ConsumedRecord] = []
    deadline = time.monotonic() + WAIT_S
    while len(got) < len(records):
        assert time.monotonic() < deadline
        got += await reader.poll(timeout_s=0.5)
    await reader.close()
    fields = [(r.key, r.value or None, r.headers) for r in got]
    assert fields == [
        (None, b"plain", ()),
        (b"key-only", None, ()),
        (None, b"headed", (("h", b"1"), ("h", b"2"))),
        (b"k", b"stamped", ()),
        (None, None, ()),
    ]
    assert got[3].timestamp_ms == 7
    assert all(r.timestamp_ms >= before_ms for i, r in enumerate(got) if i != 3)


async def test_assign_during_a_poll_never_returns_old_shards(
    kafka_backend: KafkaBackend, topic_name: str
) -> None:
    await kafka_backend.create_topic(topic_name, shard_ranges(2))
    producer = kafka_backend.producer(topic_name)
    await producer.send(0, [Record(value=b"zero")] * 200)
    ones = await producer.send(1, [Record(value=b"one")] * 20)
    await producer.close()
    reader = kafka_backend.reader(topic_name)
    reader.assign({0: 0})
    in_flight = asyncio.ensure_future(reader.poll(max_records=1000, timeout_s=2.0))
    reader.assign({1: ones[5]})
    got = await in_flight
    deadline = time.monotonic() + WAIT_S
    while len(got) < 15:
        assert time.monotonic() < deadline, got
        got += await reader.poll(max_records=1000, timeout_s=0.5)
    await reader.close()
    assert [(r.shard, r.offset) for r in got] == [(1, offset) for offset in ones[5:]]


async def test_a_poll_returns_the_records_that_came_without_waiting_out_its_timeout(
    kafka_backend: KafkaBackend, topic_name: str
) -> None:
    """librdkafka's ``consume(n, timeout)`` waits for n messages: fewer must not cost the timeout.

    A reader that asked librdkafka for a chunk answered 10 ready records only
    when ``timeout_s`` ran out.  The bound is far below the timeout and far
    above a fetch from a local broker on a busy machine.
    """
    timeout_s, answered_s_max = 30.0, 10.0
    await kafka_backend.create_topic(topic_name, shard_ranges(2))
    producer = kafka_backend.producer(topic_name)
    reader = kafka_backend.reader(topic_name)
    reader.assign({0: 0, 1: 0})
    try:
        for round_, count in enumerate((10, 5, 1)):
            offsets = await producer.send(round_ % 2, [Record(value=b"r%d" % round_)] * count)
            started = time.monotonic()
            got = await reader.poll(max_records=1000, timeout_s=timeout_s)
            answered_s = time.monotonic() - started
            assert answered_s < answered_s_max, f"{count} records answered after {answered_s:.1f} s"
            while len(got) < count:  # a send's records may come in more than one fetch
                got += await reader.poll(max_records=1000, timeout_s=1.0)
            assert [(r.shard, r.offset) for r in got] == [(round_ % 2, o) for o in offsets]
    finally:
        await reader.close()
        await producer.close()


async def test_records_already_fetched_are_polled_without_a_thread_hop(
    kafka_backend: KafkaBackend, topic_name: str
) -> None:
    """A reader that keeps up takes what librdkafka holds on the loop, as a bare loop would."""
    await kafka_backend.create_topic(topic_name, shard_ranges(1))
    producer = kafka_backend.producer(topic_name)
    offsets = await producer.send(0, [Record(value=b"v%d" % i) for i in range(2000)])
    await producer.close()
    reader = kafka_backend.reader(topic_name)
    assert isinstance(reader, KafkaShardReader)
    reader.assign({0: 0})
    submitted = 0
    submit = reader._executor.submit

    def counting_submit(*args: Any, **kwargs: Any) -> Any:
        nonlocal submitted
        submitted += 1
        return submit(*args, **kwargs)

    reader._executor.submit = counting_submit  # type: ignore[method-assign]
    got: list[int] = []
    polls = 0
    try:
        deadline = time.monotonic() + WAIT_S
        while len(got) < len(offsets):
            assert time.monotonic() < deadline, f"{len(got)} of {len(offsets)} read"
            got += [record.offset for record in await reader.poll(max_records=50, timeout_s=1.0)]
            polls += 1
    finally:
        await reader.close()
    assert got == offsets
    # The assignment's poll goes to the worker, and so does one waiting for a fetch.
    assert submitted <= polls // 4, f"{submitted} of {polls} polls went to the worker thread"


async def test_a_reader_reports_a_dead_cluster(tmp_path: Path, topic_name: str) -> None:
    broker = start_kafka(tmp_path / "kafka")
    cluster = PhysicalCluster(
        name="doomed",
        kind=ClusterKind.KAFKA,
        bootstrap=broker.url,
        attributes={"request_timeout_s": "3"},
    )
    backend = KafkaBackend(cluster)
    try:
        await backend.create_topic(topic_name, shard_ranges(1))
        reader = backend.reader(topic_name)
        reader.assign({0: 0})
        assert await reader.poll(timeout_s=0.2) == []
        broker.kill()
        deadline = time.monotonic() + WAIT_S
        with pytest.raises(BackendUnavailable, match=broker.url):
            while True:
                assert time.monotonic() < deadline, "the reader never noticed the broker is gone"
                await reader.poll(timeout_s=0.5)
        await reader.close()
    finally:
        await backend.close()
        broker.stop()


async def test_a_producer_for_a_deleted_topic_cannot_be_made(
    kafka_backend: KafkaBackend, topic_name: str
) -> None:
    await kafka_backend.create_topic(topic_name, shard_ranges(1))
    await kafka_backend.delete_topic(topic_name)
    with pytest.raises(TopicNotFound, match="create it first"):
        kafka_backend.producer(topic_name)


async def test_closing_the_backend_closes_what_it_made(
    kafka_backend: KafkaBackend, topic_name: str
) -> None:
    await kafka_backend.create_topic(topic_name, shard_ranges(1))
    producer = kafka_backend.producer(topic_name)
    pending = producer.send(0, [Record(value=b"x")] * 10)
    reader = kafka_backend.reader(topic_name)
    await kafka_backend.close()
    assert pending.done() and pending.result() == list(range(10))
    with pytest.raises(InvalidRequest, match="closed"):
        producer.send(0, [Record(value=b"x")])
    with pytest.raises(InvalidRequest, match="closed"):
        await reader.end_offsets()
    with pytest.raises(InvalidRequest, match="closed"):
        await kafka_backend.list_topics()


async def test_a_produce_refused_midway_fails_the_send_after_the_queued_records_settle(
    kafka_backend: KafkaBackend, topic_name: str
) -> None:
    await kafka_backend.create_topic(topic_name, shard_ranges(1))
    producer = kafka_backend.producer(topic_name)
    assert isinstance(producer, KafkaShardProducer)
    real = producer._producer

    class RefusesThird:
        calls = 0

        def produce(self, *args: object) -> None:
            RefusesThird.calls += 1
            if RefusesThird.calls == 3:
                raise BufferError("Local: Queue full")
            real.produce(*args)

        def poll(self, timeout: float) -> int:
            return real.poll(timeout)

    producer._producer = RefusesThird()  # type: ignore[assignment]
    failed = producer.send(0, [Record(value=b"%d" % i) for i in range(5)])
    with pytest.raises(BackendUnavailable, match="queue is full"):
        await asyncio.wait_for(failed, WAIT_S)
    producer._producer = real
    await producer.flush()
    assert producer._buffered_bytes == 0 and producer._buffered_records == 0
    assert await producer.send(0, [Record(value=b"after")]) == [2]  # the two queued were stored
    await producer.close()


async def test_connection_attributes_reach_the_admin_client_and_every_producer(
    kafka_bootstrap: str, topic_name: str
) -> None:
    """``security.protocol``/``sasl.*``/``ssl.*`` attributes are librdkafka's, on every client.

    Against this plaintext broker, TLS asked by the cluster's attributes must
    fail on the admin client and on a producer (the attribute reached them);
    plaintext asked explicitly must work end to end.
    """
    plaintext = KafkaBackend(
        PhysicalCluster(
            name="plain",
            kind=ClusterKind.KAFKA,
            bootstrap=kafka_bootstrap,
            attributes={"security.protocol": "PLAINTEXT"},
        )
    )
    tls = KafkaBackend(
        PhysicalCluster(
            name="tls",
            kind=ClusterKind.KAFKA,
            bootstrap=kafka_bootstrap,
            attributes={"security.protocol": "SSL", "request_timeout_s": "2"},
        )
    )
    try:
        await plaintext.create_topic(topic_name, shard_ranges(1))
        producer = plaintext.producer(topic_name)
        assert await producer.send(0, [Record(b"plain")]) == [0]
        await producer.close()
        with pytest.raises(BackendUnavailable):
            await tls.check()
        with pytest.raises((BackendUnavailable, TimeoutError, Timeout)):
            tls.producer(topic_name)
    finally:
        await plaintext.delete_topic(topic_name)
        await plaintext.close()
        await tls.close()


@pytest.mark.parametrize(
    "attributes",
    [
        {"security.protocol": "bogus"},
        {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "NOPE"},
        {"ssl.no.such.setting": "x"},
    ],
)
def test_a_bad_connection_attribute_is_refused_naming_it(attributes: dict[str, str]) -> None:
    cluster = PhysicalCluster(
        name="bad", kind=ClusterKind.KAFKA, bootstrap="127.0.0.1:1", attributes=attributes
    )
    with pytest.raises(InvalidRequest, match="bad connection attribute"):
        KafkaBackend(cluster)
