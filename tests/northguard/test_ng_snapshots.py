"""Metadata snapshots: built off the event loop while requests are served, safe under a SIGKILL
mid-build (a torn ``snapshot.tmp``), and bounded by ``sealed_segments_max`` however many segments
are sealed and deleted.

The build is paused and observed through ``Coordinator.snapshot_hook`` (called in the build's
worker thread), never by timing."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from ng_harness import WAIT_S, broker_metrics, in_process_broker, wait_for

from backends.northguard.batch import encode_batch
from backends.northguard.broker.server import Broker, BrokerConfig
from backends.northguard.broker.state import MetadataState, State
from backends.northguard.client.admin import AdminClient
from backends.northguard.launcher import start_northguard_broker
from backends.northguard.runtime import RealRuntime
from xinfra.keyspace import shard_ranges
from xinfra.model import Record

REPO = Path(__file__).resolve().parents[2]


async def _write_and_seal_all(broker: Broker, topic: str, value: bytes) -> None:
    """One record in every range of ``topic``, then seal every range's segment: 2 ops per range."""
    coordinator = broker.coordinator
    ranges = coordinator.topic(topic).ranges

    async def one(rid: int) -> None:
        await coordinator.range_log(topic, rid).append(encode_batch([Record(value=value)], 0), 1)

    await asyncio.gather(*(one(rid) for rid in ranges))
    for rid in ranges:
        await coordinator.logs[rid].seal_active()


def _as_json(state: dict[str, Any]) -> Any:
    return json.loads(json.dumps(state))


async def test_requests_are_answered_while_a_large_snapshot_is_built(tmp_path: Path) -> None:
    broker = await in_process_broker(tmp_path / "data", snapshot_ops_max=500, maintenance_s=3600)
    coordinator = broker.coordinator
    building, release = threading.Event(), threading.Event()

    def hold_the_build(stage: str) -> None:
        if stage == "built":
            building.set()
            release.wait(WAIT_S)

    coordinator.snapshot_hook = hold_the_build
    admin = AdminClient(RealRuntime(), f"127.0.0.1:{broker.port}", 10)
    try:
        await coordinator.create_topic("big", shard_ranges(300), {})
        for round_ in range(2):  # 1,200 ops: a snapshot of 600 segments starts on the way
            await _write_and_seal_all(broker, "big", b"%d" % round_)
        assert await asyncio.to_thread(building.wait, WAIT_S), "no snapshot build started"
        # The build is in its worker thread, held: the loop serves reads and decides new ops.
        await admin.create_topic("during", shard_ranges(4))
        assert "during" in await admin.list_topics()
        assert len((await admin.topic("big")).ranges) == 300
        assert coordinator.snapshots == 0 and building.is_set() and not release.is_set()
        release.set()

        async def snapshotted() -> bool:
            return coordinator.snapshots >= 1

        await wait_for(snapshotted, "the snapshot to be installed")
        assert coordinator.snapshot_bytes > 600 * 100  # every segment is in it
        assert coordinator.snapshot_build_s > 0
        expected = _as_json(coordinator.state.to_json())
    finally:
        release.set()
        await admin.close()
        await broker.stop()
    broker = await in_process_broker(tmp_path / "data", maintenance_s=3600)
    try:  # the snapshot plus the ops decided during its build: the whole state
        assert _as_json(broker.coordinator.state.to_json()) == expected
    finally:
        await broker.stop()


async def test_snapshots_built_one_after_another_hold_every_op(tmp_path: Path) -> None:
    """After the first, a build brings the last build's state forward instead of reading the
    disk: three of them in a row, then a restart from the last, lose and repeat nothing."""
    broker = await in_process_broker(tmp_path / "data", snapshot_ops_max=100, maintenance_s=3600)
    coordinator = broker.coordinator
    try:
        await coordinator.create_topic("t", shard_ranges(40), {})
        round_ = 0
        while coordinator.snapshots < 3:  # 80 ops a round
            assert round_ < 60, f"only {coordinator.snapshots} snapshots in {round_} rounds"
            await _write_and_seal_all(broker, "t", b"%d" % round_)
            round_ += 1
        await coordinator.create_topic("later", shard_ranges(2), {})
        await coordinator.delete_topic("later")
        expected = _as_json(coordinator.state.to_json())
    finally:
        await broker.stop()
    broker = await in_process_broker(tmp_path / "data", maintenance_s=3600)
    try:
        assert _as_json(broker.coordinator.state.to_json()) == expected
    finally:
        await broker.stop()


