"""Northguard as a replicated cluster (issue 15, first slice), on real broker processes.

Broker 1 is the coordinator (all metadata, leader of every active segment);
the others join it with ``--coordinator``.  Checked here: members register
with their attributes; every new segment gets a replica set of the
replication factor; every record is readable; sealed replicas are
byte-identical (a SHA-256 of each replica's entries, asked of each broker);
a SIGKILLed follower under keyed produce loses no acknowledged record,
duplicates none, and the producer continues on a new segment whose replica
set leaves the dead broker out.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from ng_harness import (
    WAIT_S,
    RawClient,
    assert_read_back,
    backend_for,
    broker_metrics,
    read_until,
)
from typer.testing import CliRunner

from backends.northguard import cli, credentials, protocol, tls
from backends.northguard.client.blocking import request_blocking
from backends.northguard.launcher import NorthguardProcess, start_northguard_cluster
from backends.northguard.protocol import MsgType
from backends.northguard.tls import make_test_certificates
from xinfra.backend import ProducerOptions
from xinfra.errors import XinfraError
from xinfra.keyspace import shard_ranges
from xinfra.model import Record

REPLICA_TIMEOUT_ARGS = ["--replica-timeout-s", "2", "--broker-timeout-s", "2"]


def request(process: NorthguardProcess, op: str, **arguments: Any) -> dict[str, Any]:
    return request_blocking(process.url, op, WAIT_S, **arguments)


def checksums(processes: list[NorthguardProcess], segment: dict[str, Any]) -> dict[str, str]:
    """Per replica of ``segment``: the SHA-256 of its entries as that broker stores them."""
    by_id = {p.name.rsplit(" ", 1)[-1]: p for p in processes}
    result: dict[str, str] = {}
    for broker_id in segment["replicas"]:
        answer = request(by_id[broker_id], "replica_checksum", segment_id=segment["segment_id"])
        assert answer["state"] == "sealed"
        assert answer["end_offset"] == segment["end_offset"]
        result[broker_id] = answer["sha256"]
    return result


def wait_until(condition: Any, what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def three_brokers(tmp_path: Path) -> Iterator[list[NorthguardProcess]]:
    processes = start_northguard_cluster(
        tmp_path,
        3,
        replication_factor=3,
        attributes=[{"rack": "r1"}, {"rack": "r2"}, {"rack": "r3"}],
    )
    yield processes
    for process in reversed(processes):
        process.stop()


@pytest.fixture
def four_brokers(tmp_path: Path) -> Iterator[list[NorthguardProcess]]:
    processes = start_northguard_cluster(
        tmp_path, 4, replication_factor=3, extra_args=REPLICA_TIMEOUT_ARGS
    )
    yield processes
    for process in reversed(processes):
        process.stop()


def test_members_register_with_their_attributes(three_brokers: list[NorthguardProcess]) -> None:
    raw = RawClient(three_brokers[1].url)  # a member leads nothing: a clear, retriable error
    try:
        raw.send(
            protocol.encode_json(
                MsgType.PRODUCE_OPEN, 5, {"topic": "t", "range_id": 1, "producer_id": 1}
            )
        )
        answer = raw.receive()
        assert answer is not None and answer.type is MsgType.STREAM_ERROR
        assert protocol.decode_json(answer.body)[1]["error"]["code"] == "not_leader"
    finally:
        raw.close()
    for process in three_brokers:  # any broker answers: a member forwards to the coordinator
        status = request(process, "cluster_status")
        assert status["coordinator"] == "1"
        rows = {row["broker_id"]: row for row in status["brokers"]}
        assert set(rows) == {"1", "2", "3"}
        assert all(row["live"] for row in rows.values())
        assert {b: r["attributes"] for b, r in rows.items()} == {
            "1": {"rack": "r1"},
            "2": {"rack": "r2"},
            "3": {"rack": "r3"},
        }
        assert rows["1"]["role"] == "coordinator" and rows["2"]["role"] == "member"


async def test_three_replicas_every_record_readable_and_sealed_replicas_identical(
    three_brokers: list[NorthguardProcess],
) -> None:
    bootstrap = ",".join(p.url for p in reversed(three_brokers))  # a member first
    backend = backend_for(bootstrap)
    try:
        await backend.create_topic("replicated", shard_ranges(2))
        producer = backend.producer("replicated", ProducerOptions(linger_ms=1))
        sent: dict[int, list[bytes]] = {0: [], 1: []}
        for round_ in range(20):
            futures = []
            for shard in (0, 1):
                values = [b"s%d-%05d" % (shard, round_ * 25 + i) for i in range(25)]
                sent[shard] += values
                futures.append(producer.send(shard, [Record(value=v) for v in values]))
            await asyncio.gather(*futures)
        for shard in (0, 1):
            reader = backend.reader("replicated")
            reader.assign({shard: 0})
            got = await read_until(reader, len(sent[shard]))
            await reader.close()
            assert [r.value for r in got] == sent[shard]
            assert [r.offset for r in got] == list(range(len(sent[shard])))
        view = await backend.describe_topic("replicated")
        assert len(view.shards) == 2
    finally:
        await backend.close()
    coordinator = three_brokers[0]
    topic = request(coordinator, "topic_metadata", name="replicated")
    for range_ in topic["ranges"]:
        meta = request(coordinator, "seal_segment", name="replicated", range_id=range_["range_id"])
        [segment] = meta["segments"]
        assert sorted(segment["replicas"]) == ["1", "2", "3"]
        assert segment["state"] == "sealed" and segment["end_offset"] == 500
        digests = checksums(three_brokers, segment)
        assert len(set(digests.values())) == 1, digests
    status = request(three_brokers[1], "cluster_status")
    assert status["under_replicated"] == []
    assert broker_metrics(coordinator)["northguard_live_brokers"] == 3
    for member in three_brokers[1:]:
        metrics = broker_metrics(member)
        assert metrics["northguard_replica_appends_received_total"] >= 2
        assert metrics["northguard_replica_bytes_received_total"] > 1000


async def keyed_produce_through(
    processes: list[NorthguardProcess],
    topic: str,
    fault: Callable[[NorthguardProcess], None],
    recover: Callable[[NorthguardProcess], None] | None = None,
    moved: bool = True,
) -> tuple[str, dict[str, Any]]:
    """Keyed produce at a steady pace; ``fault`` hits a follower of the active segment once 300
    records are acknowledged; 300 more must be acknowledged after it.  Checks every acknowledged
    record is read back once, in send order, and no send failed; with ``moved``, the segments
    after the hit one leave the victim out.  Returns the victim's id and the segment it was a
    follower of, as sealed."""
    coordinator = processes[0]
    backend = backend_for(coordinator.url, request_timeout_s="60")
    await backend.create_topic(topic, shard_ranges(1))
    producer = backend.producer(topic, ProducerOptions(linger_ms=2, request_timeout_s=60))
    acknowledged: list[tuple[int, bytes]] = []
    failures: list[BaseException] = []
    stop = asyncio.Event()

    async def produce() -> None:
        number = 0
        in_flight: set[asyncio.Future[list[int]]] = set()
        while not stop.is_set():
            values = [b"key-%d:%09d" % (number % 7, number + i) for i in range(10)]
            number += 10
            future = producer.send(0, [Record(key=b"k", value=v) for v in values])

            def settle(done: asyncio.Future[list[int]], values: list[bytes] = values) -> None:
                error = done.exception()
                if error is not None:
                    failures.append(error)
                    return
                acknowledged.extend(zip(done.result(), values, strict=True))

            future.add_done_callback(settle)
            in_flight.add(future)
            future.add_done_callback(in_flight.discard)
            while len(in_flight) >= 8:
                await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
            await asyncio.sleep(0.002)
        if in_flight:
            await asyncio.wait(in_flight, timeout=WAIT_S)

    task = asyncio.create_task(produce())
    victim: NorthguardProcess | None = None
    try:
        await _wait(lambda: len(acknowledged) >= 300, "acknowledgements before the fault")
        meta = request(coordinator, "segment_metadata", name=topic, range_id=1)
        active = meta["segments"][-1]
        victim_id = next(b for b in active["replicas"][1:] if b != "1")  # a follower
        victim = next(p for p in processes if p.name.endswith(f" {victim_id}"))
        fault(victim)
        hit_at = len(acknowledged)
        await _wait(
            lambda: len(acknowledged) >= hit_at + 300, "acknowledgements after the fault", 60
        )
    finally:
        stop.set()
        await task
        if victim is not None and recover is not None:
            recover(victim)
    assert failures == []
    await producer.close()

    try:
        await assert_read_back(backend, topic, 0, acknowledged)
    finally:
        await backend.close()
    segments = request(coordinator, "segment_metadata", name=topic, range_id=1)["segments"]
    hit = next(s for s in segments if s["segment_id"] == active["segment_id"])
    assert hit["state"] == "sealed"
    after = [s for s in segments if s["start_offset"] >= hit["end_offset"]]
    assert after and all(len(s["replicas"]) == 3 for s in after)
    if moved:
        assert all(victim_id not in s["replicas"] for s in after)
    return victim_id, hit


@pytest.mark.slow
async def test_sigkill_of_a_follower_under_keyed_produce(
    four_brokers: list[NorthguardProcess],
) -> None:
    """The producer moves on to a new segment without the dead broker; the sealed segment is
    sealed on two byte-identical replicas, then re-replicated from the coordinator's replica
    over the consume protocol to the fourth broker: three identical replicas again."""
    victim_id, hit = await keyed_produce_through(four_brokers, "kill", lambda p: p.kill())
    assert victim_id not in hit["replicas"]
    coordinator = four_brokers[0]
    status = request(coordinator, "cluster_status")
    assert {r["broker_id"]: r["live"] for r in status["brokers"]}[victim_id] is False

    def healed() -> bool:
        return request(coordinator, "cluster_status")["under_replicated"] == []

    wait_until(healed, "re-replication of the under-replicated segments", 60)
    metrics = broker_metrics(coordinator)
    assert metrics["northguard_replica_failures_total"] >= 1
    assert metrics["northguard_segments_healed_total"] >= 1
    wait_until(
        lambda: broker_metrics(coordinator)["northguard_under_replicated_segments"] == 0,
        "the under-replicated gauge's next scan",
    )
    segments = request(coordinator, "segment_metadata", name="kill", range_id=1)["segments"]
    now = next(s for s in segments if s["segment_id"] == hit["segment_id"])
    assert len(now["replicas"]) == 3 and victim_id not in now["replicas"]
    # the two survivors, then the copy (which may have been made before ``hit`` was read)
    assert now["replicas"][:2] == hit["replicas"][:2]
    live = [p for p in four_brokers if p.name.rsplit(" ", 1)[-1] != victim_id]
    assert len(set(checksums(live, now).values())) == 1


@pytest.mark.slow
async def test_sigstop_of_a_follower_past_its_timeout(
    four_brokers: list[NorthguardProcess],
) -> None:
    """A stopped follower keeps its socket open: the replica timeout (2 s here) finds it, and the
    segment is sealed on the two others.  Producers resume within about two replica timeouts
    (the unanswered appends, then the unanswered fence); sends wait, none fails."""
    victim_id, hit = await keyed_produce_through(
        four_brokers,
        "stop",
        lambda p: os.kill(p.pid, signal.SIGSTOP),
        lambda p: os.kill(p.pid, signal.SIGCONT),
    )
    # sealed on the two others; re-replication may already have added the fourth broker
    assert victim_id not in hit["replicas"] and len(hit["replicas"]) in (2, 3)
    live = [p for p in four_brokers if p.name.rsplit(" ", 1)[-1] != victim_id]
    assert len(set(checksums(live, hit).values())) == 1


async def _wait(condition: Any, what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


@pytest.mark.slow
async def test_sigkill_and_restart_of_the_coordinator(
    three_brokers: list[NorthguardProcess],
) -> None:
    """The coordinator leads the range's segment here (the first segment's leader is the
    least-led broker, ties to the lowest id), so its SIGKILL stops produce until it is
    back; on restart it fences the replicated active segment at the smallest end among the
    replicas (nothing acknowledged lost, no unacknowledged tail published), rebuilds the
    producer table from it, and the producer's resends are neither lost nor stored twice."""
    coordinator = three_brokers[0]

    def restart(_: NorthguardProcess) -> None:
        coordinator.kill()
        coordinator.restart()

    _, hit = await keyed_produce_through(three_brokers, "restart", restart, moved=False)
    assert sorted(hit["replicas"]) == ["1", "2", "3"]
    assert len(set(checksums(three_brokers, hit).values())) == 1


