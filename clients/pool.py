"""One backend per physical cluster, opened on first use and shared by everything in a client.

A consumer subscribed to topics on three clusters of one virtual cluster (the
federation picture) holds three backends here, and no more.

A cluster's ``northguard.auth`` attribute (the short-lived credential the
service issues with topic metadata) is not part of its identity: a fresher
one is handed to the open backend (``update_credential``) instead of opening
another, so every later (re)connection of that backend presents it.
"""

from __future__ import annotations

from collections.abc import Iterable

from xinfra.backend import (
    Backend,
    ProducerOptions,
    ReaderOptions,
    ShardProducer,
    ShardReader,
    open_backend,
)
from xinfra.model import PhysicalCluster, TopicMetadata

AUTH_ATTRIBUTE = "northguard.auth"
"""The credential attribute (``backends.northguard.credentials.AUTH_ATTRIBUTE``; ``clients`` does
not import a backend package)."""


def _identity(cluster: PhysicalCluster) -> PhysicalCluster:
    if AUTH_ATTRIBUTE not in cluster.attributes:
        return cluster
    attributes = {k: v for k, v in cluster.attributes.items() if k != AUTH_ATTRIBUTE}
    return cluster.model_copy(update={"attributes": attributes})


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
        if known is not None and known[0] is not cluster:
            credential = cluster.attributes.get(AUTH_ATTRIBUTE)
            if _identity(known[0]) == _identity(cluster):
                if credential != known[0].attributes.get(AUTH_ATTRIBUTE):
                    update = getattr(known[1], "update_credential", None)
                    if update is not None:
                        update(credential)
                known = (cluster, known[1])
                self._backends[cluster.name] = known
            else:  # a cluster re-registered elsewhere gets a new backend
                known = None
        if known is None:
            known = (cluster, open_backend(cluster))
            self._backends[cluster.name] = known
        return known[1]

    def refresh(self, clusters: Iterable[PhysicalCluster]) -> None:
        """Hand fresher credentials (newer metadata's clusters) to the backends already open."""
        for cluster in clusters:
            if cluster.name in self._backends:
                self.backend(cluster)

    def adopt(self, metadata: TopicMetadata) -> None:
        """``refresh`` from a topic's metadata: the listener producers and consumers add to their
        ``TopicWatch``, so every (re)connection presents the credential the service signed last,
        not the one the client opened with (it expires after the service's credential TTL)."""
        self.refresh(metadata.clusters.values())

    def producer(self, cluster: PhysicalCluster, physical_topic: str) -> ShardProducer:
        """The one shard producer of a physical topic: one per topic keeps per-shard order."""
        key = (cluster.name, physical_topic)
        producer = self._producers.get(key)
        if producer is None:
            producer = self.backend(cluster).producer(physical_topic, self.producer_options)
            self._producers[key] = producer
        return producer

    def reader(
        self, cluster: PhysicalCluster, physical_topic: str, options: ReaderOptions | None = None
    ) -> ShardReader:
        """A new reader of ``physical_topic``: with ``options``, else the pool's."""
        return self.backend(cluster).reader(physical_topic, options or self.reader_options)

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
