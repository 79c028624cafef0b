"""The SDK on a Northguard cluster that requires credentials, through the real metadata service.

The cluster is registered with its secret as a ``file:`` reference; topic
metadata served to a client token carries a credential scoped to the
client's virtual cluster (never the secret), and producing and consuming
work end to end with it.  The credential opens nothing of another virtual
cluster's physical topics.
"""

from __future__ import annotations

import pytest
from sdk_live import NORTHGUARD_SECRET as SECRET
from sdk_live import VC, LiveService, needs_northguard, read_all

from backends.northguard import credentials
from clients import open_consumer, open_producer
from metadata_service.topics import vc_scope
from xinfra.backend import open_backend
from xinfra.errors import Unauthorized
from xinfra.model import ClusterKind, PhysicalCluster

pytestmark = needs_northguard


async def test_a_client_token_gets_a_scoped_credential_and_works_end_to_end(
    live: LiveService, secured_northguard: str
) -> None:
    await live.create_topic("guarded", "secured", 2)
    token = await live.client_token("ng-auth-client")
    producer = await open_producer(live.url, token, VC, topics=["guarded"])
    consumer = await open_consumer(live.url, token, VC, topics=["guarded"])
    try:
        metadata = await producer.source.topic_metadata("guarded")
        attributes = metadata.clusters["secured"].attributes
        assert credentials.SECRET_ATTRIBUTE not in attributes
        claims = credentials.verify(SECRET.encode(), attributes[credentials.AUTH_ATTRIBUTE])
        assert claims.scope == vc_scope(VC)
        assert claims.operations == {credentials.READ, credentials.WRITE}
        assert metadata.current_epoch.physical_topic.startswith(claims.scope)

        for i in range(20):
            await producer.send("guarded", b"v%d" % i, key=b"%d" % (i % 3))
        await producer.flush()
        await consumer.assign("guarded")
        records = await read_all(consumer, 20, timeout_s=60)
        assert sorted(r.value for r in records) == sorted(b"v%d" % i for i in range(20))

        # The same credential reaches nothing outside the virtual cluster's scope.
        admin = open_backend(
            PhysicalCluster(
                name="admin",
                kind=ClusterKind.NORTHGUARD,
                bootstrap=secured_northguard,
                attributes={credentials.SECRET_ATTRIBUTE: SECRET},
            )
        )
        other = PhysicalCluster(
            name="other",
            kind=ClusterKind.NORTHGUARD,
            bootstrap=secured_northguard,
            attributes={credentials.AUTH_ATTRIBUTE: attributes[credentials.AUTH_ATTRIBUTE]},
        )
        theirs = "xinfra.someone-else.cards.0.ab"
        thief = open_backend(other)
        try:
            await admin.create_topic(
                theirs,
                [s.key_range for s in metadata.current_epoch.shards],
            )
            with pytest.raises(Unauthorized):
                await thief.describe_topic(theirs)
            with pytest.raises(Unauthorized):
                await thief.delete_topic(theirs)
            assert theirs not in await thief.list_topics()
        finally:
            await thief.close()
            await admin.close()
    finally:
        await producer.close()
        await consumer.close()