async def test_a_record_is_readable_only_once_every_replica_has_it(tmp_path: Path) -> None:
    """The commit rule on processes: with one follower stopped (a replica timeout far away),
    a send is neither acknowledged nor visible to a tailing reader nor counted in the range's end
    offset; once the follower runs again it is all three."""
    processes = start_northguard_cluster(
        tmp_path, 3, replication_factor=3, extra_args=["--replica-timeout-s", "120"]
    )
    backend = backend_for(processes[0].url)
    stopped: NorthguardProcess | None = None
    try:
        await backend.create_topic("visible", shard_ranges(1))
        producer = backend.producer("visible", ProducerOptions(linger_ms=0))
        assert await producer.send(0, [Record(value=b"first")]) == [0]
        reader = backend.reader("visible")
        reader.assign({0: 0})
        assert [r.value for r in await read_until(reader, 1)] == [b"first"]
        stopped = processes[2]
        os.kill(stopped.pid, signal.SIGSTOP)
        pending = producer.send(0, [Record(value=b"second")])
        seen = await reader.poll(max_records=10, timeout_s=1.0)
        assert seen == [] and not pending.done()
        ends = await reader.end_offsets([0])
        assert ends == {0: 1}
        os.kill(stopped.pid, signal.SIGCONT)
        stopped = None
        assert await asyncio.wait_for(pending, WAIT_S) == [1]
        assert [r.value for r in await read_until(reader, 1)] == [b"second"]
        await reader.close()
    finally:
        if stopped is not None:
            os.kill(stopped.pid, signal.SIGCONT)
        await backend.close()
        for process in reversed(processes):
            process.stop()


