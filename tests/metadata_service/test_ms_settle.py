"""A seal's settle is a durable intent: the service killed (SIGKILL) or stopped (SIGTERM) while it
waits for producers leaves an owed settle that the restarted instance finishes; a repeated seal
completes what is missing.  Real processes on MariaDB and a real Kafka-protocol broker (tansu)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from ms_harness import admin_headers, restart, start_instance
from test_ms_api import VC, wait_for

from metadata_service.migrate import upgrade_database
from metadata_service.store import tables as t
from metadata_service.store.repository import MetadataStore, make_engine
from xinfra.backend import open_backend
from xinfra.model import ClusterKind, PhysicalCluster, Record, TopicMetadata
from xinfra.services.process import ManagedProcess

SETTLE_S_MAX = 4.0
"""The bound on waiting for the silent producer: short, so the restarted instance finishes soon."""

TOPIC = f"/v1/vclusters/{VC}/topics/orders"
RECORDS = {0: 3, 1: 2}


@pytest.fixture
def instance(tmp_path: Path, mysql_url: str) -> ManagedProcess:  # type: ignore[misc]
    process = start_instance(
        tmp_path, "ms", mysql_url, backend="real", seal_settle_s_max=SETTLE_S_MAX
    )
    yield process
    process.stop()


@contextlib.asynccontextmanager
async def client(process: ManagedProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=process.url, headers=admin_headers(), timeout=60) as http:
        yield http


async def _ok(http: httpx.AsyncClient, method: str, url: str, status: int = 200, **kw) -> object:  # type: ignore[no-untyped-def]
    response = await http.request(method, url, **kw)
    assert response.status_code == status, (response.status_code, response.text)
    return response.json() if response.content else None


async def _metadata(http: httpx.AsyncClient) -> TopicMetadata:
    return TopicMetadata.model_validate(await _ok(http, "GET", f"{TOPIC}/metadata"))


async def _topic_with_silent_producer(http: httpx.AsyncClient, kafka_bootstrap: str) -> None:
    """A Kafka topic with records in epoch 0 and a producer lease that never acknowledges
    (like a producer killed with SIGKILL: its lease stays registered)."""
    await _ok(
        http,
        "POST",
        "/v1/clusters",
        201,
        json={"name": "kafka", "kind": "kafka", "bootstrap": kafka_bootstrap},
    )
    created = TopicMetadata.model_validate(
        await _ok(
            http,
            "POST",
            f"/v1/vclusters/{VC}/topics",
            201,
            json={"name": "orders", "cluster": "kafka", "shards": len(RECORDS)},
        )
    )
    backend = open_backend(
        PhysicalCluster(name="kafka", kind=ClusterKind.KAFKA, bootstrap=kafka_bootstrap)
    )
    try:
        producer = backend.producer(created.epochs[0].physical_topic)
        await asyncio.gather(
            *(
                producer.send(shard, [Record(value=b"v%d" % i) for i in range(count)])
                for shard, count in RECORDS.items()
            )
        )
        await producer.close()
    finally:
        await backend.close()
    await _ok(
        http,
        "PUT",
        f"/v1/vclusters/{VC}/clients/silent",
        json={"kind": "producer", "topics": ["orders"], "ttl_s": 300},
    )


async def _half_sealed(http: httpx.AsyncClient) -> TopicMetadata | None:
    metadata = await _metadata(http)
    epoch = metadata.epochs[0]
    return metadata if epoch.state == "sealed" and epoch.end_offsets is None else None


async def _settled(http: httpx.AsyncClient) -> TopicMetadata | None:
    metadata = await _metadata(http)
    return metadata if metadata.epochs[0].end_offsets is not None else None


async def _interrupted_epoch_change(
    process: ManagedProcess, kafka_bootstrap: str, interrupt: str
) -> httpx.Response | None:
    """Add a second epoch; SIGKILL or SIGTERM the service while the old one settles."""
    async with client(process) as http:
        await _topic_with_silent_producer(http, kafka_bootstrap)
        adding = asyncio.create_task(
            http.post(f"{TOPIC}/epochs", json={"cluster": "kafka"}, timeout=60)
        )
        await wait_for(lambda: _half_sealed(http), timeout_s=20)
        assert not adding.done(), "the request waits for the silent producer"
        await asyncio.to_thread(process.kill if interrupt == "kill" else process.stop)
        try:
            return await adding
        except httpx.HTTPError:
            return None  # killed: no answer


async def _restart_and_wait_settled(process: ManagedProcess) -> TopicMetadata:
    await asyncio.to_thread(restart, process)
    async with client(process) as http:
        settled: TopicMetadata = await wait_for(lambda: _settled(http), timeout_s=30)
    return settled


async def test_sigkill_during_settle_is_finished_by_the_restarted_service(
    instance: ManagedProcess, kafka_bootstrap: str
) -> None:
    await _interrupted_epoch_change(instance, kafka_bootstrap, "kill")
    settled = await _restart_and_wait_settled(instance)
    assert settled.epochs[0].end_offsets == RECORDS
    assert [e.state for e in settled.epochs] == ["sealed", "active"]


async def test_sigterm_during_settle_answers_pending_and_is_finished_after_restart(
    instance: ManagedProcess, kafka_bootstrap: str
) -> None:
    answer = await _interrupted_epoch_change(instance, kafka_bootstrap, "term")
    assert answer is not None and answer.status_code == 202, answer and answer.text
    pending = TopicMetadata.model_validate(answer.json())
    assert pending.epochs[0].state == "sealed" and pending.epochs[0].end_offsets is None
    assert len(pending.epochs) == 2
    settled = await _restart_and_wait_settled(instance)
    assert settled.epochs[0].end_offsets == RECORDS
    assert settled.version == pending.version + 1


async def test_repeated_seal_completes_what_is_missing(
    instance: ManagedProcess, kafka_bootstrap: str
) -> None:
    """A topic seal killed mid-settle: repeating it (PATCH the epoch, POST seal) finishes it."""
    async with client(instance) as http:
        await _topic_with_silent_producer(http, kafka_bootstrap)
        sealing = asyncio.create_task(http.post(f"{TOPIC}/seal", json={}, timeout=60))
        await wait_for(lambda: _half_sealed(http), timeout_s=20)
        await asyncio.to_thread(instance.kill)
        with contextlib.suppress(httpx.HTTPError):
            await sealing
    await asyncio.to_thread(restart, instance)
    async with client(instance) as http:
        patched = TopicMetadata.model_validate(
            await _ok(http, "PATCH", f"{TOPIC}/epochs/0", json={"state": "sealed"})
        )
        assert patched.topic.sealed and patched.epochs[0].end_offsets == RECORDS
        again = TopicMetadata.model_validate(await _ok(http, "POST", f"{TOPIC}/seal", json={}))
        assert again.version == patched.version and again.epochs[0].end_offsets == RECORDS


def test_migration_owes_a_settle_for_epochs_left_half_sealed(mysql_url: str) -> None:
    """Epochs a service left sealed without end offsets before revision 0003 are settled at the
    first start after the upgrade (owed from the upgrade's time)."""
    upgrade_database(mysql_url, "0002")
    engine = make_engine(mysql_url)
    try:
        with engine.begin() as c:
            c.execute(
                t.topics.insert().values(
                    virtual_cluster=VC,
                    name="orders",
                    config="{}",
                    sealed=False,
                    state="active",
                    version=7,
                    updated_ms=0,
                )
            )
            for number, state, end_offsets in ((0, "sealed", None), (1, "active", None)):
                c.execute(
                    t.epochs.insert().values(
                        virtual_cluster=VC,
                        topic="orders",
                        number=number,
                        cluster="kafka",
                        physical_topic=f"p{number}",
                        shards="[]",
                        state=state,
                        end_offsets=end_offsets,
                        intent="ready",
                        updated_ms=0,
                    )
                )
        before_ms = int(time.time() * 1000)
        upgrade_database(mysql_url, "head")
        owed = MetadataStore(engine).owed_settles()
        assert [(s.virtual_cluster, s.topic, s.epoch, s.version) for s in owed] == [
            (VC, "orders", 0, 7)
        ]
        assert owed[0].created_ms >= before_ms
    finally:
        engine.dispose()
