"""The Xinfra SDK: ``XinfraProducer`` and ``XinfraConsumer`` over virtual topics (DESIGN.md §5).

``connect_producer`` and ``connect_consumer`` build clients that talk to the
metadata service over HTTP (``XINFRA_METADATA_URL``, ``XINFRA_TOKEN``,
``XINFRA_VIRTUAL_CLUSTER`` or the arguments) and to the physical clusters
through ``xinfra.backend``.  ``clients.sync`` has blocking flavours.
"""

from __future__ import annotations

from clients.consumer import XinfraConsumer, XinfraRecord
from clients.producer import XinfraProducer, XinfraProducerOptions
from clients.service import ServiceSource


def connect_producer(
    url: str | None = None,
    token: str | None = None,
    virtual_cluster: str | None = None,
    options: XinfraProducerOptions | None = None,
    client_id: str | None = None,
) -> XinfraProducer:
    """A producer for one virtual cluster; call from inside a running event loop."""
    source = ServiceSource(
        "producer", url=url, token=token, virtual_cluster=virtual_cluster, client_id=client_id
    )
    return XinfraProducer(source, options)


def connect_consumer(
    url: str | None = None,
    token: str | None = None,
    virtual_cluster: str | None = None,
    client_id: str | None = None,
) -> XinfraConsumer:
    """A consumer for one virtual cluster; call from inside a running event loop."""
    source = ServiceSource(
        "consumer", url=url, token=token, virtual_cluster=virtual_cluster, client_id=client_id
    )
    return XinfraConsumer(source)


__all__ = [
    "ServiceSource",
    "XinfraConsumer",
    "XinfraProducer",
    "XinfraProducerOptions",
    "XinfraRecord",
    "connect_consumer",
    "connect_producer",
]
