"""The backend contract (``xinfra/backend.py``), run against every backend kind.

Tests wait on conditions with deadlines and never sleep to synchronise or
assert on speed.  A test of standard behaviour a test broker gets wrong is
kept, marked ``xfail(strict=True)`` naming the deviation, so it starts
failing loudly the day the broker is fixed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from typing import NamedTuple

import pytest
from containers import KAFKA_IS_TANSU
from contract_support import Broker, cluster

from xinfra.backend import Backend, ProducerOptions, ReaderOptions, ShardReader, open_backend
from xinfra.errors import (
    Backpressure,
    InvalidRequest,
    RecordTooLarge,
    ShardOutOfRange,
    TopicAlreadyExists,
    TopicNotFound,
    Unavailable,
    XinfraError,
)
from xinfra.keyspace import KEYSPACE_SIZE, KeyRange, shard_ranges
from xinfra.model import ClusterKind, ConsumedRecord, Record

WAIT_S = 30.0
"""Deadline of every wait on a condition; generous, as the machine is shared."""


def tansu_deviation(request: pytest.FixtureRequest, kind: ClusterKind, deviation: str) -> None:
    """Mark the running test an expected failure on the Kafka param (tansu), naming why."""
    if kind is ClusterKind.KAFKA and KAFKA_IS_TANSU:
        request.applymarker(
            pytest.mark.xfail(strict=True, reason=f"tansu 0.6.0 deviation: {deviation}")
        )


async def read_until(
    reader: ShardReader, count: int, timeout_s: float = WAIT_S
) -> list[ConsumedRecord]:
    """Poll until ``count`` records arrived; fail with what did arrive at the deadline."""
    records: list[ConsumedRecord] = []
    deadline = time.monotonic() + timeout_s
    while len(records) < count:
        assert time.monotonic() < deadline, f"only {len(records)} of {count} records arrived"
        records += await reader.poll(max_records=count - len(records), timeout_s=0.5)
    return records


async def read_all(
    backend: Backend, topic: str, positions: Mapping[int, int], count: int
) -> list[ConsumedRecord]:
    reader = backend.reader(topic)
    try:
        reader.assign(positions)
        return await read_until(reader, count)
    finally:
        await reader.close()


def make_records(
    shard: int, count: int, start: int = 0, timestamp_ms: int | None = None
) -> list[Record]:
    return [
        Record(
            value=f"value-{shard}-{i}".encode(),
            key=f"key-{i}".encode(),
            headers=(("trace", f"t{i}".encode()), ("shard", str(shard).encode())),
            timestamp_ms=timestamp_ms if timestamp_ms is not None else 1_700_000_000_000 + i,
        )
        for i in range(start, start + count)
    ]


# -- admin -------------------------------------------------------------------------------------


async def test_topic_with_n_shards_is_created_and_described(
    backend: Backend, topic_name: str
) -> None:
    ranges = shard_ranges(4)
    created = await backend.create_topic(topic_name, ranges)
    assert created.name == topic_name
    assert created.shards == ranges
    described = await backend.describe_topic(topic_name)
    assert described.name == topic_name
    assert described.shards == ranges
    assert not described.sealed
    assert topic_name in await backend.list_topics()


async def test_creating_an_existing_topic_raises(backend: Backend, topic_name: str) -> None:
    await backend.create_topic(topic_name, shard_ranges(2))
    with pytest.raises(TopicAlreadyExists, match=topic_name):
        await backend.create_topic(topic_name, shard_ranges(2))


async def test_ranges_that_do_not_cover_the_keyspace_are_refused(
    backend: Backend, topic_name: str
) -> None:
    with pytest.raises(InvalidRequest, match="cover"):
        await backend.create_topic(topic_name, [KeyRange(0, KEYSPACE_SIZE // 2)])
    assert topic_name not in await backend.list_topics()


async def test_deleting_a_topic_removes_it(backend: Backend, topic_name: str) -> None:
    await backend.create_topic(topic_name, shard_ranges(2))
    producer = backend.producer(topic_name)
    await producer.send(0, make_records(0, 3))
    await producer.close()
    await backend.delete_topic(topic_name)
    assert topic_name not in await backend.list_topics()
    with pytest.raises(TopicNotFound, match=topic_name):
        await backend.describe_topic(topic_name)


async def test_unknown_topic_admin_raises_topic_not_found(
    backend: Backend, topic_name: str
) -> None:
    with pytest.raises(TopicNotFound, match=topic_name):
        await backend.describe_topic(topic_name)
    with pytest.raises(TopicNotFound, match=topic_name):
        await backend.delete_topic(topic_name)


# -- produce and read --------------------------------------------------------------------------


async def test_records_come_back_in_order_with_offsets_keys_values_headers_timestamps(
    backend: Backend, topic_name: str
) -> None:
    await backend.create_topic(topic_name, shard_ranges(3))
    producer = backend.producer(topic_name)
    sent: dict[int, list[tuple[int, Record]]] = {1: [], 2: []}
    for round_ in range(3):
        futures = {
            shard: (producer.send(shard, records), records)
            for shard in (1, 2)
            for records in [make_records(shard, 5, start=5 * round_)]
        }
        for shard, (future, records) in futures.items():
            offsets = await future
            assert len(offsets) == len(records)
            sent[shard] += zip(offsets, records, strict=True)
    await producer.close()
    for shard in (1, 2):
        offsets = [offset for offset, _ in sent[shard]]
        assert offsets == sorted(offsets) and len(set(offsets)) == len(offsets)
        assert offsets[0] == 0

    got = await read_all(backend, topic_name, {1: 0, 2: 0}, 30)
    for shard in (1, 2):
        mine = [record for record in got if record.shard == shard]
        assert [(r.offset, r.key, r.value, r.headers, r.timestamp_ms) for r in mine] == [
            (offset, record.key, record.value, record.headers, record.timestamp_ms)
            for offset, record in sent[shard]
        ]
    assert {record.shard for record in got} == {1, 2}


class _Tagged(NamedTuple):
    """A record type of the reader's caller: two fields of its own before a ``ConsumedRecord``'s."""

    topic: str
    epoch: int
    shard: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...] = ()


async def test_a_reader_makes_records_of_the_type_and_prefix_it_was_given(
    backend: Backend, topic_name: str
) -> None:
    """``ReaderOptions.record_type/record_prefix``: how the SDK gets its records made once."""
    await backend.create_topic(topic_name, shard_ranges(1))
    producer = backend.producer(topic_name)
    plain = [
        Record(value=b"v%d" % i, key=b"k%d" % i, timestamp_ms=1_700_000_000_000 + i)
        for i in range(3)
    ]
    await producer.send(0, plain)
    await producer.send(0, make_records(0, 2))  # with headers
    await producer.close()
    expected = [(r.timestamp_ms, r.key, r.value, r.headers) for r in plain + make_records(0, 2)]

    reader = backend.reader(
        topic_name, ReaderOptions(record_type=_Tagged, record_prefix=("virtual", 7))
    )
    try:
        reader.assign({0: 0})
        got = await read_until(reader, len(expected))
    finally:
        await reader.close()
    assert all(type(record) is _Tagged for record in got)
    assert list(got) == [
        _Tagged("virtual", 7, 0, offset, *fields) for offset, fields in enumerate(expected)
    ]


async def test_reading_from_an_offset_continues_there(backend: Backend, topic_name: str) -> None:
    await backend.create_topic(topic_name, shard_ranges(1))
    producer = backend.producer(topic_name)
    offsets = await producer.send(0, make_records(0, 10))
    await producer.close()
    got = await read_all(backend, topic_name, {0: offsets[6]}, 4)
    assert [record.offset for record in got] == offsets[6:]


async def test_null_key_and_value_and_default_timestamp(backend: Backend, topic_name: str) -> None:
    await backend.create_topic(topic_name, shard_ranges(1))
    producer = backend.producer(topic_name)
    before_ms = int(time.time() * 1000)
    offsets = await producer.send(0, [Record(value=None), Record(value=b"", key=b"")])
    await producer.close()
    got = await read_all(backend, topic_name, {0: 0}, 2)
    assert [r.offset for r in got] == offsets
    assert got[0].key is None and got[0].value is None
    assert got[1].value in (b"", None)
    assert all(r.timestamp_ms >= before_ms - 60_000 for r in got)  # stamped by the producer


async def test_empty_send_resolves_to_no_offsets(backend: Backend, topic_name: str) -> None:
    await backend.create_topic(topic_name, shard_ranges(1))
    producer = backend.producer(topic_name)
    assert await producer.send(0, []) == []
    await producer.close()


async def test_poll_with_nothing_to_read_returns_empty(backend: Backend, topic_name: str) -> None:
    await backend.create_topic(topic_name, shard_ranges(1))
    reader = backend.reader(topic_name)
    reader.assign({0: 0})
    assert await reader.poll(max_records=10, timeout_s=0.2) == []
    await reader.close()


# -- offsets -----------------------------------------------------------------------------------


async def test_start_and_end_offsets_of_an_empty_topic(backend: Backend, topic_name: str) -> None:
    await backend.create_topic(topic_name, shard_ranges(2))
    reader = backend.reader(topic_name)
    assert await reader.start_offsets() == {0: 0, 1: 0}
    assert await reader.end_offsets() == {0: 0, 1: 0}
    await reader.close()


async def test_end_offsets_of_a_reader_that_has_read_the_shard(
    backend: Backend, topic_name: str
) -> None:
    await backend.create_topic(topic_name, shard_ranges(2))
    producer = backend.producer(topic_name)
    offsets = await producer.send(1, make_records(1, 20))
    await producer.close()
    reader = backend.reader(topic_name)
    reader.assign({1: 0})
    await read_until(reader, 20)
    assert await reader.end_offsets([1]) == {1: offsets[-1] + 1}
    assert (await reader.end_offsets())[0] == 0
    await reader.close()


async def test_end_offsets_of_a_fresh_reader(backend: Backend, topic_name: str) -> None:
    await backend.create_topic(topic_name, shard_ranges(3))
    producer = backend.producer(topic_name)
    last: dict[int, int] = {}
    for shard, count in ((1, 20), (1, 1), (2, 7), (1, 33)):  # several batches, one record alone
        last[shard] = (await producer.send(shard, make_records(shard, count)))[-1]
    await producer.close()
    reader = backend.reader(topic_name)
    assert await reader.end_offsets() == {0: 0, 1: last[1] + 1, 2: last[2] + 1}
    assert await reader.end_offsets([2]) == {2: last[2] + 1}
    await reader.close()


async def test_offset_for_timestamp(
    request: pytest.FixtureRequest, kind: ClusterKind, backend: Backend, topic_name: str
) -> None:
    tansu_deviation(
        request, kind, "ListOffsets by timestamp answers offset 0 whatever the timestamp"
    )
    await backend.create_topic(topic_name, shard_ranges(1))
    producer = backend.producer(topic_name)
    offsets: list[int] = []
    for timestamp_ms in (1_000_000, 2_000_000, 3_000_000):  # one send per timestamp
        offsets += await producer.send(0, make_records(0, 3, timestamp_ms=timestamp_ms))
    await producer.close()
    reader = backend.reader(topic_name)
    assert await reader.offset_for_timestamp(0, 0) == offsets[0]
    assert await reader.offset_for_timestamp(0, 1_500_000) == offsets[3]
    assert await reader.offset_for_timestamp(0, 2_000_000) == offsets[3]
    assert await reader.offset_for_timestamp(0, 3_000_000) == offsets[6]
    assert await reader.offset_for_timestamp(0, 4_000_000) == offsets[-1] + 1
    await reader.close()


# -- bad input ---------------------------------------------------------------------------------


async def test_unknown_topic_raises_topic_not_found_to_producers_and_readers(
    backend: Backend, topic_name: str
) -> None:
    with pytest.raises(TopicNotFound, match=topic_name):
        producer = backend.producer(topic_name)
        try:
            await producer.send(0, make_records(0, 1))
        finally:
            await producer.close()
    reader = backend.reader(topic_name)
    with pytest.raises(TopicNotFound, match=topic_name):
        await reader.end_offsets()
    with pytest.raises(TopicNotFound, match=topic_name):
        reader.assign({0: 0})
        await reader.poll(timeout_s=0.2)
    await reader.close()
    assert topic_name not in await backend.list_topics()


async def test_shard_out_of_range_raises_at_once(backend: Backend, topic_name: str) -> None:
    await backend.create_topic(topic_name, shard_ranges(2))
    producer = backend.producer(topic_name)
    for shard in (2, -1, 99):
        with pytest.raises(ShardOutOfRange, match=str(shard)):
            producer.send(shard, make_records(0, 1))
    await producer.close()
    reader = backend.reader(topic_name)
    with pytest.raises(ShardOutOfRange, match="2"):
        await reader.end_offsets([2])
    with pytest.raises(ShardOutOfRange, match="5"):
        await reader.offset_for_timestamp(5, 0)
    with pytest.raises(ShardOutOfRange, match="7"):
        reader.assign({0: 0, 7: 0})
        await reader.poll(timeout_s=0.2)
    await reader.close()


async def test_oversized_record_is_refused_and_nothing_of_the_call_is_stored(
    backend: Backend, topic_name: str
) -> None:
    await backend.create_topic(topic_name, shard_ranges(1))
    producer = backend.producer(topic_name, ProducerOptions(record_bytes_max=1000))
    fits = Record(value=b"x" * 1000)
    with pytest.raises(RecordTooLarge, match="1001"):
        producer.send(0, [fits, Record(value=b"x" * 1001)])
    with pytest.raises(RecordTooLarge):
        producer.send(0, [Record(value=b"x" * 900, key=b"k" * 50, headers=(("h", b"v" * 60),))])
    assert await producer.send(0, [fits]) == [0]
    await producer.close()


async def test_a_full_buffer_raises_backpressure_until_acknowledged(
    backend: Backend, topic_name: str
) -> None:
    await backend.create_topic(topic_name, shard_ranges(1))
    options = ProducerOptions(buffer_bytes_max=10_000, record_bytes_max=10_000)
    producer = backend.producer(topic_name, options)
    first = producer.send(0, [Record(value=b"a" * 6000)])
    with pytest.raises(Backpressure):
        producer.send(0, [Record(value=b"b" * 6000)])
    assert await first == [0]
    assert await producer.send(0, [Record(value=b"c" * 6000)]) == [1]
    await producer.close()


async def test_broker_down_raises_unavailable(
    kind: ClusterKind, broker: Broker, topic_name: str
) -> None:
    backend = open_backend(cluster(kind, broker.bootstrap, request_timeout_s="3"))
    try:
        await backend.create_topic(topic_name, shard_ranges(1))
        producer = backend.producer(topic_name, ProducerOptions(request_timeout_s=3.0))
        assert await producer.send(0, make_records(0, 1)) == [0]
        reader = backend.reader(topic_name)
        broker.stop()
        with pytest.raises(Unavailable, match=broker.bootstrap.split(",")[0]):
            await backend.check()
        with pytest.raises(Unavailable):
            await backend.create_topic(topic_name + "-2", shard_ranges(1))
        with pytest.raises(Unavailable):
            await reader.end_offsets()
        failed = producer.send(0, make_records(0, 1))
        with pytest.raises(Unavailable):
            await asyncio.wait_for(failed, WAIT_S)
        await producer.close()
        await reader.close()
    finally:
        await backend.close()


# -- assignment, flush, close ------------------------------------------------------------------


async def test_assign_replaces_the_assignment_and_drops_old_shards(
    backend: Backend, topic_name: str
) -> None:
    await backend.create_topic(topic_name, shard_ranges(2))
    producer = backend.producer(topic_name)
    zero = await producer.send(0, make_records(0, 50))
    one = await producer.send(1, make_records(1, 50))
    await producer.close()

    reader = backend.reader(topic_name)
    reader.assign({0: 0, 1: 0})
    first = await read_until(reader, 1)
    assert first
    reader.assign({1: one[10]})
    got = await read_until(reader, 40)
    assert [(r.shard, r.offset) for r in got] == [(1, offset) for offset in one[10:]]
    assert await reader.poll(max_records=100, timeout_s=0.3) == []

    reader.assign({0: zero[45]})  # back to a shard dropped before, from a new offset
    got = await read_until(reader, 5)
    assert [(r.shard, r.offset) for r in got] == [(0, offset) for offset in zero[45:]]
    reader.assign({})
    assert await reader.poll(max_records=100, timeout_s=0.2) == []
    await reader.close()


async def test_a_cancelled_poll_loses_nothing(backend: Backend, topic_name: str) -> None:
    await backend.create_topic(topic_name, shard_ranges(1))
    producer = backend.producer(topic_name)
    offsets = await producer.send(0, make_records(0, 300))
    await producer.close()
    reader = backend.reader(topic_name)
    reader.assign({0: 0})
    got: list[ConsumedRecord] = []
    for _ in range(5):  # polls cancelled at once, whatever they had consumed meanwhile
        poll = asyncio.ensure_future(reader.poll(max_records=50, timeout_s=5.0))
        await asyncio.sleep(0)
        poll.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            got += await poll
        got += await reader.poll(max_records=20, timeout_s=0.5)
    got += await read_until(reader, len(offsets) - len(got))
    await reader.close()
    assert [record.offset for record in got] == offsets


async def test_flush_then_close_lose_nothing(backend: Backend, topic_name: str) -> None:
    await backend.create_topic(topic_name, shard_ranges(2))
    producer = backend.producer(topic_name, ProducerOptions(linger_ms=50.0))
    futures = [producer.send(i % 2, make_records(i % 2, 100, start=100 * i)) for i in range(20)]
    await producer.flush()
    assert all(future.done() for future in futures)
    offsets = [future.result() for future in futures]
    late = producer.send(0, make_records(0, 7))
    await producer.close()
    assert late.done() and len(late.result()) == 7
    await producer.close()  # idempotent
    with pytest.raises(XinfraError):
        producer.send(0, make_records(0, 1))
    expected = sum(len(o) for o in offsets) + 7
    got = await read_all(backend, topic_name, {0: 0, 1: 0}, expected)
    assert len(got) == expected
    for shard in (0, 1):
        assert [r.offset for r in got if r.shard == shard] == sorted(
            [o for i, batch in enumerate(offsets) if i % 2 == shard for o in batch]
            + (late.result() if shard == 0 else [])
        )
