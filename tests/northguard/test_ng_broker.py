"""The broker in-process with its real fps store: recovery, segments, sealing, retention, split/merge, streams."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from ng_harness import backend_for, in_process_broker, read_until, wait_for

from backends.northguard import protocol
from backends.northguard.batch import encode_batch
from backends.northguard.broker.journal import FileJournal
from backends.northguard.broker.server import Broker, BrokerConfig
from backends.northguard.client.admin import AdminClient
from backends.northguard.client.connection import ClientConnection
from backends.northguard.client.produce_stream import ProduceStream
from backends.northguard.protocol import MsgType
from backends.northguard.runtime import RealRuntime
from backends.northguard.store import FpsStore
from xinfra.backend import ProducerOptions
from xinfra.errors import InvalidRequest, OffsetOutOfRange, Sealed, TopicNotFound, XinfraError
from xinfra.keyspace import shard_ranges
from xinfra.model import Record


def records(count: int, start: int = 0, size: int = 10) -> list[Record]:
    return [
        Record(value=str(i).encode().ljust(size, b"."), key=b"k%d" % i)
        for i in range(start, start + count)
    ]


async def test_the_broker_uses_the_fps_store_and_recovers_everything_after_a_restart(
    tmp_path: Path,
) -> None:
    # 2200: one more 1-record batch fits the last segment (batches carry 22 bytes of producer id)
    broker = await in_process_broker(tmp_path, segment_bytes_max=2200)
    assert isinstance(broker.store, FpsStore)
    backend = backend_for(f"127.0.0.1:{broker.port}")
    await backend.create_topic("t", shard_ranges(3), {"retention.ms": "3600000"})
    producer = backend.producer("t", ProducerOptions(linger_ms=0))
    offsets = []
    for i in range(20):
        offsets += await producer.send(1, records(10, 10 * i))
    await producer.close()
    admin = AdminClient(RealRuntime(), f"127.0.0.1:{broker.port}", 10)
    view = await admin.topic("t")
    segments_before = await admin.segment_metadata("t", view.ranges[1].range_id)
    assert len(segments_before["segments"]) > 3  # sealed at the size limit along the way
    await admin.close()
    await backend.close()
    await broker.stop()

    broker = await in_process_broker(tmp_path, segment_bytes_max=2200)
    backend = backend_for(f"127.0.0.1:{broker.port}")
    info = await backend.describe_topic("t")
    assert info.shards == shard_ranges(3) and info.config == {"retention.ms": "3600000"}
    reader = backend.reader("t")
    assert await reader.end_offsets() == {0: 0, 1: 200, 2: 0}
    reader.assign({1: 0})
    got = await read_until(reader, 200)
    assert [r.offset for r in got] == offsets == list(range(200))
    assert [r.value for r in got] == [r.value for r in records(200)]
    admin = AdminClient(RealRuntime(), f"127.0.0.1:{broker.port}", 10)
    after = await admin.segment_metadata("t", view.ranges[1].range_id)
    assert [s["segment_id"] for s in after["segments"]] == [
        s["segment_id"] for s in segments_before["segments"]
    ]
    # Recovery kept the active segment active, at the end the store recovered
    assert [s["state"] for s in after["segments"]] == [
        s["state"] for s in segments_before["segments"]
    ]
    assert after["segments"][-1]["state"] == "active" and after["segments"][-1]["end_offset"] == 200
    producer = backend.producer("t", ProducerOptions(linger_ms=0))
    assert await producer.send(1, records(1)) == [200]  # appends continue in that segment
    await producer.close()
    again = await admin.segment_metadata("t", view.ranges[1].range_id)
    assert [s["segment_id"] for s in again["segments"]] == [
        s["segment_id"] for s in after["segments"]
    ]
    await reader.close()
    await admin.close()
    await backend.close()
    await broker.stop()


async def test_seal_on_demand_and_sealed_topics_refuse_appends(tmp_path: Path) -> None:
    broker = await in_process_broker(tmp_path)
    address = f"127.0.0.1:{broker.port}"
    backend = backend_for(address)
    admin = AdminClient(RealRuntime(), address, 10)
    await backend.create_topic("t", shard_ranges(1))
    producer = backend.producer("t", ProducerOptions(linger_ms=0))
    assert await producer.send(0, records(5)) == [0, 1, 2, 3, 4]
    view = await admin.topic("t")
    sealed = await admin.seal_segment("t", view.ranges[0].range_id)
    assert [s["state"] for s in sealed["segments"]] == ["sealed"]
    assert await producer.send(0, records(5)) == [5, 6, 7, 8, 9]  # a new segment, same offsets on
    view = await admin.seal_topic("t")
    assert view.sealed and view.ranges[0].sealed and view.ranges[0].end_offset == 10
    with pytest.raises(Sealed):
        await asyncio.wait_for(producer.send(0, records(1)), 10)
    assert (await backend.describe_topic("t")).sealed
    reader = backend.reader("t")
    reader.assign({0: 0})
    assert len(await read_until(reader, 10)) == 10
    await reader.close()
    await producer.close()
    await admin.close()
    await backend.close()
    await broker.stop()


async def test_retention_deletes_whole_sealed_segments_only(tmp_path: Path) -> None:
    broker = await in_process_broker(tmp_path, maintenance_s=0.05)
    address = f"127.0.0.1:{broker.port}"
    backend = backend_for(address)
    admin = AdminClient(RealRuntime(), address, 10)
    await backend.create_topic("t", shard_ranges(1), {"retention.ms": "1"})
    producer = backend.producer("t", ProducerOptions(linger_ms=0))
    await producer.send(0, records(5))
    range_id = (await admin.topic("t")).ranges[0].range_id
    await admin.seal_segment("t", range_id)
    await producer.send(0, records(3, 5))

    async def retained() -> bool:
        return (await admin.topic("t")).ranges[0].start_offset == 5

    await wait_for(retained, "retention of the sealed segment")
    meta = await admin.segment_metadata("t", range_id)
    assert [(s["start_offset"], s["state"]) for s in meta["segments"]] == [(5, "active")]
    reader = backend.reader("t")
    assert await reader.start_offsets() == {0: 5}
    reader.assign({0: 0})
    with pytest.raises(OffsetOutOfRange):
        await reader.poll(timeout_s=1)
    reader.assign({0: 5})
    assert [r.offset for r in await read_until(reader, 3)] == [5, 6, 7]
    await reader.close()
    await producer.close()
    await admin.close()
    await backend.close()
    await broker.stop()


async def test_split_and_merge_follow_the_buddy_rule_and_survive_a_restart(tmp_path: Path) -> None:
    broker = await in_process_broker(tmp_path)
    address = f"127.0.0.1:{broker.port}"
    admin = AdminClient(RealRuntime(), address, 10)
    view = await admin.create_topic("t", shard_ranges(2))
    first, second = view.ranges
    with pytest.raises(InvalidRequest, match=r"buddies|adjacent"):
        split = await admin.split_range("t", first.range_id)
        low, high = split.ranges[0], split.ranges[1]
        await admin.merge_ranges("t", high.range_id, second.range_id)
    split = await admin.topic("t")
    assert [r.key_range for r in split.ranges] == [*first.key_range.split(), second.key_range]
    low, high = split.ranges[0], split.ranges[1]
    merged = await admin.merge_ranges("t", low.range_id, high.range_id)
    assert [r.key_range for r in merged.ranges] == [first.key_range, second.key_range]
    assert merged.ranges[0].range_id not in (first.range_id, low.range_id, high.range_id)
    await admin.close()
    await broker.stop()
    broker = await in_process_broker(tmp_path)
    admin = AdminClient(RealRuntime(), f"127.0.0.1:{broker.port}", 10)
    assert await admin.topic("t") == merged
    await admin.close()
    await broker.stop()


async def test_a_resent_append_gets_its_original_offset_and_acks_are_coalesced(
    tmp_path: Path,
) -> None:
    broker = await in_process_broker(tmp_path)
    address = f"127.0.0.1:{broker.port}"
    admin = AdminClient(RealRuntime(), address, 10)
    range_id = (await admin.create_topic("t", shard_ranges(1))).ranges[0].range_id
    connection = await ClientConnection.open(RealRuntime(), address, 10)
    acks: list[tuple[int, tuple[int, ...]]] = []
    errors: list[XinfraError] = []

    def open_stream() -> ProduceStream:
        return ProduceStream(
            connection, "t", range_id, 42, lambda f, o: acks.append((f, o)), errors.append
        )

    stream = open_stream()
    await stream.opened
    batch = encode_batch(records(2), 0)
    for seq in range(50):
        stream.append(seq, batch)

    async def all_acked() -> bool:
        return sum(len(o) for _, o in acks) == 50

    await wait_for(all_acked, "50 acks")
    assert len(acks) < 50  # M acks for N appends
    offsets = [offset for _, chunk in acks for offset in chunk]
    assert offsets == list(range(0, 100, 2))
    acks.clear()
    again = open_stream()  # a "reconnection": resend the last ten with the same sequence numbers
    await again.opened
    for seq in range(40, 51):
        again.append(seq, batch)

    async def resent_acked() -> bool:
        return sum(len(o) for _, o in acks) == 11

    await wait_for(resent_acked, "acks of the resent appends")
    assert [offset for _, chunk in acks for offset in chunk] == [*range(80, 100, 2), 100]
    assert (await admin.topic("t")).ranges[0].end_offset == 102  # nothing stored twice
    assert not errors
    await connection.close()
    await admin.close()
    await broker.stop()


async def test_stream_errors_fail_one_stream_and_keep_the_connection(tmp_path: Path) -> None:
    broker = await in_process_broker(tmp_path)
    address = f"127.0.0.1:{broker.port}"
    connection = await ClientConnection.open(RealRuntime(), address, 10)
    await connection.request("create_topic", 10, name="t", count=1)
    range_id = (await connection.request("topic_metadata", 10, name="t"))["ranges"][0]["range_id"]
    failures: list[XinfraError] = []
    bad = ProduceStream(connection, "nope", range_id, 1, lambda f, o: None, failures.append)
    with pytest.raises(XinfraError, match="nope"):
        await bad.opened
    zero: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    class Catch:
        def on_frame(self, kind: MsgType, body: bytes) -> None:
            zero.set_result(body)

        def on_failure(self, error: XinfraError) -> None:
            pass

    stream_id = connection.open_stream(Catch())
    connection.send(
        protocol.encode_json(
            MsgType.CONSUME_OPEN,
            stream_id,
            {"topic": "t", "range_id": range_id, "offset": 0, "window_bytes": 0},
        )
    )
    _, payload = protocol.decode_json(await asyncio.wait_for(zero, 10))
    assert payload["error"]["code"] == "invalid_request" and "window" in payload["error"]["message"]
    assert (await connection.request("ping", 10))["broker_id"] == "1"
    await connection.close()
    await broker.stop()


async def test_the_metadata_journal_compacts_into_a_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("backends.northguard.broker.coordinator.JOURNAL_OPS_MAX", 5)
    broker = await in_process_broker(tmp_path)
    admin = AdminClient(RealRuntime(), f"127.0.0.1:{broker.port}", 10)
    for i in range(12):
        await admin.create_topic(f"t{i}", shard_ranges(1 + i % 3))
    await admin.delete_topic("t3")
    await admin.close()
    await broker.stop()
    assert (tmp_path / "meta" / "snapshot").exists()
    broker = await in_process_broker(tmp_path)
    admin = AdminClient(RealRuntime(), f"127.0.0.1:{broker.port}", 10)
    assert sorted(await admin.list_topics()) == sorted(f"t{i}" for i in range(12) if i != 3)
    assert len((await admin.topic("t11")).ranges) == 3
    await admin.close()
    await broker.stop()


async def test_a_snapshot_larger_than_any_op_is_read_back(tmp_path: Path) -> None:
    """A snapshot grows with the metadata (~390 B per range and segment): the journal once read
    one over 64 MiB as damaged, and a broker with that much history could not start."""
    journal = FileJournal(RealRuntime(), tmp_path)
    journal.load()
    state = {"applied_seq": 1, "padding": "x" * ((64 << 20) + 1)}
    journal.write_snapshot_file(state)
    await journal.install_snapshot(1)
    journal.close()
    snapshot, ops = FileJournal(RealRuntime(), tmp_path).load()
    assert snapshot == state and ops == []


async def test_a_cancelled_delete_holds_the_topic_until_its_op_is_decided(tmp_path: Path) -> None:
    """A client that drops its connection mid-delete cancels the handler while the op waits for
    the journal; a second delete must not decide against the state before that op applies."""
    broker = await in_process_broker(tmp_path)
    coordinator = broker.coordinator
    await coordinator.create_topic("t", shard_ranges(2), {})
    first = asyncio.create_task(coordinator.delete_topic("t"))
    while not any(p.op["op"] == "delete_topic" for p in coordinator._pending):
        await asyncio.sleep(0)  # until the op is queued, before the journal has it
    first.cancel()
    second = asyncio.create_task(coordinator.delete_topic("t"))
    with pytest.raises(asyncio.CancelledError):
        await first
    with pytest.raises(TopicNotFound):
        await second
    assert "t" not in coordinator.list_topics()
    await coordinator.create_topic("t", shard_ranges(1), {})  # the state machine is whole
    assert coordinator.list_topics() == ["t"]
    await broker.stop()


async def test_the_client_port_opens_last_and_health_waits_for_it(tmp_path: Path) -> None:
    """A launcher waits for the client port (``wait_ready``), ``xinfra up`` for ``/health``: either
    answering means a broker that serves. Just before the client port opens, the HTTP port
    already answers, with 503 and ``serving: false``, and the start time is recorded."""
    broker = Broker(BrokerConfig(data_dir=tmp_path, port=0, http_port=0))
    network = broker.runtime.network
    open_client_port = network.serve_frames
    seen: dict[str, object] = {}

    async def serve_frames(*args: Any, **kwargs: Any) -> Any:
        reader, writer = await asyncio.open_connection("127.0.0.1", broker.http_port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        response = await reader.read()
        writer.close()
        head, _, body = response.partition(b"\r\n\r\n")
        seen["status"] = head.split(b" ", 2)[1]
        seen["health"] = json.loads(body)
        seen["start_seconds"] = broker.metrics.registry.get_sample_value("northguard_start_seconds")
        return await open_client_port(*args, **kwargs)

    network.serve_frames = serve_frames  # type: ignore[method-assign]
    await broker.start()
    try:
        assert seen["status"] == b"503", seen
        assert seen["health"]["serving"] is False, seen  # type: ignore[index]
        start_seconds = seen["start_seconds"]
        assert isinstance(start_seconds, float) and start_seconds > 0, seen
        ok, details = broker.health()
        assert ok and details["serving"] is True
    finally:
        await broker.stop()
