"""A group whose live members still read the source when the migration completes is listed.

The service does not move a group with live members (they cross as they read),
so a member that stopped reading keeps its checkpoints on the sealed source:
``xinfra migrate status`` and the status JSON name such groups, with their
member count and the shards with records left on the source, so nobody retires
the old cluster under a reader.  A group whose checkpoints are the source's end
read all of it (its next record is in the target): it is not listed.
"""

from __future__ import annotations

import asyncio
import json

from sdk_live import ADMIN_TOKEN, VC, LiveService, needs_kafka, needs_northguard, read_all
from test_migration_live import call
from test_sdk_cli import run

from clients import GroupOptions, open_consumer, open_producer
from xinfra.keyspace import shard_of_key

pytestmark = [needs_kafka, needs_northguard]


async def test_a_group_still_on_the_source_at_completion_is_listed_by_status(
    live: LiveService, kafka: str, northguard: str
) -> None:
    topic = "left-behind"
    await live.create_topic(topic, kafka, 2)
    producer = await open_producer(live.url, ADMIN_TOKEN, VC, topics=[topic])
    options = GroupOptions(auto_commit_interval_s=60)
    slow = await open_consumer(
        live.url, ADMIN_TOKEN, VC, group="slow-readers", group_options=options
    )
    drained = await open_consumer(live.url, ADMIN_TOKEN, VC, group="drained", group_options=options)
    late_keys = [b"late-%d" % i for i in range(3)]
    try:
        for i in range(20):
            await producer.send(topic, b"v%d" % i, key=b"%d" % i)
        await producer.flush()
        await slow.subscribe([topic])
        assert len(await read_all(slow, 20)) == 20
        await slow.commit()  # source positions; then the member stops reading, still live
        for key in late_keys:  # records the slow group never reads
            await producer.send(topic, b"late", key=key)
        await producer.flush()
        await drained.subscribe([topic])
        assert len(await read_all(drained, 23)) == 23
        await drained.commit()  # the source's end: nothing left there for this group
        await call(live, "POST", topic, target_cluster=northguard)
        for state in ("dual_write", "cut_over", "completed"):
            assert (await call(live, "POST", topic, "/advance"))["state"] == state
        status = await call(live, "GET", topic)
        behind = sorted({shard_of_key(key, 2) for key in late_keys})
        assert status["groups_on_source"] == [
            {"group": "slow-readers", "members": 1, "shards": behind}
        ], "the drained group read all of the source: not listed"
        shown = await asyncio.to_thread(
            run, ["migrate", "status", topic, "--json"], live.url, ADMIN_TOKEN
        )
        assert json.loads(shown.stdout)["groups_on_source"][0]["group"] == "slow-readers"
        text = await asyncio.to_thread(run, ["migrate", "status", topic], live.url, ADMIN_TOKEN)
        assert "group slow-readers (1 members) still reads the source" in text.stdout.decode()
    finally:
        await slow.close()
        await drained.close()
        await producer.close()
    status = await call(live, "GET", topic)
    assert status["groups_on_source"] == [], "no live member: the group is not listed"
