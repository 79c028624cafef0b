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
from test_ng_cluster import REPLICA_TIMEOUT_ARGS, request, wait_until

from backends.northguard.broker.metadata_replication import MetadataCopy
from backends.northguard.broker.placement import BrokerInfo
from backends.northguard.launcher import NorthguardProcess
from backends.northguard.runtime import RealRuntime
from xinfra.backend import ProducerOptions
from xinfra.errors import Conflict
from xinfra.keyspace import shard_ranges
from xinfra.model import Record

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
        "replication_factor": 1,
        "replicas": ["1"],
        "under_replicated": 0,
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