_CRASHING_BROKER = """
import asyncio, json, os, signal, sys, threading
from pathlib import Path
sys.path.insert(0, "tests/northguard")
from ng_harness import WAIT_S, in_process_broker
from test_ng_snapshots import _write_and_seal_all
from backends.northguard.batch import encode_batch
from xinfra.keyspace import shard_ranges
from xinfra.model import Record

data = Path(sys.argv[1])

async def main() -> None:
    broker = await in_process_broker(data, snapshot_ops_max=100, maintenance_s=3600)
    coordinator = broker.coordinator
    waiting, kill = threading.Event(), threading.Event()

    def crash_in_the_second_build(stage: str) -> None:
        if stage == "written" and coordinator.snapshots >= 1:
            waiting.set()
            kill.wait(WAIT_S)
            temporary = data / "meta" / "snapshot.tmp"
            os.truncate(temporary, temporary.stat().st_size // 2)  # a torn snapshot write
            os.kill(os.getpid(), signal.SIGKILL)

    coordinator.snapshot_hook = crash_in_the_second_build
    await coordinator.create_topic("t", shard_ranges(40), {})
    round_ = 0
    while not waiting.is_set():  # 80 ops a round: a first snapshot, then a second one held
        assert round_ < 50, "the second snapshot build never started"
        await _write_and_seal_all(broker, "t", b"%d" % round_)
        round_ += 1
    # Ops after the held snapshot's op number: only the journal has them.
    await coordinator.create_topic("after", shard_ranges(3), {})
    await coordinator.delete_topic("after")
    await coordinator.create_topic("kept", shard_ranges(2), {})
    rid = coordinator.topic("kept").ranges[0]
    await coordinator.range_log("kept", rid).append(encode_batch([Record(value=b"last")], 0), 1)
    expected = {"state": coordinator.state.to_json(), "rounds": round_}
    (data.parent / "expected.json").write_text(json.dumps(expected))
    kill.set()
    await asyncio.Event().wait()  # the build thread kills the process

asyncio.run(main())
"""


async def test_a_sigkill_during_a_snapshot_build_loses_no_op(tmp_path: Path) -> None:
    data = tmp_path / "data"
    child = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", _CRASHING_BROKER, str(data)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]
    expected = json.loads((tmp_path / "expected.json").read_text())
    torn = data / "meta" / "snapshot.tmp"
    assert torn.exists()  # the killed build left its file half written
    previous = json.loads((data / "meta" / "snapshot").read_bytes()[8:])
    assert previous["applied_seq"] < expected["state"]["applied_seq"]
    broker = await in_process_broker(data, snapshot_ops_max=100, maintenance_s=3600)
    try:
        coordinator = broker.coordinator
        assert _as_json(coordinator.state.to_json()) == expected["state"]  # every op
        rid = coordinator.topic("kept").ranges[0]
        (entry,) = await coordinator.range_log("kept", rid).read(0, 1 << 20)
        assert entry.end_offset == 1
        for rid in coordinator.topic("t").ranges:
            entries = await coordinator.range_log("t", rid).read(0, 1 << 20)
            assert entries[-1].end_offset >= 1
        # The next snapshot replaces the torn file and installs.
        await _write_and_seal_all(broker, "t", b"again")
        await _write_and_seal_all(broker, "t", b"again")

        async def snapshotted() -> bool:
            return coordinator.snapshots >= 1

        await wait_for(snapshotted, "a snapshot after the crash")
        expected_after = _as_json(coordinator.state.to_json())
    finally:
        await broker.stop()
    broker = await in_process_broker(data, maintenance_s=3600)
    try:
        assert _as_json(broker.coordinator.state.to_json()) == expected_after
    finally:
        await broker.stop()


async def test_the_snapshot_stays_bounded_when_many_segments_are_sealed_and_deleted(
    tmp_path: Path,
) -> None:
    ranges, kept = 4, 3
    broker = await in_process_broker(
        tmp_path / "data", sealed_segments_max=kept, snapshot_ops_max=20, maintenance_s=3600
    )
    coordinator = broker.coordinator
    sizes: list[int] = []
    try:
        await coordinator.create_topic("rolling", shard_ranges(ranges), {})
        for round_ in range(60):  # 240 segments sealed; all but the last 3 per range deleted
            await _write_and_seal_all(broker, "rolling", b"%d" % round_)
            await coordinator.maintain()
            sizes.append(coordinator.snapshot_bytes)
        assert coordinator.snapshots >= 10
        for rid in coordinator.topic("rolling").ranges:
            assert len(coordinator.state.ranges[rid].segments) == kept
            assert coordinator.state.ranges[rid].start_offset == 60 - kept
        assert len(broker.store.segments()) == ranges * kept  # deleted in the store too
    finally:
        await broker.stop()
    on_disk = json.loads((tmp_path / "data" / "meta" / "snapshot").read_bytes()[8:])
    assert len(on_disk["segments"]) <= ranges * (kept + 1)
    early, late = max(sizes[10:30]), max(sizes[30:])
    assert early > 0 and late <= 1.1 * early, sizes  # flat, not growing with history
    # Per range the snapshot holds at most kept + 1 segments: what the setting promises.
    assert late < ranges * (kept + 2) * 400 + 2000


