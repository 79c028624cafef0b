"""An in-memory Backend for service tests while the Kafka backend cannot be imported.

It implements the admin side of ``xinfra.backend.Backend`` (what the metadata
service uses) with the contract's errors, and can be made unreachable to test
the service's failure handling.  Clusters are keyed by bootstrap, so two
service instances in one process see the same physical topics.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from xinfra.backend import Backend, ProducerOptions, ReaderOptions, ShardProducer, ShardReader
from xinfra.errors import BackendUnavailable, TopicAlreadyExists, TopicNotFound
from xinfra.keyspace import KeyRange, check_covering
from xinfra.model import ClusterKind, ConsumedRecord, PhysicalCluster, PhysicalTopicInfo


@dataclass
class MemoryCluster:
    topics: dict[str, PhysicalTopicInfo] = field(default_factory=dict)
    end_offsets: dict[str, dict[int, int]] = field(default_factory=dict)
    reachable: bool = True
    fail_create: bool = False


CLUSTERS: dict[str, MemoryCluster] = {}


def memory_cluster(bootstrap: str) -> MemoryCluster:
    return CLUSTERS.setdefault(bootstrap, MemoryCluster())


class _Reader(ShardReader):
    def __init__(self, backend: MemoryBackend, topic: str) -> None:
        self.backend, self.topic = backend, topic

    def assign(self, positions: Mapping[int, int]) -> None:
        pass

    async def poll(self, max_records: int = 1000, timeout_s: float = 1.0) -> list[ConsumedRecord]:
        return []

    async def start_offsets(self, shards: Sequence[int] | None = None) -> dict[int, int]:
        return {i: 0 for i in range(len(self.backend._info(self.topic).shards))}

    async def end_offsets(self, shards: Sequence[int] | None = None) -> dict[int, int]:
        info = self.backend._info(self.topic)
        known = self.backend.state.end_offsets.get(self.topic, {})
        return {i: known.get(i, 0) for i in range(len(info.shards))}

    async def offset_for_timestamp(self, shard: int, timestamp_ms: int) -> int:
        return 0

    async def close(self) -> None:
        pass


class MemoryBackend(Backend):
    def __init__(self, cluster: PhysicalCluster) -> None:
        self.kind = ClusterKind(cluster.kind)
        self.state = memory_cluster(cluster.bootstrap)

    def _reachable(self) -> None:
        if not self.state.reachable:
            raise BackendUnavailable("memory cluster is unreachable (test)")

    def _info(self, name: str) -> PhysicalTopicInfo:
        self._reachable()
        if name not in self.state.topics:
            raise TopicNotFound(f"no physical topic {name}")
        return self.state.topics[name]

    async def check(self) -> None:
        self._reachable()

    async def create_topic(
        self, name: str, ranges: Sequence[KeyRange], config: Mapping[str, str] | None = None
    ) -> PhysicalTopicInfo:
        self._reachable()
        if self.state.fail_create:
            raise BackendUnavailable("create refused (test)")
        check_covering(ranges)
        if name in self.state.topics:
            raise TopicAlreadyExists(name)
        info = PhysicalTopicInfo(name, list(ranges), dict(config or {}))
        self.state.topics[name] = info
        return info

    async def describe_topic(self, name: str) -> PhysicalTopicInfo:
        return self._info(name)

    async def list_topics(self) -> list[str]:
        self._reachable()
        return sorted(self.state.topics)

    async def delete_topic(self, name: str) -> None:
        self._info(name)
        del self.state.topics[name]

    def producer(self, topic: str, options: ProducerOptions | None = None) -> ShardProducer:
        raise NotImplementedError("the memory backend stores no records")

    def reader(self, topic: str, options: ReaderOptions | None = None) -> ShardReader:
        return _Reader(self, topic)

    async def close(self) -> None:
        pass
