"""The SDK as a group member, on real tansu: members join and leave under traffic with every
shard owned by at most one member at any moment (from the members' own reports), nothing is lost,
duplicates stay within at-least-once, a new member resumes from checkpoints, and a group reads a
topic through its epochs."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter

from groups_harness import ADMIN_TOKEN, VC, Deadline, ThreadService, create_topic
from waiting import wait_until

from clients import GroupOptions, XinfraConsumer, open_consumer, open_producer
from xinfra.rest import MetadataClient


class Recorder:
    """A rebalance listener that keeps what it was told, to check nobody is told to revoke."""

    def __init__(self) -> None:
        self.revoked: list[tuple[str, int]] = []
        self.assigned: list[tuple[str, int]] = []
        self.lost: list[tuple[str, int]] = []

    async def on_revoked(self, shards: list[tuple[str, int]]) -> None:
        self.revoked += shards

    async def on_assigned(self, shards: list[tuple[str, int]]) -> None:
        self.assigned += shards

    async def on_lost(self, shards: list[tuple[str, int]]) -> None:
        self.lost += shards


async def produce(url: str, topic: str, values: list[bytes]) -> None:
    producer = await open_producer(url=url, token=ADMIN_TOKEN, virtual_cluster=VC)
    try:
        futures = [await producer.send(topic, v, key=v) for v in values]
        await asyncio.gather(*futures)
    finally:
        await producer.close()


async def member(url: str, group: str, **options: object) -> XinfraConsumer:
    return await open_consumer(
        url=url,
        token=ADMIN_TOKEN,
        virtual_cluster=VC,
        group=group,
        group_options=GroupOptions(auto_commit_interval_s=0.2, **options),  # type: ignore[arg-type]
    )


def assert_disjoint(consumers: list[XinfraConsumer]) -> None:
    owned = [s for c in consumers if c.membership for s in c.membership.owned()]
    assert len(owned) == len(set(owned)), f"a shard owned twice: {sorted(owned)}"


async def test_members_join_and_leave_under_traffic(service: ThreadService, kafka: str) -> None:
    topic = f"t-{uuid.uuid4().hex[:8]}"
    create_topic(service.url, topic, shards=6)
    group = f"g-{uuid.uuid4().hex[:8]}"
    total = 3000
    values = [f"v{i}".encode() for i in range(total)]
    await produce(service.url, topic, values[:1000])
    seen: Counter[bytes] = Counter()
    a = await member(service.url, group)
    b: XinfraConsumer | None = None
    try:
        await a.subscribe([topic])
        assert len(a.membership.owned()) == 6  # type: ignore[union-attr]
        producing = asyncio.create_task(produce(service.url, topic, values[1000:]))
        rounds = 0
        while len(seen) < total:
            consumers = [a] if b is None else [a, b]
            for consumer in consumers:
                for record in await consumer.poll(200, timeout_s=0.2):
                    seen[record.value or b""] += 1
                assert_disjoint(consumers)
            rounds += 1
            if rounds == 3:
                b = await member(service.url, group)
                await b.subscribe([topic])
            if rounds == 40 and b is not None:
                await b.close()  # leaves: its shards go back to a
                b = None
            assert rounds < 1000, f"only {len(seen)} of {total} records after {rounds} rounds"
        await producing
    finally:
        await a.close()
        if b is not None:
            await b.close()
    assert set(seen) == set(values), "records lost"
    duplicates = sum(seen.values()) - total
    # Every move here is graceful: a revoked shard's position is committed before it moves and a
    # leaving member commits before it leaves, so the new owner starts exactly where it stopped.
    assert duplicates == 0, f"{duplicates} duplicates in graceful rebalances"


async def test_unaffected_member_is_never_told_to_revoke(
    service: ThreadService, kafka: str
) -> None:
    x, y = f"x-{uuid.uuid4().hex[:8]}", f"y-{uuid.uuid4().hex[:8]}"
    create_topic(service.url, x, shards=2)
    create_topic(service.url, y, shards=2)
    group = f"g-{uuid.uuid4().hex[:8]}"
    await produce(service.url, x, [f"x{i}".encode() for i in range(200)])
    recorder = Recorder()
    a = await member(service.url, group)
    c = await member(service.url, group)
    try:
        await a.subscribe([x], recorder)
        got = len(await a.poll(50, timeout_s=2))
        # c joins on another topic: a's target does not change, so a keeps consuming.
        await c.subscribe([y])
        await wait_until(lambda: _owns(c, 2), what="c to own its shards")
        deadline = Deadline(60, "a to read its 200 records")
        while got < 200:
            deadline.check()
            got += len(await a.poll(200, timeout_s=1))
        assert recorder.revoked == [] and recorder.lost == []
        assert sorted(recorder.assigned) == [(x, 0), (x, 1)]
    finally:
        await a.close()
        await c.close()


async def _owns(consumer: XinfraConsumer, count: int) -> bool:
    await consumer.poll(10, timeout_s=0.05)  # rebalances are applied inside poll
    assert consumer.membership is not None
    return len(consumer.membership.owned()) == count


async def test_a_new_member_resumes_from_the_checkpoints(
    service: ThreadService, kafka: str
) -> None:
    topic = f"t-{uuid.uuid4().hex[:8]}"
    create_topic(service.url, topic, shards=2)
    group = f"g-{uuid.uuid4().hex[:8]}"
    values = [f"v{i}".encode() for i in range(100)]
    await produce(service.url, topic, values)
    first = await member(service.url, group, auto_commit=False)
    read: list[bytes] = []
    try:
        await first.subscribe([topic])
        deadline = Deadline(60, "the first member to read 100 records")
        while len(read) < 100:
            deadline.check()
            read += [r.value or b"" for r in await first.poll(100, timeout_s=1)]
        await first.commit()
        committed = await first.committed()
        assert sum(p.offset for p in committed.values()) == 100
    finally:
        await first.close()
    await produce(service.url, topic, [b"late-1", b"late-2"])
    second = await member(service.url, group)
    try:
        await second.subscribe([topic])
        later: list[bytes] = []
        deadline = Deadline(60, "the second member to read the late records")
        while len(later) < 2:
            deadline.check()
            later += [r.value or b"" for r in await second.poll(100, timeout_s=1)]
        assert sorted(later) == [b"late-1", b"late-2"]
    finally:
        await second.close()
    with MetadataClient(service.url, token=ADMIN_TOKEN) as client:
        described = client.request("GET", f"/v1/vclusters/{VC}/groups/{group}")
    assert described["state"] == "empty"
    assert sum(s["lag"] for s in described["shards"]) == 0


async def test_a_group_reads_through_epochs(service: ThreadService, kafka: str) -> None:
    topic = f"t-{uuid.uuid4().hex[:8]}"
    create_topic(service.url, topic, shards=2)
    group = f"g-{uuid.uuid4().hex[:8]}"
    await produce(service.url, topic, [f"old{i}".encode() for i in range(40)])
    with MetadataClient(service.url, token=ADMIN_TOKEN, timeout_s=60) as client:
        metadata = await asyncio.to_thread(client.add_epoch, VC, topic, kafka)
    assert [e.number for e in metadata.epochs] == [0, 1]
    await produce(service.url, topic, [f"new{i}".encode() for i in range(40)])
    consumer = await member(service.url, group)
    try:
        await consumer.subscribe([topic])
        got: list[tuple[int, bytes]] = []
        deadline = Deadline(60, "the group to read both epochs")
        while len(got) < 80:
            deadline.check()
            got += [(r.epoch, r.value or b"") for r in await consumer.poll(100, timeout_s=1)]
        assert len({v for _e, v in got}) == 80
        assert {e for e, v in got if v.startswith(b"old")} == {0}
        assert {e for e, v in got if v.startswith(b"new")} == {1}
        await consumer.commit()
        committed = await consumer.committed()
        assert {p.epoch for p in committed.values()} == {1}
    finally:
        await consumer.close()