async def test_status_command_shows_brokers_replica_sets_and_load(
    three_brokers: list[NorthguardProcess],
) -> None:
    """``xinfra northguard status``: text and ``--json``, through any bootstrap address (a dead
    one first is skipped)."""
    backend = backend_for(three_brokers[0].url)
    try:
        await backend.create_topic("shown", shard_ranges(1))
        producer = backend.producer("shown", ProducerOptions(linger_ms=0))
        await producer.send(0, [Record(value=b"x" * 100) for _ in range(10)])
    finally:
        await backend.close()
    bootstrap = ",".join(["127.0.0.1:1", three_brokers[2].url])
    runner = CliRunner()
    result = runner.invoke(cli.app, ["status", "--bootstrap", bootstrap, "--json"])
    assert result.exit_code == 0, result.output
    status = json.loads(result.output)
    [segment] = [s for s in status["segments"] if s["topic"] == "shown"]
    assert sorted(segment["replicas"]) == ["1", "2", "3"] and segment["state"] == "active"
    rows = {row["broker_id"]: row for row in status["brokers"]}
    assert all(rows[b]["active_segments"] == 1 for b in ("1", "2", "3"))
    text = runner.invoke(cli.app, ["status", "--bootstrap", bootstrap])
    assert text.exit_code == 0, text.output
    assert "coordinator: broker 1" in text.output
    assert "attrs=rack=r2" in text.output
    assert "replicas=1," in text.output and "under-replicated: 0" in text.output
    down = runner.invoke(cli.app, ["status", "--bootstrap", "127.0.0.1:1"])
    assert down.exit_code == 4 and "backend_unavailable" in down.output


