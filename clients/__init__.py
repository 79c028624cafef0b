"""The Xinfra SDK: ``XinfraProducer`` and ``XinfraConsumer`` over virtual topics (DESIGN.md §5).

``open_producer`` and ``open_consumer`` build clients that talk to the
metadata service over HTTP (``XINFRA_METADATA_URL``, ``XINFRA_TOKEN``,
``XINFRA_VIRTUAL_CLUSTER`` or the arguments) and to the physical clusters
through ``xinfra.backend``, and check the service and the token before they
return.  ``connect_producer``/``connect_consumer`` build without contacting
anything.  ``clients.sync`` has blocking flavours.
"""

from __future__ import annotations

from collections.abc import Sequence

from clients.consumer import CommitSink, XinfraConsumer, XinfraConsumerOptions, XinfraRecord
from clients.producer import Positions, XinfraProducer, XinfraProducerOptions
from clients.service import LEASE_S, ServiceSource


def connect_producer(
    url: str | None = None,
    token: str | None = None,
    virtual_cluster: str | None = None,
    options: XinfraProducerOptions | None = None,
    client_id: str | None = None,
    lease_s: float = LEASE_S,
) -> XinfraProducer:
    """A producer for one virtual cluster; nothing is contacted until its first use.

    Call from inside a running event loop.
    """
    source = ServiceSource(
        "producer",
        url=url,
        token=token,
        virtual_cluster=virtual_cluster,
        client_id=client_id,
        lease_s=lease_s,
    )
    return XinfraProducer(source, options)


def connect_consumer(
    url: str | None = None,
    token: str | None = None,
    virtual_cluster: str | None = None,
    options: XinfraConsumerOptions | None = None,
    client_id: str | None = None,
    lease_s: float = LEASE_S,
    commit_sink: CommitSink | None = None,
) -> XinfraConsumer:
    """A consumer for one virtual cluster; nothing is contacted until its first use.

    Call from inside a running event loop.
    """
    source = ServiceSource(
        "consumer",
        url=url,
        token=token,
        virtual_cluster=virtual_cluster,
        client_id=client_id,
        lease_s=lease_s,
    )
    return XinfraConsumer(source, commit_sink=commit_sink, options=options)


async def open_producer(
    url: str | None = None,
    token: str | None = None,
    virtual_cluster: str | None = None,
    options: XinfraProducerOptions | None = None,
    topics: Sequence[str] = (),
    client_id: str | None = None,
    lease_s: float = LEASE_S,
) -> XinfraProducer:
    """A started producer: the service answered, the token is good, ``topics`` exist.

    Raises ``Unavailable``, ``Unauthenticated``, ``Forbidden``, ``NotFound``
    (unknown virtual cluster) or ``TopicNotFound``; nothing is left open then.
    """
    producer = connect_producer(url, token, virtual_cluster, options, client_id, lease_s)
    try:
        return await producer.start(topics)
    except BaseException:
        await producer.close()
        raise


async def open_consumer(
    url: str | None = None,
    token: str | None = None,
    virtual_cluster: str | None = None,
    options: XinfraConsumerOptions | None = None,
    topics: Sequence[str] = (),
    client_id: str | None = None,
    lease_s: float = LEASE_S,
    commit_sink: CommitSink | None = None,
) -> XinfraConsumer:
    """A started consumer: the service answered, the token is good, ``topics`` exist.

    Raises like ``open_producer``; nothing is left open then.
    """
    consumer = connect_consumer(
        url, token, virtual_cluster, options, client_id, lease_s, commit_sink
    )
    try:
        return await consumer.start(topics)
    except BaseException:
        await consumer.close()
        raise


__all__ = [
    "CommitSink",
    "Positions",
    "ServiceSource",
    "XinfraConsumer",
    "XinfraConsumerOptions",
    "XinfraProducer",
    "XinfraProducerOptions",
    "XinfraRecord",
    "connect_consumer",
    "connect_producer",
    "open_consumer",
    "open_producer",
]
