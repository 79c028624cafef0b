"""``KafkaBackend``: a Kafka cluster (any Kafka-protocol broker) behind ``xinfra.backend.Backend``.

Registered as the ``kafka`` entry point of ``xinfra.backends``;
``xinfra.backend.open_backend(cluster)`` builds it from a ``PhysicalCluster``
whose ``bootstrap`` is the brokers' ``host:port[,host:port...]``.

Cluster attributes it understands (all optional, strings as the model keeps them):

* ``replication_factor``: replicas of each new partition; default ``-1``, the
  broker's ``default.replication.factor`` (KIP-464).
* ``request_timeout_s``: bound of every admin and offset request; default 10.
* ``security.protocol``, ``sasl.*``, ``ssl.*``: librdkafka's connection settings
  (SASL, TLS), given to the admin client and every producer and reader
  (``config.connection_settings``).  The service resolves secret references
  (``env:``/``file:``) before it opens a backend; clients never receive secrets.

Admin calls are blocking librdkafka calls run on ``asyncio.to_thread``, so one
backend serves any number of event loops.  The backend owns the producers and
readers it made: ``close`` closes those still open.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Final

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from backends.kafka import admin
from backends.kafka.config import admin_config, connection_settings
from backends.kafka.producer import KafkaShardProducer
from backends.kafka.reader import KafkaShardReader
from xinfra.backend import Backend, ProducerOptions, ReaderOptions, ShardProducer, ShardReader
from xinfra.errors import BackendUnavailable, InvalidRequest, XinfraError
from xinfra.keyspace import KeyRange
from xinfra.model import ClusterKind, PhysicalCluster, PhysicalTopicInfo

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S_DEFAULT: Final = 10.0
"""Bound of an admin or offset request when the cluster does not set ``request_timeout_s``."""

CHECK_TIMEOUT_S: Final = 5.0
"""Bound of ``check``: a health probe answers fast or reports the cluster unavailable."""


class KafkaBackend(Backend):
    """One Kafka cluster.  Thread-safe for admin calls; producers and readers keep to their loop."""

    kind = ClusterKind.KAFKA

    def __init__(self, cluster: PhysicalCluster) -> None:
        self.cluster = cluster
        self.bootstrap = cluster.bootstrap
        attributes = cluster.attributes
        try:
            self.replication_factor = int(attributes.get("replication_factor", "-1"))
            self.request_timeout_s = float(
                attributes.get("request_timeout_s", REQUEST_TIMEOUT_S_DEFAULT)
            )
        except ValueError as error:
            raise InvalidRequest(f"cluster {cluster.name!r}: bad attribute: {error}") from None
        self.connection = connection_settings(attributes)
        try:
            self._admin: AdminClient | None = AdminClient(
                admin_config(self.bootstrap, self.connection)
            )
        except KafkaException as error:  # librdkafka refuses an unknown or bad setting
            raise InvalidRequest(
                f"cluster {cluster.name!r}: bad connection attribute: {error.args[0].str()}"
            ) from None
        self._producers: set[KafkaShardProducer] = set()
        self._readers: set[KafkaShardReader] = set()

    def _admin_client(self) -> AdminClient:
        if self._admin is None:
            raise InvalidRequest(f"backend for cluster {self.cluster.name!r} is closed")
        return self._admin

    async def check(self) -> None:
        client = self._admin_client()
        timeout_s = min(CHECK_TIMEOUT_S, self.request_timeout_s)
        try:
            await asyncio.to_thread(admin.partition_counts, client, self.bootstrap, timeout_s)
        except XinfraError as error:
            raise BackendUnavailable(
                f"kafka cluster {self.cluster.name!r} at {self.bootstrap} does not answer: "
                f"{error.message}"
            ) from None

    async def create_topic(
        self, name: str, ranges: Sequence[KeyRange], config: Mapping[str, str] | None = None
    ) -> PhysicalTopicInfo:
        return await asyncio.to_thread(
            admin.create_topic,
            self._admin_client(),
            self.bootstrap,
            name,
            ranges,
            dict(config or {}),
            self.replication_factor,
            self.request_timeout_s,
        )

    async def describe_topic(self, name: str) -> PhysicalTopicInfo:
        return await asyncio.to_thread(
            admin.describe_topic, self._admin_client(), self.bootstrap, name, self.request_timeout_s
        )

    async def list_topics(self) -> list[str]:
        return await asyncio.to_thread(
            admin.list_topics, self._admin_client(), self.bootstrap, self.request_timeout_s
        )

    async def delete_topic(self, name: str) -> None:
        await asyncio.to_thread(
            admin.delete_topic, self._admin_client(), self.bootstrap, name, self.request_timeout_s
        )

    def producer(self, topic: str, options: ProducerOptions | None = None) -> ShardProducer:
        """A producer to ``topic``; reads its partition count now (``TopicNotFound``, ``Timeout``)."""
        self._admin_client()
        producer = KafkaShardProducer(
            self.bootstrap,
            topic,
            options or ProducerOptions(),
            on_close=self._producers.discard,
            connection=self.connection,
        )
        self._producers.add(producer)
        return producer

    def reader(self, topic: str, options: ReaderOptions | None = None) -> ShardReader:
        self._admin_client()
        reader = KafkaShardReader(
            self.bootstrap,
            topic,
            options or ReaderOptions(),
            self.request_timeout_s,
            on_close=self._readers.discard,
            connection=self.connection,
        )
        self._readers.add(reader)
        return reader

    async def close(self) -> None:
        if self._admin is None:
            return
        self._admin = None
        children: list[KafkaShardProducer | KafkaShardReader] = [*self._producers, *self._readers]
        for child in children:
            try:
                await child.close()
            except Exception:  # one child failing to close must not leak the others
                log.exception("kafka %s: closing %r failed", self.bootstrap, child)
