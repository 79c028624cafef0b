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
from clients.group import GroupClient, GroupMembership, GroupOptions, RebalanceListener
from clients.producer import Positions, XinfraProducer, XinfraProducerOptions
from clients.service import LEASE_S, ServiceSource
from xinfra.rest import resolve_token
from xinfra.settings import get_settings


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
    group: str | None = None,
    group_options: GroupOptions | None = None,
) -> XinfraConsumer:
    """A consumer for one virtual cluster; nothing is contacted until its first use.

    With ``group``, ``subscribe(topics)`` joins that consumer group, which then
    assigns the shards and takes the commits.  Call from inside a running event loop.
    """
    source = ServiceSource(
        "consumer",
        url=url,
        token=token,
        virtual_cluster=virtual_cluster,
        client_id=client_id,
        lease_s=lease_s,
    )
    consumer = XinfraConsumer(source, commit_sink=commit_sink, options=options)
    if group is not None:
        settings = get_settings()
        resolved = resolve_token(settings, token)
        client = GroupClient(
            source.url,
            {"Authorization": f"Bearer {resolved}"} if resolved else {},
            settings.request_timeout_s,
        )
        consumer.membership = GroupMembership(
            consumer, group, client, source.virtual_cluster, group_options, client_id
        )
        consumer.commit_sink = consumer.membership
    return consumer


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
    group: str | None = None,
    group_options: GroupOptions | None = None,
) -> XinfraConsumer:
    """A started consumer: the service answered, the token is good, ``topics`` exist.

    With ``group``, call ``subscribe(topics)`` next to join the group.
    Raises like ``open_producer``; nothing is left open then.
    """
    consumer = connect_consumer(
        url, token, virtual_cluster, options, client_id, lease_s, commit_sink, group, group_options
    )
    try:
        return await consumer.start(topics)
    except BaseException:
        await consumer.close()
        raise


__all__ = [
    "CommitSink",
    "GroupOptions",
    "Positions",
    "RebalanceListener",
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
