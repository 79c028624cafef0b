"""A group whose live members still read the source when the migration completes is listed.

The service does not move a group with live members (they cross as they read),
so a member that stopped reading keeps its checkpoints on the sealed source:
``xinfra migrate status`` and the status JSON name such groups, with their
member count and the shards still on the source, so nobody retires the old
cluster under a reader.
"""

from __future__ import annotations

import asyncio
import json

from sdk_live import ADMIN_TOKEN, VC, LiveService, needs_kafka, needs_northguard, read_all
from test_migration_live import call
from test_sdk_cli import run

from clients import GroupOptions, open_consumer, open_producer

pytestmark = [needs_kafka, needs_northguard]


async def test_a_group_still_on_the_source_at_completion_is_listed_by_status(
    live: LiveService, kafka: str, northguard: str
) -> None:
    topic = "left-behind"
    await live.create_topic(topic, kafka, 2)
    producer = await open_producer(live.url, ADMIN_TOKEN, VC, topics=[topic])
    member = await open_consumer(
        live.url,
        ADMIN_TOKEN,
        VC,
        group="slow-readers",
        group_options=GroupOptions(auto_commit_interval_s=60),
    )
    try:
        for i in range(20):
            await producer.send(topic, b"v%d" % i, key=b"%d" % i)
        await producer.flush()
        await member.subscribe([topic])
        assert len(await read_all(member, 20)) == 20
        await member.commit()  # source positions; then the member stops reading, still live
        await call(live, "POST", topic, target_cluster=northguard)
        for state in ("dual_write", "cut_over", "completed"):
            assert (await call(live, "POST", topic, "/advance"))["state"] == state
        status = await call(live, "GET", topic)
        assert status["groups_on_source"] == [
            {"group": "slow-readers", "members": 1, "shards": [0, 1]}
        ]
        shown = await asyncio.to_thread(
            run, ["migrate", "status", topic, "--json"], live.url, ADMIN_TOKEN
        )
        assert json.loads(shown.stdout)["groups_on_source"][0]["group"] == "slow-readers"
        text = await asyncio.to_thread(run, ["migrate", "status", topic], live.url, ADMIN_TOKEN)
        assert "group slow-readers (1 members) still reads the source" in text.stdout.decode()
    finally:
        await member.close()
        await producer.close()
    status = await call(live, "GET", topic)
    assert status["groups_on_source"] == [], "no live member: the group is not listed"
