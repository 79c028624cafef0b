"""One backend per physical cluster, opened on first use and shared by everything in a client.

A consumer subscribed to topics on three clusters of one virtual cluster (the
federation picture) holds three backends here, and no more.
"""

from __future__ import annotations

from xinfra.backend import (
    Backend,
    ProducerOptions,
    ReaderOptions,
    ShardProducer,
    ShardReader,
    open_backend,
)
from xinfra.model import PhysicalCluster


class BackendPool:
    def __init__(
        self,
        producer_options: ProducerOptions | None = None,
        reader_options: ReaderOptions | None = None,
    ) -> None:
        self._backends: dict[str, tuple[PhysicalCluster, Backend]] = {}
        self._producers: dict[tuple[str, str], ShardProducer] = {}
        self.producer_options = producer_options
        self.reader_options = reader_options

    def backend(self, cluster: PhysicalCluster) -> Backend:
        known = self._backends.get(cluster.name)
        if (
            known is None or known[0] != cluster
        ):  # a cluster re-registered elsewhere gets a new backend
            known = (cluster, open_backend(cluster))
            self._backends[cluster.name] = known
        return known[1]

    def producer(self, cluster: PhysicalCluster, physical_topic: str) -> ShardProducer:
        """The one shard producer of a physical topic: one per topic keeps per-shard order."""
        key = (cluster.name, physical_topic)
        producer = self._producers.get(key)
        if producer is None:
            producer = self.backend(cluster).producer(physical_topic, self.producer_options)
            self._producers[key] = producer
        return producer

    def reader(self, cluster: PhysicalCluster, physical_topic: str) -> ShardReader:
        return self.backend(cluster).reader(physical_topic, self.reader_options)

    async def flush(self) -> None:
        for producer in list(self._producers.values()):
            await producer.flush()

    async def close(self) -> None:
        for producer in self._producers.values():
            await producer.close()
        self._producers.clear()
        for _, backend in self._backends.values():
            await backend.close()
        self._backends.clear()
