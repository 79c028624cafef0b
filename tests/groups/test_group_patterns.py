"""A pattern subscription follows the topics (Kafka's ``metadata.max.age.ms``): a topic created
after ``subscribe`` that matches is joined and its records reach the member.  Real service,
ZooKeeper and tansu.  (Deleting a topic under a live reader crashes librdkafka 2.16 against tansu,
SIGSEGV in rd_kafka_metadata_cache_find, so the delete half is not exercised here.)"""

from __future__ import annotations

import re
import uuid

from groups_harness import Deadline, ThreadService, create_topic
from test_group_sdk import member, produce


async def test_a_pattern_joins_topics_created_later(service: ThreadService, kafka: str) -> None:
    prefix = f"p{uuid.uuid4().hex[:8]}"
    first, later = f"{prefix}-a", f"{prefix}-b"
    create_topic(service.url, first, shards=2)
    create_topic(service.url, f"other-{prefix}", shards=1)  # does not match: never joined
    group = f"g-{uuid.uuid4().hex[:8]}"
    consumer = await member(service.url, group, metadata_max_age_s=0.2)
    try:
        await consumer.subscribe(re.compile(re.escape(prefix) + r"-.*"))
        assert consumer.membership is not None
        assert {t for t, _ in consumer.membership.owned()} == {first}
        create_topic(service.url, later, shards=2)
        values = {f"late-{i}".encode() for i in range(10)}
        await produce(service.url, later, sorted(values))
        seen: set[bytes] = set()
        deadline = Deadline(30, "the records of the topic created after subscribe")
        while not values <= seen:
            deadline.check()
            seen |= {r.value for r in await consumer.poll(100, timeout_s=0.5) if r.value}
        assert set(consumer.membership.owned()) == {(t, s) for t in (first, later) for s in (0, 1)}

    finally:
        await consumer.close()
