"""Group checkpoints move with the topic: to the target at the cut-over, back on a rollback.

A group that committed on the source and is idle when the migration moves its
readers must resume on the target at the exactly translated position (the
target record that mirrors the committed source offset), so nothing of it
still depends on the source cluster.  A group that committed on the target
during dual writes must, after a rollback, resume on the source at the
translated position, not from its start.  The checks are independent of the
translation: which values each member read, against what the producer was
told is acknowledged.
"""

from __future__ import annotations

from typing import Any

import pytest
from sdk_live import (
    ADMIN_TOKEN,
    VC,
    LiveService,
    assert_exactly_once,
    assert_per_key_order,
    needs_kafka,
    needs_northguard,
)
from test_migration_live import call, load, more
from waiting import wait_until

from clients import GroupOptions, XinfraConsumer, open_consumer
from clients.consumer import XinfraRecord
from xinfra.backend import open_backend
from xinfra.model import PhysicalCluster

pytestmark = [needs_kafka, needs_northguard]


async def _member(live: LiveService, group: str, topic: str, **options: Any) -> XinfraConsumer:
    consumer = await open_consumer(
        live.url,
        ADMIN_TOKEN,
        VC,
        group=group,
        group_options=GroupOptions(auto_commit_interval_s=600, **options),
    )
    await consumer.subscribe([topic])
    return consumer


async def _read_until(
    consumer: XinfraConsumer, into: list[XinfraRecord], done: Any, timeout_s: float = 60
) -> None:
    async def step() -> bool:
        into.extend(await consumer.poll(500, timeout_s=0.2))
        return bool(done())

    await wait_until(step, timeout_s)


async def _committed(live: LiveService, group: str) -> list[dict[str, Any]]:
    body = await live.call(
        lambda c: c.request("GET", f"/v1/vclusters/{VC}/groups/{group}/checkpoints")
    )
    positions: list[dict[str, Any]] = body["positions"]
    return positions


def _latest(positions: list[dict[str, Any]]) -> dict[int, tuple[int, int]]:
    """Shard -> (epoch, offset) of the latest epoch's row: what a joining member resumes from."""
    out: dict[int, tuple[int, int]] = {}
    for p in sorted(positions, key=lambda p: (p["shard"], p["epoch"])):
        out[p["shard"]] = (p["epoch"], p["offset"])
    return out


async def test_an_idle_groups_checkpoints_move_to_the_target_exactly(
    live: LiveService, kafka: str, northguard: str, xfail_on: Any
) -> None:
    xfail_on("end_offsets")  # the source's end offsets come from tansu's ListOffsets latest
    topic, group = "carried", "carriers"
    await live.create_topic(topic, kafka, 3)
    first: list[XinfraRecord] = []
    async with load(live, topic) as stream:
        await more(stream)
        await call(live, "POST", topic, target_cluster=northguard)
        await call(live, "POST", topic, "/advance", expected_state="dual_write")
        await more(stream, 300)  # every shard now has mirrored records past the commit below
        mark = set(stream.acked)
        member = await _member(live, group, topic)
        try:
            await _read_until(member, first, lambda: mark <= {r.value for r in first})
        finally:
            await member.close()  # commits its positions on the source: the group is idle
        on_source = _latest(await _committed(live, group))
        assert {epoch for epoch, _ in on_source.values()} == {0}, on_source
        await more(stream)
        await call(live, "POST", topic, "/advance", expected_state="cut_over")
        await more(stream)
        done = await call(live, "POST", topic, "/advance", expected_state="completed")
        assert done["state"] == "completed"
        await more(stream)
    moved = _latest(await _committed(live, group))
    assert sorted(moved) == [0, 1, 2]
    assert {epoch for epoch, _ in moved.values()} == {1}, f"not translated: {moved}"
    history = [h for h in done["history"] if h["event"] == "checkpoints_moved"]
    assert history and history[0]["groups"] == {group: 3}, done["history"]

    second: list[XinfraRecord] = []
    member = await _member(live, group, topic)
    try:
        everything = set(stream.acked)
        await _read_until(member, second, lambda: everything <= {r.value for r in first + second})
        second.extend(await member.poll(500, timeout_s=0.5))  # anything read twice shows here
    finally:
        await member.close()
    assert {r.epoch for r in second} == {1}, "the resumed member read the source"
    for shard, (_epoch, offset) in moved.items():
        resumed = min(r.offset for r in second if r.shard == shard)
        assert resumed == offset, f"shard {shard} resumed at {resumed}, not at {offset}"
    values = [r.value for r in first + second]
    assert_exactly_once(values, set(stream.acked))
    for shard in range(3):
        assert_per_key_order([r.value for r in first + second if r.shard == shard])


