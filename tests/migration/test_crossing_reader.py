"""A consumer's position just after it crosses into a migration target resumes past the mirror.

The target of a migration begins with mirrors of source records (the dual
writes), and a consumer that read the source to its end skips them when it
crosses.  Its position at that moment is what a consumer group commits when
the shard moves to another member.  Resumed there, the next owner must skip
the mirrors too: as (target, its first offset) it would deliver them again.
Seen in CI: a group rebalanced while a member crossed, and the member that
took the shard delivered 428 records twice.

A mirror can also come late: at the cut-over one producer's last dual write
can land in the target behind another producer's first target-only record.
A member that delivered that record and then handed the shard over commits a
position in the target; the group keeps the source's end beside it, so the
next owner skips the late mirror as the member would have.
"""

from __future__ import annotations

from sdk_live import ADMIN_TOKEN, VC, LiveService, needs_northguard
from test_migration_live import call, load, more
from waiting import wait_until

from clients import GroupOptions, XinfraRecord, open_consumer, open_producer
from xinfra.model import Epoch, Position, mirror_header

pytestmark = [needs_northguard]


async def migrated(
    live: LiveService, topic: str, source_cluster: str, target_cluster: str
) -> tuple[list[bytes | None], Epoch, Epoch, int]:
    """A one-shard topic moved from one cluster to the other under keyed load: written before and
    during each step, and after it (records the target takes directly, behind the mirrors).
    The values acknowledged, the source and target epochs, and the source's end."""
    await live.create_topic(topic, source_cluster, 1)
    async with load(live, topic) as stream:
        await more(stream)
        await call(live, "POST", topic, target_cluster=target_cluster)
        for state in ("dual_write", "cut_over", "completed"):
            await more(stream)
            await call(live, "POST", topic, "/advance", expected_state=state)
        await more(stream)
    source, target = (await live.metadata(topic)).epochs
    assert target.mirror_of == source.number and source.end_offsets is not None
    return list(stream.acked), source, target, source.end_offsets[0]


async def test_a_position_taken_as_a_consumer_crosses_into_the_target_skips_the_mirrors(
    live: LiveService, northguard: str, second_northguard: str
) -> None:
    topic = "crossed"
    acked, source, target, source_end = await migrated(live, topic, northguard, second_northguard)

    token = await live.client_token("crossing-readers")
    first = await open_consumer(live.url, token, VC)
    then = await open_consumer(live.url, token, VC)
    try:
        await first.assign(topic, start="earliest")
        before: list[XinfraRecord] = []

        async def read_source() -> bool:  # the source to its end, and nothing past it
            before.extend(await first.poll(source_end - len(before), timeout_s=0.2))
            return len(before) >= source_end

        await wait_until(read_source, 30, "the source read to its end")
        assert {r.epoch for r in before} == {source.number}
        # The next poll crosses into the target; what it reads there first are mirrors, skipped.
        assert await first.poll(1, timeout_s=0) == []
        position = first.positions()[(topic, 0)]
        assert position == Position(source.number, 0, source_end)  # what a group commits
        assert first.fetch_positions()[(topic, 0)].epoch == target.number  # where it reads

        await then.assign(topic)
        then.seek(topic, position)  # as a group's next owner of the shard resumes
        after: list[XinfraRecord] = []
        rest = len(acked) - len(before)

        async def read() -> bool:
            after.extend(await then.poll(500, timeout_s=0.2))
            return len(after) >= rest

        await wait_until(read, 30)
        after += await then.poll(500, timeout_s=0.2)  # nothing more may come
    finally:
        await first.close()
        await then.close()

    again = {r.value for r in after} & {r.value for r in before}
    assert not again, f"{len(again)} records delivered before the crossing and again after it"
    assert sorted(r.value for r in before + after) == sorted(acked), "none lost"
    assert {r.epoch for r in after} == {target.number}


async def test_a_mirror_written_late_is_skipped_by_the_next_owner_of_the_shard(
    live: LiveService, northguard: str, second_northguard: str
) -> None:
    topic = "late-mirror"
    acked, source, target, source_end = await migrated(live, topic, northguard, second_northguard)
    options = GroupOptions(auto_commit=False)

    first = await open_consumer(live.url, ADMIN_TOKEN, VC, group="g", group_options=options)
    try:
        await first.subscribe([topic])
        before: list[XinfraRecord] = []

        async def read_all() -> bool:
            before.extend(await first.poll(500, timeout_s=0.2))
            return len(before) >= len(acked)

        await wait_until(read_all, 30, "the source and the target read to their ends")
        position = first.positions()[(topic, 0)]
        assert position.epoch == target.number, "it delivered records the target took directly"
        assert first.crossings() == {(topic, 0): Position(source.number, 0, source_end)}
        await first.commit()
    finally:
        await first.close()  # the shard goes to the next member

    # One producer's last dual write, behind records the target took directly.
    late = next(r for r in before if (r.epoch, r.offset) == (source.number, source_end - 1))
    producer = await open_producer(live.url, ADMIN_TOKEN, VC)
    try:
        mirrored = mirror_header(Position(source.number, 0, late.offset))
        await (await producer.send(topic, late.value, key=late.key, headers=[mirrored]))
        await (await producer.send(topic, b"after the late mirror"))
    finally:
        await producer.close()

    then = await open_consumer(live.url, ADMIN_TOKEN, VC, group="g", group_options=options)
    unaware = await open_consumer(live.url, ADMIN_TOKEN, VC)
    try:
        await then.subscribe([topic])
        await unaware.assign(topic)
        unaware.seek(topic, position)  # the position alone, as the group kept it before
        after: list[XinfraRecord] = []
        control: list[XinfraRecord] = []

        async def read_on() -> bool:
            after.extend(await then.poll(500, timeout_s=0.2))
            control.extend(await unaware.poll(500, timeout_s=0.2))
            values = {r.value for r in after} & {r.value for r in control}
            return b"after the late mirror" in values

        await wait_until(read_on, 30, "both read past the late mirror")
    finally:
        await then.close()
        await unaware.close()

    assert [r.value for r in control] == [late.value, b"after the late mirror"], (
        "without the source's end, the late mirror is delivered again"
    )
    assert [r.value for r in after] == [b"after the late mirror"]
