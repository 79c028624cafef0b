"""A seal without given end offsets is two-phase: end offsets are read only after live producers
acknowledge the version that retired the epoch (a Kafka topic keeps taking writes after a seal)."""

from __future__ import annotations

import asyncio

from ms_harness import Service, running
from test_ms_api import VC, create_topic, register, wait_for

from xinfra.model import TopicMetadata


async def _metadata(service: Service) -> TopicMetadata:
    return TopicMetadata.model_validate(
        await service.ok("GET", f"/v1/vclusters/{VC}/topics/orders/metadata")
    )


async def test_add_epoch_waits_for_producers_before_recording_end_offsets(
    service: Service, bootstrap: str
) -> None:
    await register(service, bootstrap, "k1")
    await register(service, bootstrap, "k2")
    created = await create_topic(service, shards=2)
    clients = f"/v1/vclusters/{VC}/clients"
    await service.ok(
        "PUT", f"{clients}/p1", json={"kind": "producer", "topics": ["orders"], "ttl_s": 60}
    )
    await service.ok(
        "PUT", f"{clients}/c1", json={"kind": "consumer", "topics": ["orders"], "ttl_s": 60}
    )
    await service.ok(
        "POST", f"{clients}/p1/heartbeat", json={"versions": {"orders": created.version}}
    )

    adding = asyncio.create_task(
        service.ok("POST", f"/v1/vclusters/{VC}/topics/orders/epochs", 201, json={"cluster": "k2"})
    )
    # Phase one is visible at once: epoch 0 retired with its end offsets still unknown.
    retired = await wait_for(lambda: _retired(service), timeout_s=10)
    assert retired.epochs[0].state == "sealed" and retired.epochs[0].end_offsets is None
    assert not adding.done(), "the seal must wait for producer p1 (the consumer does not count)"

    await service.ok(
        "POST", f"{clients}/p1/heartbeat", json={"versions": {"orders": retired.version}}
    )
    done = TopicMetadata.model_validate(await asyncio.wait_for(adding, 20))
    assert done.version == retired.version + 1
    assert done.epochs[0].end_offsets == {0: 0, 1: 0}
    assert [e.state for e in done.epochs] == ["sealed", "active"]


async def _retired(service: Service) -> TopicMetadata | None:
    metadata = await _metadata(service)
    return metadata if len(metadata.epochs) == 2 else None


async def test_seal_gives_up_on_silent_producers_after_the_bound(
    make_config,
    bootstrap: str,  # type: ignore[no-untyped-def]
) -> None:
    async with running(make_config(seal_settle_s_max=0.5)) as service:
        await register(service, bootstrap, "k1")
        await create_topic(service, shards=1)
        await service.ok(
            "PUT",
            f"/v1/vclusters/{VC}/clients/silent",
            json={"kind": "producer", "topics": ["orders"]},
        )
        sealed = TopicMetadata.model_validate(
            await service.ok("POST", f"/v1/vclusters/{VC}/topics/orders/seal", json={})
        )
        assert sealed.topic.sealed and sealed.epochs[0].end_offsets == {0: 0}


async def test_reconcile_reports_a_pending_settle_then_the_seal_finishes(
    make_config,
    bootstrap: str,  # type: ignore[no-untyped-def]
) -> None:
    async with running(make_config(seal_settle_s_max=60)) as service:
        await register(service, bootstrap, "k1")
        await create_topic(service, shards=1)
        clients = f"/v1/vclusters/{VC}/clients"
        await service.ok(
            "PUT", f"{clients}/silent", json={"kind": "producer", "topics": ["orders"]}
        )
        sealing = asyncio.create_task(
            service.http.post(f"/v1/vclusters/{VC}/topics/orders/seal", json={})
        )
        await wait_for(lambda: _half_sealed(service), timeout_s=10)
        report = await service.ok("POST", "/v1/admin/reconcile", json={})
        pending = [a for a in report["drift"] if a["action"] == "settle_pending"]
        assert [(a["topic"], a["epoch"]) for a in pending] == [("orders", 0)]
        assert "silent" in pending[0]["detail"]
        assert not sealing.done()

        await service.ok("DELETE", f"{clients}/silent", 204)  # the producer leaves
        response = await asyncio.wait_for(sealing, 20)
        assert response.status_code == 200, response.text
        assert TopicMetadata.model_validate(response.json()).epochs[0].end_offsets == {0: 0}
        report = await service.ok("POST", "/v1/admin/reconcile", json={})
        assert not [a for a in report["drift"] if a["action"] == "settle_pending"]


async def _half_sealed(service: Service) -> bool:
    metadata = await _metadata(service)
    return metadata.topic.sealed and metadata.epochs[0].end_offsets is None
