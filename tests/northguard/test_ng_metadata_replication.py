"""Copies of the coordinator's metadata journal on members, and recovery from them (issue 15).

Real broker processes.  With ``--metadata-replication-factor 3`` the coordinator decides a
metadata op only once two members have fsynced it too; its data directory can then be lost
(SIGKILL, ``rm -r``) and a restart with ``--recover-metadata-from`` rebuilds the journal
from the most complete member copy: topics, segments and every acknowledged record are
intact and production continues.  A metadata replica that dies is replaced by another live
member (snapshot plus the tail), shown in ``cluster_status`` and a metric.  Factor 1 (the
default) keeps the metadata on the coordinator only, as before.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest
from ng_harness import backend_for, broker_metrics, read_until
from test_ng_cluster import REPLICA_TIMEOUT_ARGS, checksums, request, wait_until
from typer.testing import CliRunner

from backends.northguard import cli
from backends.northguard.broker.metadata_replication import MetadataCopy, choose_copy
from backends.northguard.broker.placement import BrokerInfo
from backends.northguard.broker.state import MetadataState
from backends.northguard.launcher import NorthguardProcess
from backends.northguard.runtime import RealRuntime
from xinfra.backend import ProducerOptions
from xinfra.errors import Conflict, Unavailable, XinfraError
from xinfra.keyspace import shard_ranges
from xinfra.model import Record
from xinfra.services.process import ServiceError

META3 = ["--metadata-replication-factor", "3"]


def _metadata(process: NorthguardProcess) -> dict[str, Any]:
    result: dict[str, Any] = request(process, "cluster_status")["metadata"]
    return result


async def _produce(address: str, topic: str, shards: int, first: int, count: int) -> None:
    backend = backend_for(address)
    try:
        producer = backend.producer(topic, ProducerOptions(linger_ms=1))
        for n in range(first, first + count):
            await asyncio.gather(
                *(
                    producer.send(s, [Record(value=b"%s-%d-%d" % (topic.encode(), s, n))])
                    for s in range(shards)
                )
            )
        await producer.close()
    finally:
        await backend.close()


async def _read_all(address: str, topic: str, shards: int, count: int) -> None:
    backend = backend_for(address)
    try:
        for shard in range(shards):
            reader = backend.reader(topic)
            reader.assign({shard: 0})
            got = await read_until(reader, count)
            await reader.close()
            assert [r.value for r in got] == [
                b"%s-%d-%d" % (topic.encode(), shard, n) for n in range(count)
            ]
    finally:
        await backend.close()


def _range_ids(process: NorthguardProcess, topic: str) -> list[int]:
    return [r["range_id"] for r in request(process, "topic_metadata", name=topic)["ranges"]]


def _segments(process: NorthguardProcess, topic: str) -> dict[int, list[str]]:
    """Range id: its segment ids, oldest first."""
    return {
        range_id: [
            s["segment_id"]
            for s in request(process, "segment_metadata", name=topic, range_id=range_id)["segments"]
        ]
        for range_id in _range_ids(process, topic)
    }


async def test_a_lost_coordinator_disk_is_rebuilt_from_member_copies(clusters: Any) -> None:
    processes = clusters(3, replication_factor=3, extra_args=[*META3, *REPLICA_TIMEOUT_ARGS])
    coordinator, members = processes[0], processes[1:]
    wait_until(lambda: _metadata(coordinator)["under_replicated"] == 0, "two metadata copies")
    assert sorted(_metadata(coordinator)["replicas"]) == ["1", "2", "3"]
    address = ",".join(p.url for p in processes)
    backend = backend_for(address)
    try:
        await backend.create_topic("alpha", shard_ranges(3))
        await backend.create_topic("beta", shard_ranges(2))
    finally:
        await backend.close()
    await _produce(address, "alpha", 3, 0, 20)
    await _produce(address, "beta", 2, 0, 20)
    for range_id in _range_ids(coordinator, "alpha"):  # sealed segments too, not only active ones
        request(coordinator, "seal_segment", name="alpha", range_id=range_id)
    await _produce(address, "alpha", 3, 20, 10)
    before = {
        "alpha": _segments(coordinator, "alpha"),
        "beta": _segments(coordinator, "beta"),
    }
    assert broker_metrics(coordinator)["northguard_metadata_replicas"] == 3

    coordinator.kill()
    shutil.rmtree(coordinator.data_dir)
    coordinator.argv += ["--recover-metadata-from", ",".join(m.url for m in members)]
    coordinator.restart()

    assert sorted(request(coordinator, "list_topics")["topics"]) == ["alpha", "beta"]
    after_alpha = _segments(coordinator, "alpha")
    for range_id, segment_ids in before["alpha"].items():  # the restart may seal and open more
        assert after_alpha[range_id][: len(segment_ids)] == segment_ids
    await _read_all(address, "alpha", 3, 30)
    await _read_all(address, "beta", 2, 20)
    await _produce(address, "alpha", 3, 30, 10)  # production continues
    await _read_all(address, "alpha", 3, 40)
    wait_until(lambda: _metadata(coordinator)["under_replicated"] == 0, "copies again")


async def test_a_failed_metadata_replica_is_replaced(clusters: Any) -> None:
    processes = clusters(4, replication_factor=1, extra_args=[*META3, *REPLICA_TIMEOUT_ARGS])
    coordinator = processes[0]
    wait_until(lambda: _metadata(coordinator)["under_replicated"] == 0, "two metadata copies")
    by_id = {p.name.rsplit(" ", 1)[-1]: p for p in processes}
    holders = _metadata(coordinator)["replicas"][1:]
    victim = by_id[holders[0]]
    victim.kill()
    backend = backend_for(coordinator.url)
    try:
        await backend.create_topic("after", shard_ranges(1))  # decided on a replacement copy
    finally:
        await backend.close()
    metadata = _metadata(coordinator)
    assert metadata["replaced"] == 1 and metadata["under_replicated"] == 0
    assert holders[0] not in metadata["replicas"] and len(metadata["replicas"]) == 3
    assert broker_metrics(coordinator)["northguard_metadata_replicas_replaced_total"] == 1
    # the replacement got a snapshot plus the tail: it can serve a recovery with the topic
    newcomer = by_id[next(b for b in metadata["replicas"][1:] if b not in holders)]
    copy = request(newcomer, "meta_fetch")["state"]
    assert [t["name"] for t in copy["topics"]] == ["after"]


async def test_factor_one_keeps_metadata_on_the_coordinator_only(clusters: Any) -> None:
    processes = clusters(3, replication_factor=3)
    backend = backend_for(processes[0].url)
    try:
        await backend.create_topic("solo", shard_ranges(1))
    finally:
        await backend.close()
    assert _metadata(processes[0]) == {
        "policy": None,
        "replication_factor": 1,
        "replicas": ["1"],
        "under_replicated": 0,
        "reason": None,
        "replaced": 0,
    }
    assert request(processes[1], "meta_fetch")["state"] is None


def _create_op(seq: int, name: str) -> dict[str, Any]:
    return {
        "op": "create_topic",
        "seq": seq,
        "name": name,
        "ranges": [["0", str(1 << 64)]],
        "policy": "default",
        "config": {},
        "created_ms": 1,
    }


async def test_a_member_copy_refuses_a_gap_and_survives_its_restart(tmp_path: Path) -> None:
    """In process, on a real disk: ops must follow the copy's last one (a copy that missed
    some is replaced by an install, never patched); an install replaces everything; what
    was answered is on disk after a reopen."""

    me = BrokerInfo("2", {"rack": "a"})
    copy = MetadataCopy(RealRuntime(), tmp_path / "meta-copy", me)
    assert (await copy.handle("meta_fetch", {}))["state"] is None
    await copy.handle("meta_append", {"ops": [_create_op(1, "one")]})
    with pytest.raises(Conflict):
        await copy.handle("meta_append", {"ops": [_create_op(3, "three")]})
    fetched = await copy.handle("meta_fetch", {})
    assert fetched["broker_id"] == "2" and fetched["attributes"] == {"rack": "a"}
    state = fetched["state"]
    assert state["applied_seq"] == 1 and [t["name"] for t in state["topics"]] == ["one"]

    other = MetadataCopy(RealRuntime(), tmp_path / "other", me)
    await other.handle("meta_append", {"ops": [_create_op(1, "x"), _create_op(2, "y")]})
    installed = (await other.handle("meta_fetch", {}))["state"]
    await copy.handle("meta_install", {"state": installed})
    await copy.handle("meta_append", {"ops": [_create_op(3, "z")]})

    reopened = MetadataCopy(RealRuntime(), tmp_path / "meta-copy", me)
    state = (await reopened.handle("meta_fetch", {}))["state"]
    assert state["applied_seq"] == 3
    assert sorted(t["name"] for t in state["topics"]) == ["x", "y", "z"]


def _copy(applied_seq: int, replicas: list[str], recorded_seq: int) -> dict[str, Any]:
    """A member's copy as ``meta_fetch`` answers it: at ``applied_seq``, with the replica set
    ``replicas`` recorded by op ``recorded_seq`` (0: none recorded)."""
    state = MetadataState(applied_seq=applied_seq)
    state.metadata_replicas, state.metadata_replicas_seq = replicas, recorded_seq
    return state.to_json()


def test_recovery_takes_a_copy_only_when_every_member_of_the_newest_set_answered(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """In process, the rule alone: broker 3 failed an append at op 5 and was dropped (op 6
    recorded {1, 2} on broker 2); broker 3's copy alone says {1, 2, 3}, whose member 2 did
    not answer: refused, naming it, unless forced (loudly)."""
    stale = _copy(5, ["1", "2", "3"], 2)
    current = _copy(9, ["1", "2"], 6)
    with pytest.raises(Unavailable, match=r"\b2\b.*did not answer") as refused:
        choose_copy({"3": stale}, ["127.0.0.1:1"], "1", force=False)
    assert "--force-unclean-metadata-recovery" in str(refused.value)
    assert choose_copy({"3": stale, "2": current}, [], "1", force=False) == current
    assert choose_copy({"2": current}, ["127.0.0.1:1"], "1", force=False) == current
    with caplog.at_level("ERROR"):
        assert choose_copy({"3": stale}, [], "1", force=True) == stale
    assert "UNCLEAN METADATA RECOVERY" in caplog.text
    # a copy that records no set cannot show it is current; no copy at all: empty only when
    # every address answered (a new cluster), refused when one may hold the metadata
    with pytest.raises(Unavailable, match="record no metadata replica set"):
        choose_copy({"3": _copy(4, [], 0)}, [], "1", force=False)
    assert choose_copy({}, [], "1", force=False) is None
    with pytest.raises(Unavailable, match=r"127\.0\.0\.1:1"):
        choose_copy({}, ["127.0.0.1:1"], "1", force=False)


async def test_recovery_refuses_a_copy_dropped_from_the_replica_set(clusters: Any) -> None:
    """Broker 3 dies and is dropped from the metadata replica set ({1, 2} decided on broker
    2); the coordinator's disk is then lost.  Recovering from broker 3 alone (its copy is
    behind) is refused with the members not reached; forced, it takes that copy and says so."""
    processes = clusters(3, replication_factor=1, extra_args=[*META3, *REPLICA_TIMEOUT_ARGS])
    coordinator, _second, third = processes
    wait_until(lambda: _metadata(coordinator)["under_replicated"] == 0, "two metadata copies")
    backend = backend_for(coordinator.url)
    try:
        await backend.create_topic("before", shard_ranges(1))
        third.kill()
        await backend.create_topic("after", shard_ranges(1))  # decided on 1 and 2 only
    finally:
        await backend.close()
    assert _metadata(coordinator)["replicas"] == ["1", "2"]
    coordinator.kill()
    shutil.rmtree(coordinator.data_dir)
    third.restart()
    argv = list(coordinator.argv)
    coordinator.argv = [*argv, "--recover-metadata-from", third.url]
    with pytest.raises(ServiceError, match=r"2.*did not answer"):
        coordinator.restart()
    coordinator.argv = [*argv, "--recover-metadata-from", third.url]
    coordinator.argv.append("--force-unclean-metadata-recovery")
    coordinator.restart()
    assert request(coordinator, "list_topics")["topics"] == ["before"]
    assert "UNCLEAN METADATA RECOVERY" in coordinator.log_path.read_text()


async def test_a_metadata_policy_places_copies_on_distinct_racks(clusters: Any) -> None:
    """``--metadata-policy``: the journal's copies go where a storage policy says (three
    distinct racks: brokers 1, 3 and 4, never 2, which shares broker 1's rack).  Until the
    policy is defined the count shorthand applies and the status says why; a rack lost
    with no other broker on a third rack leaves the ops decided on two copies, and
    ``cluster_status`` and ``xinfra northguard status`` say why."""
    racks = [{"rack": "r1"}, {"rack": "r1"}, {"rack": "r2"}, {"rack": "r3"}]
    processes = clusters(
        4,
        replication_factor=1,
        attributes=racks,
        extra_args=["--metadata-policy", "meta-racks", *REPLICA_TIMEOUT_ARGS],
    )
    coordinator, fourth = processes[0], processes[3]
    undefined = _metadata(coordinator)
    assert undefined["replicas"] == ["1"] and "'meta-racks' is not defined" in undefined["reason"]
    policy = {"name": "meta-racks", "constraints": [{"expression": "*", "count": 3}]}
    request(coordinator, "create_policy", policy={**policy, "distinct_by": "rack"})
    wait_until(lambda: _metadata(coordinator)["under_replicated"] == 0, "copies on three racks")
    placed = _metadata(coordinator)
    assert sorted(placed["replicas"]) == ["1", "3", "4"] and placed["reason"] is None
    assert placed["policy"]["name"] == "meta-racks" and placed["replication_factor"] == 3

    fourth.kill()
    backend = backend_for(coordinator.url)
    try:
        await backend.create_topic("two-racks", shard_ranges(1))  # decided on 1 and 3
    finally:
        await backend.close()
    short = _metadata(coordinator)
    assert short["replicas"] == ["1", "3"] and short["under_replicated"] == 1
    assert "distinct 'rack'" in short["reason"]
    text = CliRunner().invoke(cli.app, ["status", "--bootstrap", coordinator.url])
    assert text.exit_code == 0, text.output
    assert "metadata copies short: storage policy 'meta-racks'" in text.output
    assert "copies on 1,3 (short 1" in text.output


async def test_sealed_segments_on_a_lost_coordinator_disk_are_re_replicated(
    clusters: Any,
) -> None:
    """Replication factor 3 on three brokers: every sealed segment has a replica on the
    coordinator.  Its disk is lost and the metadata recovered from a copy: the recovered
    metadata still names broker 1 for segments its store no longer has; self-healing copies
    them back from the survivors until every replica answers with the same checksum."""
    processes = clusters(3, replication_factor=3, extra_args=[*META3, *REPLICA_TIMEOUT_ARGS])
    coordinator, members = processes[0], processes[1:]
    wait_until(lambda: _metadata(coordinator)["under_replicated"] == 0, "two metadata copies")
    backend = backend_for(coordinator.url)
    try:
        await backend.create_topic("healed", shard_ranges(2))
    finally:
        await backend.close()
    await _produce(coordinator.url, "healed", 2, 0, 15)
    for range_id in _range_ids(coordinator, "healed"):
        request(coordinator, "seal_segment", name="healed", range_id=range_id)
    sealed = [
        s
        for s in request(coordinator, "cluster_status")["segments"]
        if s["topic"] == "healed" and s["state"] == "sealed"
    ]
    assert len(sealed) == 2 and all(sorted(s["replicas"]) == ["1", "2", "3"] for s in sealed)
    before = {s["segment_id"]: set(checksums(processes, s).values()) for s in sealed}
    assert all(len(sums) == 1 for sums in before.values())

    coordinator.kill()
    shutil.rmtree(coordinator.data_dir)
    coordinator.argv += ["--recover-metadata-from", ",".join(m.url for m in members)]
    coordinator.restart()

    def healed() -> bool:
        status = request(coordinator, "cluster_status")
        by_id = {s["segment_id"]: s for s in status["segments"]}
        for segment_id in before:
            segment = by_id[segment_id]
            if sorted(segment["replicas"]) != ["1", "2", "3"]:
                return False
            try:
                sums = checksums(processes, segment)
            except XinfraError:  # broker 1 does not hold it (yet)
                return False
            if set(sums.values()) != before[segment_id]:
                return False
        return True

    wait_until(healed, "sealed segments back on three brokers, byte-identical")
    await _read_all(coordinator.url, "healed", 2, 15)
