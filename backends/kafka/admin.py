"""Topic administration on Kafka: create, describe, list, delete; blocking calls run in a thread.

Key ranges on Kafka.  A partition cannot carry key bounds, and arbitrary
topic configs are refused by real brokers (unknown config names), so the
ranges are not stored: **a Kafka topic of N partitions always has the N equal
ranges ``keyspace.shard_ranges(N)``**, and ``describe_topic`` derives them
from the partition count.  ``create_topic`` therefore refuses any other
covering with ``InvalidRequest``: splits and merges are a Northguard feature.

Kafka's metadata is eventually consistent: a created topic may not be
visible to every broker at once, a deleted one may linger.  ``create`` and
``delete`` return only once the cluster's metadata agrees (bounded by the
request timeout), so a producer opened right after ``create`` finds its
partitions and a ``create`` right after ``delete`` does not collide.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from typing import Any, Final

from confluent_kafka import KafkaException
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    ConfigResource,
    ConfigSource,
    NewTopic,
)

from backends.kafka.errors import from_exception
from xinfra.errors import BackendTimeout, InvalidRequest, TopicNotFound
from xinfra.keyspace import SHARD_COUNT_MAX, KeyRange, check_covering, shard_ranges
from xinfra.model import PhysicalTopicInfo

TOPIC_NAME_RE: Final = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
"""Kafka's legal topic names."""

METADATA_POLL_S: Final = 0.05
"""Interval between metadata checks while waiting for a create or delete to propagate."""

INTERNAL_PREFIX: Final = "__"
"""Kafka's internal topics (``__consumer_offsets``...) are not Xinfra's and are never listed."""


def check_topic_name(name: str) -> None:
    if not TOPIC_NAME_RE.match(name) or name in (".", ".."):
        raise InvalidRequest(
            f"topic name {name!r} is not a legal Kafka topic name: "
            "use 1-249 characters of [A-Za-z0-9._-]"
        )


def check_equal_ranges(ranges: Sequence[KeyRange]) -> int:
    """The shard count, when ``ranges`` are the N equal ranges; ``InvalidRequest`` otherwise."""
    try:
        check_covering(ranges)
    except ValueError as error:
        raise InvalidRequest(f"key ranges do not cover the keyspace: {error}") from None
    count = len(ranges)
    if count > SHARD_COUNT_MAX:
        raise InvalidRequest(f"{count} shards exceed the limit of {SHARD_COUNT_MAX}")
    if list(ranges) != shard_ranges(count):
        raise InvalidRequest(
            f"Kafka topics hold only the {count} equal key ranges shard_ranges({count}): "
            "a partition cannot express other bounds; use Northguard for split or merged ranges"
        )
    return count


def partition_counts(handle: Any, bootstrap: str, timeout_s: float) -> dict[str, int]:
    """Every topic of the cluster with its partition count, from one metadata request.

    Asks for all topics rather than one: a request naming a topic could
    create it on a broker with ``auto.create.topics.enable``.  ``handle`` is
    any confluent-kafka client (admin, producer or consumer).
    """
    try:
        metadata = handle.list_topics(timeout=timeout_s)
    except KafkaException as exc:
        raise from_exception(exc, bootstrap, "reading cluster metadata") from None
    return {
        name: len(topic.partitions)
        for name, topic in metadata.topics.items()
        if topic.error is None and topic.partitions
    }


def partition_count(handle: Any, bootstrap: str, topic: str, timeout_s: float) -> int:
    """The partition count of one topic; ``TopicNotFound`` when the cluster does not know it."""
    count = partition_counts(handle, bootstrap, timeout_s).get(topic)
    if count is None:
        raise TopicNotFound(
            f"kafka {bootstrap}: topic {topic!r} does not exist; create it first or check its name"
        )
    return count


def _result(future: Any, bootstrap: str, what: str, timeout_s: float) -> Any:
    try:
        return future.result(timeout=timeout_s)
    except Exception as exc:
        raise from_exception(exc, bootstrap, what) from None


def _wait_for(
    admin: AdminClient, bootstrap: str, done: Any, what: str, deadline: float, timeout_s: float
) -> None:
    """Poll the cluster's metadata until ``done(counts)`` holds, or raise ``Timeout`` at the deadline."""
    while True:
        counts = partition_counts(admin, bootstrap, timeout_s)
        if done(counts):
            return
        if time.monotonic() >= deadline:
            raise BackendTimeout(
                f"kafka {bootstrap}: {what} not visible in the cluster metadata after "
                f"{timeout_s:.0f} s; describe the topic before retrying"
            )
        time.sleep(METADATA_POLL_S)


def create_topic(
    admin: AdminClient,
    bootstrap: str,
    name: str,
    ranges: Sequence[KeyRange],
    config: Mapping[str, str],
    replication_factor: int,
    timeout_s: float,
) -> PhysicalTopicInfo:
    check_topic_name(name)
    count = check_equal_ranges(ranges)
    deadline = time.monotonic() + timeout_s
    what = f"creating topic {name!r} with {count} partitions"
    new = NewTopic(name, count, replication_factor, config=dict(config))
    futures = admin.create_topics([new], request_timeout=timeout_s, operation_timeout=timeout_s)
    _result(futures[name], bootstrap, what, timeout_s)
    _wait_for(admin, bootstrap, lambda counts: counts.get(name) == count, what, deadline, timeout_s)
    return PhysicalTopicInfo(name=name, shards=shard_ranges(count), config=dict(config))


def describe_topic(
    admin: AdminClient, bootstrap: str, name: str, timeout_s: float
) -> PhysicalTopicInfo:
    """The topic with the equal ranges of its partition count and its topic-level config overrides."""
    count = partition_count(admin, bootstrap, name, timeout_s)
    resource = ConfigResource(ConfigResource.Type.TOPIC, name)
    futures = admin.describe_configs([resource], request_timeout=timeout_s)
    entries = _result(futures[resource], bootstrap, f"describing topic {name!r}", timeout_s)
    overrides = {
        entry.name: entry.value
        for entry in entries.values()
        if entry.source == ConfigSource.DYNAMIC_TOPIC_CONFIG.value and entry.value is not None
    }
    return PhysicalTopicInfo(name=name, shards=shard_ranges(count), config=overrides)


def list_topics(admin: AdminClient, bootstrap: str, timeout_s: float) -> list[str]:
    counts = partition_counts(admin, bootstrap, timeout_s)
    return sorted(name for name in counts if not name.startswith(INTERNAL_PREFIX))


def delete_topic(admin: AdminClient, bootstrap: str, name: str, timeout_s: float) -> None:
    check_topic_name(name)
    deadline = time.monotonic() + timeout_s
    what = f"deleting topic {name!r}"
    futures = admin.delete_topics([name], request_timeout=timeout_s, operation_timeout=timeout_s)
    _result(futures[name], bootstrap, what, timeout_s)
    _wait_for(admin, bootstrap, lambda counts: name not in counts, what, deadline, timeout_s)
