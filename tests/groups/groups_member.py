"""A group member in its own process (so a test can SIGSTOP it): reports as JSON lines.

Usage: python groups_member.py URL TOKEN GROUP TOPIC
Each line: {"event": "poll"|"assigned"|"revoked"|"lost", "member_id", "epoch", "owned", "records"}.
"""

from __future__ import annotations

import asyncio
import json
import sys

from clients import GroupOptions, open_consumer

url, token, group, topic = sys.argv[1:5]


def report(event: str, consumer: object, **extra: object) -> None:
    membership = consumer.membership  # type: ignore[attr-defined]
    line = {
        "event": event,
        "member_id": membership.member_id,
        "epoch": membership.member_epoch,
        "owned": membership.owned(),
        **extra,
    }
    print(json.dumps(line), flush=True)


class Listener:
    def __init__(self, consumer: object) -> None:
        self.consumer = consumer

    async def on_revoked(self, shards: list[tuple[str, int]]) -> None:
        report("revoked", self.consumer, shards=shards)

    async def on_assigned(self, shards: list[tuple[str, int]]) -> None:
        report("assigned", self.consumer, shards=shards)

    async def on_lost(self, shards: list[tuple[str, int]]) -> None:
        report("lost", self.consumer, shards=shards)


async def main() -> None:
    consumer = await open_consumer(
        url=url,
        token=token,
        group=group,
        group_options=GroupOptions(auto_commit_interval_s=0.2),
    )
    await consumer.subscribe([topic], Listener(consumer))
    while True:
        records = await consumer.poll(100, timeout_s=0.1)
        report("poll", consumer, records=[[r.shard, r.offset] for r in records])


asyncio.run(main())