async def test_storage_policies_are_defined_checked_and_place_segments(
    three_brokers: list[NorthguardProcess],
) -> None:
    """``xinfra northguard policies``: an invalid policy is refused with what is wrong; a valid
    one is listed, kept across a coordinator restart and places replicas (distinct racks); a
    policy no live broker set satisfies blocks only its own topic's segments and says why."""
    runner = CliRunner()
    member = three_brokers[1].url  # a member forwards to the coordinator
    base = ["--bootstrap", member]

    def policies(*args: str) -> Any:
        return runner.invoke(cli.app, ["policies", *args, *base])

    bad = policies("create", "broken", "--constraint", "rack-r1:1")
    assert bad.exit_code == 1 and "not key=value" in bad.output, bad.output
    too_many = policies("create", "huge", "--constraint", "*:17")
    assert too_many.exit_code == 1 and "at most 16" in too_many.output
    made = policies("create", "per-rack", "--constraint", "*:3", "--distinct-by", "rack")
    assert made.exit_code == 0, made.output
    assert policies("create", "per-rack", "--constraint", "*:1").exit_code == 1  # exists
    assert policies("create", "rack-r9", "--constraint", "rack=r9:1").exit_code == 0
    assert policies("validate", "per-rack").exit_code == 0
    blocked = policies("validate", "rack-r9")
    assert blocked.exit_code == 1 and "rack=r9" in blocked.output

    three_brokers[0].kill()
    three_brokers[0].restart()
    listed = runner.invoke(cli.app, ["policies", "list", "--json", *base])
    assert listed.exit_code == 0, listed.output
    names = {p["name"]: p for p in json.loads(listed.output)}
    assert names["per-rack"]["distinct_by"] == "rack" and "rack-r9" in names

    wait_until(
        lambda: sum(b["live"] for b in request(three_brokers[0], "cluster_status")["brokers"]) == 3,
        "the members after the coordinator's restart",
    )
    backend = backend_for(three_brokers[0].url)
    try:
        await backend.create_topic("placed", shard_ranges(1), {"policy": "per-rack"})
        await backend.create_topic("stuck", shard_ranges(1), {"policy": "rack-r9"})
        with pytest.raises(XinfraError, match="unknown storage policy"):
            await backend.create_topic("nowhere", shard_ranges(1), {"policy": "nope"})
        placed = backend.producer("placed", ProducerOptions(linger_ms=0))
        stuck = backend.producer("stuck", ProducerOptions(linger_ms=0, request_timeout_s=3))
        failed = stuck.send(0, [Record(value=b"never")])
        assert await placed.send(0, [Record(value=b"placed")]) == [0]
        with pytest.raises(XinfraError, match="rack=r9"):
            await failed
    finally:
        await backend.close()
    [segment] = request(three_brokers[0], "segment_metadata", name="placed", range_id=1)["segments"]
    racks = {"1": "r1", "2": "r2", "3": "r3"}
    assert sorted(racks[b] for b in segment["replicas"]) == ["r1", "r2", "r3"]
    assert request(three_brokers[0], "segment_metadata", name="stuck", range_id=2)["segments"] == []


