"""A consumer's position just after it crosses into a migration target resumes past the mirror.

The target of a migration begins with mirrors of source records (the dual
writes), and a consumer that read the source to its end skips them when it
crosses.  Its position at that moment is what a consumer group commits when
the shard moves to another member.  Resumed there, the next owner must skip
the mirrors too: as (target, its first offset) it would deliver them again.
Seen in CI: a group rebalanced while a member crossed, and the member that
took the shard delivered 428 records twice.
"""

from __future__ import annotations

from sdk_live import VC, LiveService, needs_northguard
from test_migration_live import call, load, more
from waiting import wait_until

from clients import XinfraRecord, open_consumer
from xinfra.model import Position

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
