"""``NorthguardBackend``: the Xinfra backend contract over a Northguard cluster.

Shard *i* of a physical topic is its *i*-th current range in keyspace order
(``xinfra.backend``): created from the given key ranges, so Kafka partitions
and Northguard ranges line up.  Bootstrap is ``host:port`` or a
comma-separated list of them: metadata requests go to the first that answers
(any broker of a cluster answers them), streams to each range's leader as
topic metadata names it.
``attributes['request_timeout_s']`` overrides the settings' request timeout.

Credentials (``backends.northguard.credentials``): a cluster whose attributes
hold the cluster secret (``northguard.secret``: the metadata service's own,
resolved backend) signs itself an admin credential for every topic, renewed
before it expires; a client's cluster instead carries the credential the
service issued (``northguard.auth``), replaced by ``update_credential`` when
newer metadata brings a fresh one.  Every connection asks for the current one
when it opens and when it must re-authenticate.

TLS (``backends.northguard.tls``): ``northguard.tls`` = ``true`` in the
cluster's attributes makes every connection of this backend (admin,
producers, readers, the blocking metadata request) TLS, verifying the
brokers' certificate against ``northguard.tls.ca``.  The context is built
once, here, so a bad CA is refused at construction.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping, Sequence

from backends.northguard.client.admin import AdminClient, TopicView
from backends.northguard.client.blocking import request_blocking
from backends.northguard.client.producer import NorthguardProducer
from backends.northguard.client.reader import NorthguardReader
from backends.northguard.credentials import (
    ADMIN,
    ALL_TOPICS,
    AUTH_ATTRIBUTE,
    OPERATIONS,
    SECRET_ATTRIBUTE,
    sign,
)
from backends.northguard.runtime import RealRuntime, Runtime
from backends.northguard.tls import client_context
from xinfra.backend import Backend, ProducerOptions, ReaderOptions, ShardProducer, ShardReader
from xinfra.errors import BackendUnavailable, InvalidRequest
from xinfra.keyspace import KeyRange, check_covering
from xinfra.model import ClusterKind, PhysicalCluster, PhysicalTopicInfo
from xinfra.settings import get_settings

ADMIN_CREDENTIAL_TTL_S = 900.0
"""Lifetime of the admin credential a backend holding the cluster secret signs itself."""


class NorthguardBackend(Backend):
    kind = ClusterKind.NORTHGUARD

    def __init__(self, cluster: PhysicalCluster, runtime: Runtime | None = None) -> None:
        self.cluster = cluster
        self.addresses = [a.strip() for a in cluster.bootstrap.split(",") if a.strip()]
        self.address = self.addresses[0]
        timeout = cluster.attributes.get("request_timeout_s")
        self.request_timeout_s = float(timeout) if timeout else get_settings().request_timeout_s
        self._runtime = runtime or RealRuntime()
        secret = cluster.attributes.get(SECRET_ATTRIBUTE)
        self._secret = secret.encode() if secret else None
        self._credential = cluster.attributes.get(AUTH_ATTRIBUTE)
        self._signed_s = 0.0
        self._tls_context = client_context(cluster.attributes)
        self._admin = AdminClient(
            self._runtime,
            ",".join(self.addresses),
            self.request_timeout_s,
            self.credential,
            self._tls_context,
        )
        self._producers: set[NorthguardProducer] = set()
        self._readers: set[NorthguardReader] = set()
        self._views: dict[str, TopicView] = {}  # topics this backend created or described

    def credential(self) -> str | None:
        """The credential a new connection presents now (None: the broker is open)."""
        if self._secret is not None and time.time() - self._signed_s > ADMIN_CREDENTIAL_TTL_S / 2:
            self._signed_s = time.time()
            self._credential = sign(
                self._secret, f"backend:{ADMIN}", ALL_TOPICS, OPERATIONS, ADMIN_CREDENTIAL_TTL_S
            )
        return self._credential

    def update_credential(self, credential: str | None) -> None:
        """Use ``credential`` (fresher topic metadata's) from the next (re)authentication on."""
        if credential is not None and self._secret is None:
            self._credential = credential

    async def check(self) -> None:
        try:
            await self._admin.ping()
        except BackendUnavailable:
            raise
        except Exception as error:
            raise BackendUnavailable(
                f"Northguard broker {self.address} does not answer: {error}"
            ) from error

    async def create_topic(
        self, name: str, ranges: Sequence[KeyRange], config: Mapping[str, str] | None = None
    ) -> PhysicalTopicInfo:
        try:
            check_covering(ranges)
        except ValueError as error:
            raise InvalidRequest(
                f"ranges of topic {name!r} must cover the keyspace: {error}"
            ) from error
        view = await self._admin.create_topic(name, list(ranges), dict(config or {}))
        self._views[name] = view
        return _info(view)

    async def describe_topic(self, name: str) -> PhysicalTopicInfo:
        self._views.pop(name, None)
        view = await self._admin.topic(name)
        self._views[name] = view
        return _info(view)

    async def list_topics(self) -> list[str]:
        return await self._admin.list_topics()

    async def delete_topic(self, name: str) -> None:
        self._views.pop(name, None)
        await self._admin.delete_topic(name)

    async def seal_topic(self, name: str) -> dict[int, int]:
        """Seal the topic natively: later appends fail with ``Sealed``; the offsets are final."""
        self._views.pop(name, None)
        view = await self._admin.seal_topic(name)
        return {shard: r.end_offset for shard, r in enumerate(view.ranges)}

    def producer(self, topic: str, options: ProducerOptions | None = None) -> ShardProducer:
        """A producer to ``topic``; knows its ranges now, so ``send`` refuses a bad shard at once.

        The ranges come from this backend's last ``create_topic``/``describe_topic``
        of the topic, else from one blocking metadata request (like Kafka's
        partition count).
        """
        view = self._views.get(topic)
        if view is None:
            view = TopicView.from_json(self._request_blocking("topic_metadata", name=topic))
        producer = NorthguardProducer(
            self._runtime,
            self.address,
            view,
            options or ProducerOptions(),
            self.credential,
            self._tls_context,
            functools.partial(self._admin.topic, topic),
        )
        self._producers.add(producer)
        return producer

    def _request_blocking(self, op: str, **arguments: object) -> dict[str, object]:
        """One blocking request to the first bootstrap broker that answers."""
        failure: BackendUnavailable | None = None
        for address in self.addresses:
            try:
                return request_blocking(
                    address,
                    op,
                    self.request_timeout_s,
                    credential=self.credential(),
                    tls_context=self._tls_context,
                    **arguments,
                )
            except BackendUnavailable as error:
                failure = error
        assert failure is not None
        raise failure

    def reader(self, topic: str, options: ReaderOptions | None = None) -> ShardReader:
        reader = NorthguardReader(
            self._runtime,
            ",".join(self.addresses),
            topic,
            options or ReaderOptions(),
            self.request_timeout_s,
            self.credential,
            self._tls_context,
        )
        self._readers.add(reader)
        return reader

    async def close(self) -> None:
        for producer in list(self._producers):
            await producer.close()
        for reader in list(self._readers):
            await reader.close()
        self._producers.clear()
        self._readers.clear()
        await self._admin.close()


def _info(view: TopicView) -> PhysicalTopicInfo:
    return PhysicalTopicInfo(
        name=view.name,
        shards=[r.key_range for r in view.ranges],
        config=view.config,
        sealed=view.sealed,
    )
