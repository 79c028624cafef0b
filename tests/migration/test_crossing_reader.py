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
from xinfra.model import Position, mirror_header

pytestmark = [needs_northguard]


async def test_a_position_taken_as_a_consumer_crosses_into_the_target_skips_the_mirrors(
    live: LiveService, northguard: str, second_northguard: str
) -> None:
    topic = "crossed"
    await live.create_topic(topic, northguard, 1)
    async with load(live, topic) as stream:
        await more(stream)
        await call(live, "POST", topic, target_cluster=second_northguard)
        for state in ("dual_write", "cut_over", "completed"):
            await more(stream)
            await call(live, "POST", topic, "/advance", expected_state=state)
        await more(stream)
    source, target = (await live.metadata(topic)).epochs
    assert target.mirror_of == source.number and source.end_offsets is not None
    source_end = source.end_offsets[0]

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
        rest = len(stream.acked) - len(before)

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
    assert sorted(r.value for r in before + after) == sorted(stream.acked), "none lost"
    assert {r.epoch for r in after} == {target.number}


async def test_a_mirror_written_late_is_skipped_by_the_next_owner_of_the_shard(
    live: LiveService, northguard: str, second_northguard: str
) -> None:
    topic = "late-mirror"
    await live.create_topic(topic, northguard, 1)
    async with load(live, topic) as stream:
        await more(stream)
        await call(live, "POST", topic, target_cluster=second_northguard)
        for state in ("dual_write", "cut_over", "completed"):
            await more(stream)
            await call(live, "POST", topic, "/advance", expected_state=state)
        await more(stream)  # records the target took directly, after the mirrors
    source, target = (await live.metadata(topic)).epochs
    assert source.end_offsets is not None
    source_end = source.end_offsets[0]
    options = GroupOptions(auto_commit=False)

    first = await open_consumer(live.url, ADMIN_TOKEN, VC, group="g", group_options=options)
    try:
        await first.subscribe([topic])
        before: list[XinfraRecord] = []

        async def read_all() -> bool:
            before.extend(await first.poll(500, timeout_s=0.2))
            return len(before) >= len(stream.acked)

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
