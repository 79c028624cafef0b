"""Clients keep their Northguard credential fresh from the metadata long-poll.

The service signs credentials that live a few seconds here
(``ServiceConfig.northguard_credential_ttl_s``), so a client that presented
only the credential of the metadata it opened with would be refused by the
first connection it opens after that credential expired.  A broker restart
forces exactly such a connection: a stream already open keeps running on an
expired credential, a new one needs a valid credential.
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
from sdk_live import NORTHGUARD_SECRET, VC, LiveService, needs_northguard, read_all

from backends.northguard import credentials
from backends.northguard.launcher import NorthguardProcess
from clients import XinfraConsumerOptions, XinfraProducerOptions, open_consumer, open_producer
from metadata_service import ServiceConfig

pytestmark = needs_northguard

TTL_S = 3.0
"""The credential lifetime of this module's service: long enough for one long-poll round."""
LONG_POLL_S = 0.5
"""The clients' long-poll: well under half ``TTL_S``, when the service re-signs."""


@pytest.fixture
def service_config(service_config: ServiceConfig) -> ServiceConfig:
    return replace(service_config, northguard_credential_ttl_s=TTL_S)


async def test_a_consumer_reconnecting_after_its_first_credential_expired_keeps_reading(
    live: LiveService, secured_broker: NorthguardProcess
) -> None:
    await live.create_topic("refreshed", "secured", 2)
    token = await live.client_token("ng-refresh-client")
    producer = await open_producer(
        live.url, token, VC, XinfraProducerOptions(long_poll_s=LONG_POLL_S), topics=["refreshed"]
    )
    consumer = await open_consumer(
        live.url,
        token,
        VC,
        XinfraConsumerOptions(long_poll_s=LONG_POLL_S, unavailable_s_max=15.0),
        topics=["refreshed"],
    )
    try:
        opened = (await consumer.metadata("refreshed")).clusters["secured"].attributes
        first = credentials.verify(NORTHGUARD_SECRET.encode(), opened[credentials.AUTH_ATTRIBUTE])
        assert first.expires_s - time.time() <= TTL_S

        await consumer.assign("refreshed")
        for i in range(10):
            await producer.send("refreshed", b"before-%d" % i, key=b"%d" % i)
        await producer.flush()
        before = await read_all(consumer, 10, timeout_s=30)
        assert sorted(r.value for r in before) == sorted(b"before-%d" % i for i in range(10))

        # Keep reading (nothing arrives) until the credential the consumer opened with is dead.
        deadline = time.monotonic() + 10 * TTL_S
        while time.time() < first.expires_s + 0.5:
            assert time.monotonic() < deadline, "the first credential did not expire"
            assert await consumer.poll(100, timeout_s=0.2) == []

        # Every connection is new after a restart: the consumer must present a live credential.
        secured_broker.restart()
        for i in range(10):
            await producer.send("refreshed", b"after-%d" % i, key=b"%d" % i)
        await producer.flush()
        after = await read_all(consumer, 10, timeout_s=30)
        assert sorted(r.value for r in after) == sorted(b"after-%d" % i for i in range(10))

        now = (await consumer.metadata("refreshed")).clusters["secured"].attributes
        latest = credentials.verify(NORTHGUARD_SECRET.encode(), now[credentials.AUTH_ATTRIBUTE])
        assert latest.expires_s > first.expires_s
    finally:
        await consumer.close()
        await producer.close()