async def test_a_broker_process_takes_the_snapshot_settings_and_exports_the_metrics(
    tmp_path: Path,
) -> None:
    process = await asyncio.to_thread(
        start_northguard_broker,
        tmp_path / "data",
        extra_args=["--snapshot-ops-max", "5", "--sealed-segments-max", "2"],
    )
    try:
        admin = AdminClient(RealRuntime(), process.url, 10)
        try:
            for i in range(12):
                await admin.create_topic(f"t{i}", shard_ranges(2))
        finally:
            await admin.close()

        async def snapshotted() -> bool:
            metrics = await asyncio.to_thread(broker_metrics, process)
            return metrics["northguard_snapshots_total"] >= 1

        await wait_for(snapshotted, "a snapshot after 5 ops")
        metrics = await asyncio.to_thread(broker_metrics, process)
        assert metrics["northguard_snapshot_bytes"] > 0
        assert metrics["northguard_snapshot_build_seconds"] > 0
        await asyncio.to_thread(process.kill)
        await asyncio.to_thread(process.restart)
        # After a restart the gauge reports the snapshot it loaded, before any new one.
        metrics = await asyncio.to_thread(broker_metrics, process)
        assert metrics["northguard_snapshot_bytes"] > 0
        admin = AdminClient(RealRuntime(), process.url, 10)
        try:
            assert sorted(await admin.list_topics()) == sorted(f"t{i}" for i in range(12))
        finally:
            await admin.close()
    finally:
        await asyncio.to_thread(process.stop)


def test_a_sealed_segments_bound_below_one_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="sealed_segments_max"):
        BrokerConfig(data_dir=tmp_path, sealed_segments_max=0)


def test_a_snapshot_round_trips_and_shares_nothing_mutable_with_the_state() -> None:
    """``to_json`` copies by hand (not ``asdict``): what a later op changes in the state, in a
    list or a field, must not reach a snapshot already taken, nor a state built from one."""
    state = MetadataState()
    ops: list[dict[str, Any]] = [
        {"op": "create_topic", "name": "t", "ranges": [[r.start, r.end] for r in shard_ranges(2)],
         "policy": "default", "config": {"retention.ms": "1"}, "created_ms": 1},
        {"op": "open_segment", "range_id": 1, "segment_id": "r1-1", "start_offset": 0,
         "replicas": ["a", "b"], "created_ms": 2},
        {"op": "seal_segment", "segment_id": "r1-1", "end_offset": 5, "sealed_ms": 3},
        {"op": "open_segment", "range_id": 1, "segment_id": "r1-2", "start_offset": 5,
         "replicas": ["a"], "created_ms": 4},
    ]  # fmt: skip
    for seq, op in enumerate(ops, start=1):
        state.apply({**op, "seq": seq})
    snapshot = state.to_json()
    text = json.dumps(snapshot)
    rebuilt = MetadataState.from_json(json.loads(text))
    assert rebuilt == state
    assert rebuilt.segments["r1-1"].state is State.SEALED
    assert rebuilt.ranges[2].end == state.ranges[2].end > 2**53  # exact, through a string

    state.apply({"op": "seal_segment", "segment_id": "r1-2", "end_offset": 9, "sealed_ms": 5,
                 "replicas": ["b"], "seq": 5})  # fmt: skip
    state.ranges[1].children.append(7)
    state.topics["t"].config["retention.ms"] = "2"
    assert json.dumps(snapshot) == text, "the snapshot taken before did not change"
    assert MetadataState.from_json(json.loads(text)) == rebuilt
    from_objects = MetadataState.from_json(state.to_json())  # in process, no JSON text between
    assert from_objects == state
    state.segments["r1-1"].replicas.append("c")
    assert from_objects.segments["r1-1"].replicas == ["a", "b"]