SECRET = "n0rthguard-cluster-secret-0123456789"


async def test_a_cluster_with_a_secret_replicates_and_refuses_strangers(tmp_path: Path) -> None:
    """Brokers authenticate to each other with the cluster secret (a credential each signs
    itself); a client with a tenant's scoped credential may produce but not drive replicas."""
    processes = start_northguard_cluster(tmp_path, 3, replication_factor=3, secret=SECRET)
    try:
        backend = backend_for(processes[2].url, **{credentials.SECRET_ATTRIBUTE: SECRET})
        try:
            await backend.create_topic("xinfra.1.a.secured", shard_ranges(1))
            producer = backend.producer("xinfra.1.a.secured", ProducerOptions(linger_ms=0))
            assert await producer.send(0, [Record(value=b"v%d" % i) for i in range(50)]) == list(
                range(50)
            )
        finally:
            await backend.close()
        tenant = credentials.sign(
            SECRET.encode(), "vc:a", "xinfra.1.a.", credentials.OPERATIONS, 300.0
        )
        with pytest.raises(XinfraError, match="may not"):
            request_blocking(
                processes[1].url, "replica_fence", WAIT_S, credential=tenant, segment_id="r1-2"
            )
        with pytest.raises(XinfraError, match="credential"):
            request(processes[1], "cluster_status")
        meta = request_blocking(
            processes[0].url,
            "seal_segment",
            WAIT_S,
            credential=tenant,
            name="xinfra.1.a.secured",
            range_id=1,
        )
        [segment] = meta["segments"]
        assert sorted(segment["replicas"]) == ["1", "2", "3"] and segment["end_offset"] == 50
    finally:
        for process in reversed(processes):
            process.stop()


