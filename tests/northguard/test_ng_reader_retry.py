"""A reader whose streams keep failing retriably backs off, as the producer does.

Metadata can name a broker that does not lead a range (a leader that changed
after the reader's last refresh; a past bug named a member that never knew the
range).  Every open then fails at once with ``not_leader``.  The first reopen
goes straight to the leader the refreshed metadata names (the usual leader
change costs nothing); each further failure in a row waits longer, so a reader
told the wrong broker for as long as a poll lasts opens a handful of streams,
not thousands.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ng_harness import backend_for

from backends.northguard.client.admin import AdminClient, TopicView
from xinfra.keyspace import shard_ranges
from xinfra.model import Record

POLL_S = 2.0
OPENS_MAX = 12
"""Backoff from 50 ms doubling: about 7 opens in 2 s; without it, thousands."""


async def test_a_reader_told_the_wrong_leader_backs_off(
    clusters: Any, topic_name: str, monkeypatch: Any
) -> None:
    coordinator, member = clusters(2, replication_factor=1)
    backend = backend_for(coordinator.url)
    try:
        await backend.create_topic(topic_name, shard_ranges(1))
        producer = backend.producer(topic_name)
        await producer.send(0, [Record(value=b"x")])
        await producer.close()
        leader = (await backend._admin.topic(topic_name)).ranges[0].leader
        wrong = member.url if leader == coordinator.url else coordinator.url
        asked = 0
        real_topic = AdminClient.topic

        async def stale(self: AdminClient, name: str) -> TopicView:
            nonlocal asked
            asked += 1
            view = await real_topic(self, name)
            # the injected fault: metadata naming a broker that does not lead the range
            ranges = [dataclasses.replace(r, leader=wrong) for r in view.ranges]
            return dataclasses.replace(view, ranges=ranges)

        monkeypatch.setattr(AdminClient, "topic", stale)
        reader = backend.reader(topic_name)
        try:
            reader.assign({0: 0})
            assert await reader.poll(10, timeout_s=POLL_S) == []
        finally:
            await reader.close()
        assert 1 < asked <= OPENS_MAX, f"{asked} metadata refreshes in a {POLL_S} s poll"
    finally:
        await backend.close()
