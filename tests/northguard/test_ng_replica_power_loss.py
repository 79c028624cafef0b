"""Crash consistency of replication: an acknowledged record is on the follower's *disk*.

A SIGKILL keeps the page cache, so only a power loss can tell whether the
leader's acknowledgement waited for the follower's fsync.  Two brokers in
this process, replication factor 2: the leader on a real disk, the follower's
fps store on ``PowerLossDisk`` (through the runtime seam) with a slower group
commit than the leader's, so an acknowledgement that did not wait for the
follower would come before the follower's flush.  The plug is pulled from
inside an acknowledgement; the follower's store is reopened on the surviving
bytes and must hold every record acknowledged until then.  The teeth: the
same test with the follower's WAL fsync a no-op (it still reports success)
must lose acknowledged records.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from ng_harness import WAIT_S, backend_for, wait_for

from backends.northguard.broker.server import Broker, BrokerConfig
from backends.northguard.power_loss import PowerLossIndex, PowerLossRuntime
from backends.northguard.store import FpsStore
from xinfra.backend import ProducerOptions
from xinfra.errors import XinfraError
from xinfra.keyspace import shard_ranges
from xinfra.model import Record

FOLLOWER_DATA = Path("/power-loss/follower")
SENDS = 40
PLUG_AT = 25


def follower_store(runtime: PowerLossRuntime, index: PowerLossIndex) -> FpsStore:
    """Checkpoints far away: what survives is what the WAL's fsync made durable."""
    return FpsStore(
        runtime,
        FOLLOWER_DATA / "store",
        group_commit_ms=20.0,
        checkpoint_ms=3_600_000.0,
        index=index,
    )


async def acknowledged_then_power_loss(tmp_path: Path, skip_fsync: tuple[str, ...]) -> list[int]:
    """Offsets acknowledged before the follower lost power that its reopened replica lacks."""
    leader = Broker(
        BrokerConfig(
            data_dir=tmp_path / "leader",
            port=0,
            cluster=True,
            replication_factor=2,
            group_commit_ms=1.0,
            replica_timeout_s=2.0,
        )
    )
    await leader.start()
    runtime = PowerLossRuntime()
    index = runtime.disk.index()
    store = follower_store(runtime, index)
    follower = Broker(
        BrokerConfig(
            data_dir=FOLLOWER_DATA,
            broker_id="2",
            port=0,
            coordinator=f"127.0.0.1:{leader.port}",
            heartbeat_s=0.05,
        ),
        runtime,
        store=store,
    )
    await follower.start()
    backend = backend_for(f"127.0.0.1:{leader.port}", request_timeout_s="5")
    acked_ends: list[int] = []
    plugged = False
    try:

        async def two_live() -> bool:
            return leader.coordinator.membership.is_live("2")

        await wait_for(two_live, "the follower's registration")
        await backend.create_topic("durable", shard_ranges(1))
        producer = backend.producer("durable", ProducerOptions(linger_ms=0, request_timeout_s=3))

        def on_ack(done: asyncio.Future[list[int]]) -> None:
            nonlocal plugged
            if plugged or done.exception() is not None:
                return
            acked_ends.append(done.result()[-1] + 1)
            if len(acked_ends) == PLUG_AT:
                runtime.disk.skip_fsync = ()
                runtime.disk.power_loss()  # from inside the acknowledgement: nothing runs between
                plugged = True

        runtime.disk.skip_fsync = skip_fsync
        futures = []
        for number in range(SENDS):
            future = producer.send(
                0, [Record(value=b"%06d" % (number * 10 + i)) for i in range(10)]
            )
            future.add_done_callback(on_ack)
            futures.append(future)
            await asyncio.sleep(0.001)
        await asyncio.wait(futures, timeout=WAIT_S)
        assert plugged, f"only {len(acked_ends)} sends were acknowledged"
        segment_id = leader.coordinator.state.ranges[1].segments[0]
    finally:
        with contextlib.suppress(XinfraError):
            await backend.close()
        await store.crash()
        with contextlib.suppress(Exception):
            await follower.stop()
        await leader.stop()
    reopened = follower_store(runtime, index.reopened())
    await reopened.open()
    try:
        end = reopened.segment(segment_id).end_offset
    finally:
        await reopened.close()
    return [e for e in acked_ends if e > end]


async def test_every_acknowledged_record_is_on_the_followers_disk(tmp_path: Path) -> None:
    assert await acknowledged_then_power_loss(tmp_path, ()) == []


async def test_the_check_fails_when_the_follower_skips_its_fsync(tmp_path: Path) -> None:
    lost = await acknowledged_then_power_loss(tmp_path, (".wal",))
    assert lost, "a follower without fsync lost nothing: the check has no teeth"