@pytest.mark.slow
async def test_a_follower_left_out_of_a_seal_loses_its_orphan_copy(
    clusters: Callable[..., list[NorthguardProcess]],
) -> None:
    """Three brokers, a topic of replication factor 2: a SIGKILLed follower is left out of the
    seal, the segment is healed onto the third broker, and once the follower is back its stale
    copy (still active in its store) is deleted by the coordinator's orphan scan."""
    processes = clusters(
        3, replication_factor=1, extra_args=[*REPLICA_TIMEOUT_ARGS, "--orphan-scan-s", "0.3"]
    )
    coordinator = processes[0]
    backend = backend_for(coordinator.url, request_timeout_s="60")
    try:
        await backend.create_topic("orphans", shard_ranges(1), {"replication.factor": "2"})
        producer = backend.producer("orphans", ProducerOptions(linger_ms=0, request_timeout_s=60))
        assert await producer.send(0, [Record(value=b"a%d" % i) for i in range(20)]) == list(
            range(20)
        )
        [segment] = request(coordinator, "segment_metadata", name="orphans", range_id=1)["segments"]
        victim_id = segment["replicas"][1]
        victim = next(p for p in processes if p.name.endswith(f" {victim_id}"))
        victim.kill()
        assert await producer.send(0, [Record(value=b"b")]) == [20]  # on a new segment
    finally:
        await backend.close()

    def healed() -> bool:
        meta = request(coordinator, "segment_metadata", name="orphans", range_id=1)
        first = meta["segments"][0]
        return first["state"] == "sealed" and len(first["replicas"]) == 2

    wait_until(healed, "the sealed segment's second replica", 60)
    victim.restart()

    def gone() -> bool:
        try:
            request(victim, "replica_checksum", segment_id=segment["segment_id"])
        except XinfraError as error:
            return error.code == "not_found"
        return False

    wait_until(gone, "the orphan copy's deletion on the restarted follower", 60)
    # The follower deletes before the coordinator reads its reply and counts the deletion.
    wait_until(
        lambda: broker_metrics(coordinator)["northguard_orphan_segments_deleted_total"] >= 1,
        "the coordinator's count of the orphan deleted",
        60,
    )
    first = request(coordinator, "segment_metadata", name="orphans", range_id=1)["segments"][0]
    assert victim_id not in first["replicas"]
    live = [p for p in processes if p is not victim]
    assert len(set(checksums(live, first).values())) == 1


async def test_a_tls_cluster_replicates_over_tls(
    clusters: Callable[..., list[NorthguardProcess]], tmp_path: Path
) -> None:
    """Brokers whose client port speaks TLS talk to each other over TLS too (checking the
    peers' certificates against --peer-tls-ca): a TLS client's records reach three replicas."""
    files = make_test_certificates(tmp_path / "certs")
    processes = clusters(3, replication_factor=3, tls=files)
    backend = backend_for(
        processes[1].url, **{tls.TLS_ATTRIBUTE: "true", tls.CA_ATTRIBUTE: str(files.ca)}
    )
    try:
        await backend.create_topic("encrypted", shard_ranges(1))
        producer = backend.producer("encrypted", ProducerOptions(linger_ms=0))
        assert await producer.send(0, [Record(value=b"s%d" % i) for i in range(30)]) == list(
            range(30)
        )
        reader = backend.reader("encrypted")
        reader.assign({0: 0})
        assert len(await read_until(reader, 30)) == 30
        await reader.close()
    finally:
        await backend.close()
    context = tls.client_context({tls.TLS_ATTRIBUTE: "true", tls.CA_ATTRIBUTE: str(files.ca)})
    meta = request_blocking(
        processes[0].url,
        "seal_segment",
        WAIT_S,
        tls_context=context,
        name="encrypted",
        range_id=1,
    )
    [segment] = meta["segments"]
    assert sorted(segment["replicas"]) == ["1", "2", "3"] and segment["end_offset"] == 30