async def test_a_rollback_returns_target_checkpoints_to_the_source_exactly(
    live: LiveService, kafka: str, northguard: str
) -> None:
    topic, group = "returned", "returners"
    await live.create_topic(topic, kafka, 3)
    first: list[XinfraRecord] = []
    async with load(live, topic) as stream:
        await more(stream)
        await call(live, "POST", topic, target_cluster=northguard)
        await call(live, "POST", topic, "/advance", expected_state="dual_write")
        await more(stream)
        member = await _member(live, group, topic, start="latest")  # the target's end: epoch 1
        try:
            await _read_until(
                member, first, lambda: all(sum(r.shard == s for r in first) >= 20 for s in range(3))
            )
        finally:
            await member.close()
        assert {r.epoch for r in first} == {1}
        assert {e for e, _ in _latest(await _committed(live, group)).values()} == {1}
        await more(stream)
        back = await call(live, "POST", topic, "/rollback")
        assert back["state"] == "rolled_back"
        await more(stream)
    rows = await _committed(live, group)
    assert {p["epoch"] for p in rows} == {0}, f"checkpoints left on the dropped epoch: {rows}"

    # What the group owes: per shard, every acknowledged record from the first one it read.
    starts = {s: min(stream.acked[r.value].offset for r in first if r.shard == s) for s in range(3)}
    owed = {v for v, p in stream.acked.items() if p.offset >= starts[p.shard]}
    second: list[XinfraRecord] = []
    member = await _member(live, group, topic)
    try:
        await _read_until(member, second, lambda: owed <= {r.value for r in first + second})
        second.extend(await member.poll(500, timeout_s=0.5))
    finally:
        await member.close()
    assert {r.epoch for r in second} == {0}
    assert_exactly_once([r.value for r in first + second], owed)
    for shard in range(3):
        assert_per_key_order([r.value for r in first + second if r.shard == shard])


@pytest.mark.parametrize("paused", [False, True])
async def test_a_rollback_deletes_the_target_physical_topic(
    live: LiveService, kafka: str, northguard: str, paused: bool
) -> None:
    topic = f"undone-{'paused' if paused else 'direct'}"
    await live.create_topic(topic, kafka, 2)
    await call(live, "POST", topic, target_cluster=northguard)
    await call(live, "POST", topic, "/advance", expected_state="dual_write")
    target = (await live.metadata(topic)).epochs[1]
    body = await live.call(lambda c: c.request("GET", f"/v1/clusters/{northguard}"))
    fields = {k: v for k, v in body.items() if k in PhysicalCluster.model_fields}
    backend = open_backend(PhysicalCluster.model_validate(fields))
    try:
        assert target.physical_topic in await backend.list_topics()
        if paused:  # a client that never acknowledges: the rollback pauses after the drop
            await live.call(
                lambda c: c.request(
                    "PUT",
                    f"/v1/vclusters/{VC}/clients/silent-2",
                    json={"kind": "consumer", "topics": [topic], "ttl_s": 60},
                )
            )
            stalled = await call(live, "POST", topic, "/rollback", ack_timeout_s=0.3)
            assert (stalled["state"], stalled["pending"], stalled["paused"]) == (
                "dual_write",
                "rollback",
                True,
            )
            assert len((await live.metadata(topic)).epochs) == 1
            assert target.physical_topic in await backend.list_topics(), "deleted before acks"
            await live.call(lambda c: c.request("DELETE", f"/v1/vclusters/{VC}/clients/silent-2"))
        back = await call(live, "POST", topic, "/rollback", ack_timeout_s=10)
        assert back["state"] == "rolled_back"
        assert target.physical_topic not in await backend.list_topics()
    finally:
        await backend.close()
