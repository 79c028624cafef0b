"""The /v1 API on real MariaDB: CRUD, optimistic concurrency, problem+json, auth, long-polls,
the clients registry, and consistency when the physical side fails."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx
from ms_harness import Service, running
from ms_memory_backend import memory_cluster

from metadata_service import ServiceConfig
from xinfra.keyspace import shard_ranges
from xinfra.model import TopicMetadata

VC = "default"


async def register(service: Service, bootstrap: str, name: str = "k1", kind: str = "kafka") -> Any:
    return await service.ok(
        "POST", "/v1/clusters", 201, json={"name": name, "kind": kind, "bootstrap": bootstrap}
    )


async def create_topic(
    service: Service, name: str = "orders", shards: int = 4, cluster: str = "k1"
) -> TopicMetadata:
    body = await service.ok(
        "POST",
        f"/v1/vclusters/{VC}/topics",
        201,
        json={
            "name": name,
            "cluster": cluster,
            "shards": shards,
            "config": {"retention.ms": "1000"},
        },
    )
    return TopicMetadata.model_validate(body)


def assert_problem(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body = response.json()
    assert body["status"] == status and body["code"] == code
    assert {"type", "title", "detail"} <= set(body)
    return body


async def wait_for(condition: Callable[[], Any], timeout_s: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = await condition()
        if value:
            return value
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def test_health_ready_metrics(service: Service) -> None:
    assert (await service.ok("GET", "/health"))["status"] == "ok"
    assert (await service.ok("GET", "/ready"))["database"] == "ok"
    metrics = await service.http.get("/metrics")
    assert "xinfra_metadata_http_requests_total" in metrics.text


async def test_cluster_and_topic_crud(service: Service, bootstrap: str) -> None:
    cluster = await register(service, bootstrap)
    assert cluster["version"] == 1 and cluster["kind"] == "kafka"
    assert_problem(
        await service.http.post(
            "/v1/clusters", json={"name": "k1", "kind": "kafka", "bootstrap": bootstrap}
        ),
        409,
        "conflict",
    )
    listed = await service.ok("GET", "/v1/clusters")
    assert [c["name"] for c in listed["clusters"]] == ["k1"]

    metadata = await create_topic(service)
    assert metadata.version == 1 and len(metadata.epochs) == 1
    epoch = metadata.epochs[0]
    assert [s.key_range for s in epoch.shards] == shard_ranges(4)
    assert epoch.physical_topic in memory_cluster(bootstrap).topics
    assert metadata.clusters["k1"].bootstrap == bootstrap
    assert_problem(
        await service.http.post(
            f"/v1/vclusters/{VC}/topics", json={"name": "orders", "cluster": "k1", "shards": 1}
        ),
        409,
        "topic_already_exists",
    )

    described = await service.ok("GET", f"/v1/vclusters/{VC}/topics/orders")
    assert described["version"] == 1
    page = await service.ok("GET", f"/v1/vclusters/{VC}/topics")
    assert [t["name"] for t in page["topics"]] == ["orders"] and page["next_after"] is None

    updated = await service.ok(
        "PATCH",
        f"/v1/vclusters/{VC}/topics/orders",
        json={"config": {"a": "b"}, "expected_version": 1},
    )
    assert updated["version"] == 2 and updated["topic"]["config"] == {"a": "b"}

    sealed = await service.ok(
        "POST",
        f"/v1/vclusters/{VC}/topics/orders/seal",
        json={"end_offsets": {str(i): i for i in range(4)}},
    )
    assert sealed["version"] == 3 and sealed["topic"]["sealed"]
    assert sealed["epochs"][0]["state"] == "sealed"
    assert sealed["epochs"][0]["end_offsets"] == {str(i): i for i in range(4)}

    assert_problem(await service.http.delete("/v1/clusters/k1"), 409, "conflict")
    await service.ok("DELETE", f"/v1/vclusters/{VC}/topics/orders", 204)
    assert memory_cluster(bootstrap).topics == {}
    assert_problem(
        await service.http.get(f"/v1/vclusters/{VC}/topics/orders"), 404, "topic_not_found"
    )
    await service.ok("DELETE", "/v1/clusters/k1", 204)
    assert_problem(await service.http.get("/v1/clusters/k1"), 404, "cluster_not_found")


async def test_add_epoch_on_another_cluster(service: Service, bootstrap: str) -> None:
    await register(service, bootstrap, "kafka-1")
    await register(service, bootstrap.replace(":9092", ":9093"), "ng-1", kind="northguard")
    await create_topic(service, "events", 3, cluster="kafka-1")
    after = await service.ok(
        "POST",
        f"/v1/vclusters/{VC}/topics/events/epochs",
        201,
        json={"cluster": "ng-1", "end_offsets": {"0": 10, "1": 20, "2": 30}, "expected_version": 1},
    )
    metadata = TopicMetadata.model_validate(after)
    assert metadata.version == 2
    assert [e.cluster for e in metadata.epochs] == ["kafka-1", "ng-1"]
    assert metadata.epochs[0].state == "sealed" and metadata.epochs[0].end_offsets == {
        0: 10,
        1: 20,
        2: 30,
    }
    assert metadata.epochs[1].state == "active" and metadata.current_epoch.number == 1
    assert [s.key_range for s in metadata.epochs[1].shards] == shard_ranges(3)
    assert set(metadata.clusters) == {"kafka-1", "ng-1"}
    # Wrong end offsets (not every shard) are refused without any change.
    response = await service.http.post(
        f"/v1/vclusters/{VC}/topics/events/epochs",
        json={"cluster": "kafka-1", "end_offsets": {"0": 1}},
    )
    assert_problem(response, 400, "invalid_request")
    # A mirror must keep its source's key ranges: another shard count is refused, nothing added.
    response = await service.http.post(
        f"/v1/vclusters/{VC}/topics/events/epochs",
        json={
            "cluster": "kafka-1",
            "state": "dual_write",
            "seal_current": False,
            "mirror_of": 1,
            "shards": 4,
        },
    )
    assert_problem(response, 400, "migration_shard_count_mismatch")
    assert len((await service.ok("GET", f"/v1/vclusters/{VC}/topics/events"))["epochs"]) == 2
    # An epoch in dual_write, then sealed by PATCH with end offsets read from the backend.
    dual = await service.ok(
        "POST",
        f"/v1/vclusters/{VC}/topics/events/epochs",
        201,
        json={"cluster": "kafka-1", "state": "dual_write", "seal_current": False, "mirror_of": 1},
    )
    assert [e["state"] for e in dual["epochs"]] == ["sealed", "active", "dual_write"]
    sealed = await service.ok(
        "PATCH",
        f"/v1/vclusters/{VC}/topics/events/epochs/1",
        json={"state": "sealed"},
        headers={"If-Match": f'"{dual["version"]}"'},
    )
    assert sealed["epochs"][1]["state"] == "sealed" and sealed["epochs"][1]["end_offsets"] == {
        "0": 0,
        "1": 0,
        "2": 0,
    }


async def race_updates(services: Sequence[Service]) -> None:
    """Eight PATCHes of topic ``orders`` at version 1, spread over ``services``: exactly one wins.

    Every loser gets 409 ``version_conflict`` and every service then reads the
    winner's config at version 2: no lost update.
    """
    url = f"/v1/vclusters/{VC}/topics/orders"
    responses = await asyncio.gather(
        *[
            services[i % len(services)].http.patch(
                url, json={"config": {"writer": str(i)}}, headers={"If-Match": '"1"'}
            )
            for i in range(8)
        ]
    )
    statuses = sorted(r.status_code for r in responses)
    assert statuses.count(200) == 1 and statuses.count(409) == 7, statuses
    for response in responses:
        if response.status_code == 409:
            assert_problem(response, 409, "version_conflict")
    winner = next(r for r in responses if r.status_code == 200).json()["topic"]["config"]
    for service in services:
        current = await service.ok("GET", url)
        assert current["version"] == 2 and current["topic"]["config"] == winner


async def test_racing_updates_one_wins(service: Service, bootstrap: str) -> None:
    await register(service, bootstrap)
    await create_topic(service)
    await race_updates([service])


async def test_problem_json_on_bad_requests(service: Service, bootstrap: str) -> None:
    http = service.http
    assert_problem(
        await http.post(
            "/v1/clusters", content=b"{not json", headers={"content-type": "application/json"}
        ),
        422,
        "invalid_request",
    )
    assert_problem(
        await http.post("/v1/clusters", json={"name": "-bad", "kind": "kafka", "bootstrap": "x"}),
        422,
        "invalid_request",
    )
    assert_problem(
        await http.post("/v1/clusters", json={"name": "ok", "kind": "pulsar", "bootstrap": "x"}),
        422,
        "invalid_request",
    )
    await register(service, bootstrap)
    zero = await http.post(
        f"/v1/vclusters/{VC}/topics", json={"name": "t", "cluster": "k1", "shards": 0}
    )
    assert_problem(zero, 422, "invalid_request")
    assert zero.json()["detail"].startswith("shards: "), zero.json()  # the caller's field name
    assert_problem(
        await http.post(
            f"/v1/vclusters/{VC}/topics", json={"name": "t", "cluster": "k1", "shards": 5000}
        ),
        422,
        "invalid_request",
    )
    assert_problem(
        await http.post(
            f"/v1/vclusters/{VC}/topics", json={"name": "t", "cluster": "nope", "shards": 1}
        ),
        404,
        "cluster_not_found",
    )
    assert_problem(
        await http.post(
            "/v1/vclusters/nope/topics", json={"name": "t", "cluster": "k1", "shards": 1}
        ),
        404,
        "not_found",
    )
    assert_problem(await http.get("/v1/no/such/route"), 404, "not_found")
    assert_problem(
        await http.get(f"/v1/vclusters/{VC}/topics/t/metadata", params={"after_version": -1}),
        422,
        "invalid_request",
    )
    big = {
        "name": "t",
        "cluster": "k1",
        "shards": 1,
        "config": {"k": "v" * 4096},
        "pad": "x" * (5 << 20),
    }
    assert_problem(await http.post(f"/v1/vclusters/{VC}/topics", json=big), 413, "invalid_request")
    assert_problem(
        await http.patch(
            f"/v1/vclusters/{VC}/topics/t", json={"config": {}}, headers={"If-Match": "abc"}
        ),
        400,
        "invalid_request",
    )


async def test_auth(service: Service, bootstrap: str) -> None:
    http = service.http
    assert_problem(
        await http.get("/v1/clusters", headers={"Authorization": ""}), 401, "unauthenticated"
    )
    assert_problem(
        await http.get("/v1/clusters", headers={"Authorization": "Bearer nope"}),
        401,
        "unauthenticated",
    )
    assert_problem(
        await http.get("/v1/clusters", headers={"Authorization": "Basic abc"}),
        401,
        "unauthenticated",
    )
    await register(service, bootstrap)
    await create_topic(service)
    await service.ok("POST", "/v1/vclusters", 201, json={"name": "other"})
    client = await service.ok(
        "POST", "/v1/tokens", 201, json={"name": "app", "role": "client", "scope": VC}
    )
    scoped_admin = await service.ok(
        "POST", "/v1/tokens", 201, json={"name": "ops", "role": "admin", "scope": VC}
    )
    listed = await service.ok("GET", "/v1/tokens")
    assert {t["name"] for t in listed["tokens"]} == {"app", "ops"}
    as_client = {"Authorization": f"Bearer {client['token']}"}
    as_ops = {"Authorization": f"Bearer {scoped_admin['token']}"}
    # A client token reads metadata of its virtual cluster, nothing else, and writes nothing.
    assert (
        await http.get(f"/v1/vclusters/{VC}/topics/orders/metadata", headers=as_client)
    ).status_code == 200
    assert_problem(
        await http.get("/v1/vclusters/other/topics", headers=as_client), 403, "forbidden"
    )
    assert_problem(
        await http.patch(
            f"/v1/vclusters/{VC}/topics/orders", json={"config": {}}, headers=as_client
        ),
        403,
        "forbidden",
    )
    assert_problem(
        await http.post(
            "/v1/clusters",
            json={"name": "k2", "kind": "kafka", "bootstrap": bootstrap},
            headers=as_client,
        ),
        403,
        "forbidden",
    )
    # A scoped admin manages topics of its virtual cluster, not clusters or tokens.
    assert (
        await http.patch(f"/v1/vclusters/{VC}/topics/orders", json={"config": {}}, headers=as_ops)
    ).status_code == 200
    assert_problem(
        await http.post("/v1/tokens", json={"name": "x", "role": "admin"}, headers=as_ops),
        403,
        "forbidden",
    )
    # A deleted token stops working (this instance drops its token cache on delete).
    await service.ok("DELETE", "/v1/tokens/app", 204)
    assert_problem(
        await http.get(f"/v1/vclusters/{VC}/topics/orders", headers=as_client),
        401,
        "unauthenticated",
    )


async def test_initial_admin_token_written(make_config: Callable[..., ServiceConfig]) -> None:
    config = make_config(admin_token=None)
    async with running(config) as service:
        token = (config.run_dir / "admin-token").read_text().strip()
        assert (config.run_dir / "admin-token").stat().st_mode & 0o777 == 0o600
        response = await service.http.get(
            "/v1/clusters", headers={"Authorization": f"Bearer {token}"}
        )
        assert response.status_code == 200
        assert_problem(await service.http.get("/v1/clusters"), 401, "unauthenticated")


async def test_long_poll_wakes_on_change(service: Service, bootstrap: str) -> None:
    await register(service, bootstrap)
    await create_topic(service)
    url = f"/v1/vclusters/{VC}/topics/orders/metadata"
    # Already newer: returns at once.
    assert (await service.ok("GET", url, params={"after_version": 0, "timeout_s": 30}))[
        "version"
    ] == 1
    # Nothing changes: returns the same version at the timeout.
    assert (await service.ok("GET", url, params={"after_version": 1, "timeout_s": 0.2}))[
        "version"
    ] == 1
    poll = asyncio.create_task(service.http.get(url, params={"after_version": 1, "timeout_s": 30}))
    await wait_for(lambda: _waiters(service))
    await service.ok("PATCH", f"/v1/vclusters/{VC}/topics/orders", json={"config": {"x": "1"}})
    response = await asyncio.wait_for(poll, 10)
    assert response.json()["version"] == 2 and response.headers["etag"] == '"2"'
    # Deleting the topic wakes a long-poll with 404.
    poll = asyncio.create_task(service.http.get(url, params={"after_version": 2, "timeout_s": 30}))
    await wait_for(lambda: _waiters(service))
    await service.ok("DELETE", f"/v1/vclusters/{VC}/topics/orders", 204)
    assert_problem(await asyncio.wait_for(poll, 10), 404, "topic_not_found")


async def _waiters(service: Service) -> bool:
    return bool(service.app.state.services.runtime.hub.waiter_count)


async def test_clients_registry_and_expiry(service: Service, bootstrap: str) -> None:
    await register(service, bootstrap)
    await create_topic(service)
    base = f"/v1/vclusters/{VC}/clients"
    await service.ok(
        "PUT",
        f"{base}/p-1",
        json={"kind": "producer", "host": "h1", "topics": ["orders"], "ttl_s": 60},
    )
    await service.ok(
        "PUT",
        f"{base}/c-1",
        json={"kind": "consumer", "host": "h2", "topics": ["orders"], "ttl_s": 0.5},
    )
    unacked = await service.ok("GET", f"/v1/vclusters/{VC}/topics/orders/unacknowledged")
    assert unacked["version"] == 1 and {c["client_id"] for c in unacked["clients"]} == {
        "p-1",
        "c-1",
    }
    beat = await service.ok("POST", f"{base}/p-1/heartbeat", json={"versions": {"orders": 1}})
    assert beat["versions"] == {"orders": 1}
    # Versions only move forward.
    assert (await service.ok("POST", f"{base}/p-1/heartbeat", json={"versions": {"orders": 0}}))[
        "versions"
    ] == {"orders": 1}
    unacked = await service.ok("GET", f"/v1/vclusters/{VC}/topics/orders/unacknowledged")
    assert {c["client_id"] for c in unacked["clients"]} <= {"c-1"}

    async def expired() -> bool:
        listed = await service.ok("GET", base, params={"topic": "orders"})
        return {c["client_id"] for c in listed["clients"]} == {"p-1"}

    await wait_for(expired)
    assert_problem(await service.http.post(f"{base}/c-1/heartbeat", json={}), 404, "not_found")

    async def purged() -> bool:
        runtime = service.app.state.services.runtime
        from sqlalchemy import text

        with runtime.store.engine.connect() as connection:
            rows = connection.execute(text("SELECT client_id FROM clients")).all()
        return [r[0] for r in rows] == ["p-1"]

    await wait_for(purged)
    await service.ok("PATCH", f"/v1/vclusters/{VC}/topics/orders", json={"config": {}})
    unacked = await service.ok("GET", f"/v1/vclusters/{VC}/topics/orders/unacknowledged")
    assert unacked["version"] == 2 and [c["client_id"] for c in unacked["clients"]] == ["p-1"]
    await service.ok("DELETE", f"{base}/p-1", 204)
    assert (await service.ok("GET", base))["clients"] == []


async def test_backend_failure_leaves_no_half_topic(service: Service, bootstrap: str) -> None:
    await register(service, bootstrap)
    cluster = memory_cluster(bootstrap)
    cluster.reachable = False
    response = await service.http.post(
        f"/v1/vclusters/{VC}/topics", json={"name": "t", "cluster": "k1", "shards": 2}
    )
    assert_problem(response, 503, "backend_unavailable")
    assert_problem(await service.http.get(f"/v1/vclusters/{VC}/topics/t"), 404, "topic_not_found")
    assert (await service.ok("GET", f"/v1/vclusters/{VC}/topics"))["topics"] == []
    cluster.reachable = True
    # The name is free again and the physical side holds nothing stray.
    await create_topic(service, "t", 2)
    assert len(cluster.topics) == 1
    # A registration against an unreachable cluster is refused.
    cluster.reachable = False
    assert_problem(
        await service.http.post(
            "/v1/clusters", json={"name": "k9", "kind": "kafka", "bootstrap": bootstrap}
        ),
        503,
        "backend_unavailable",
    )
    # Deleting while the backend is down hides the topic, keeps the intent, and finishes on retry.
    assert_problem(
        await service.http.delete(f"/v1/vclusters/{VC}/topics/t"), 503, "backend_unavailable"
    )
    assert_problem(await service.http.get(f"/v1/vclusters/{VC}/topics/t"), 404, "topic_not_found")
    cluster.reachable = True
    report = await service.ok("POST", "/v1/admin/reconcile", params={"grace_s": 0})
    assert [a["action"] for a in report["repaired"]] == ["finished_delete"]
    assert cluster.topics == {}
    # A failed add-epoch leaves the topic exactly as it was.
    await create_topic(service, "u", 2)
    cluster.fail_create = True
    response = await service.http.post(
        f"/v1/vclusters/{VC}/topics/u/epochs", json={"cluster": "k1"}
    )
    assert_problem(response, 503, "backend_unavailable")
    cluster.fail_create = False
    after = await service.ok("GET", f"/v1/vclusters/{VC}/topics/u")
    assert (
        after["version"] == 1
        and len(after["epochs"]) == 1
        and after["epochs"][0]["state"] == "active"
    )


async def test_reconcile_repairs_intents_and_reports_drift(
    service: Service, bootstrap: str
) -> None:
    await register(service, bootstrap)
    store = service.app.state.services.runtime.store
    cluster = memory_cluster(bootstrap)
    from metadata_service.store.repository import EpochRow

    # A crash after the physical create: reconcile finishes it.
    store.insert_topic_intent(
        VC,
        "done",
        {},
        EpochRow(
            VC, "done", 0, "k1", "xinfra.default.done.0.aa", shard_ranges(2), intent="creating"
        ),
    )
    cluster.topics["xinfra.default.done.0.aa"] = None  # type: ignore[assignment]
    # A crash before it: reconcile rolls back.
    store.insert_topic_intent(
        VC,
        "undone",
        {},
        EpochRow(
            VC, "undone", 0, "k1", "xinfra.default.undone.0.bb", shard_ranges(2), intent="creating"
        ),
    )
    # An orphan physical topic.
    cluster.topics["xinfra.default.lost.0.cc"] = None  # type: ignore[assignment]
    report = await service.ok("POST", "/v1/admin/reconcile", params={"grace_s": 0})
    assert sorted(a["action"] for a in report["repaired"]) == [
        "finished_create",
        "rolled_back_create",
    ]
    assert [(a["action"], a["physical_topic"]) for a in report["drift"]] == [
        ("orphan", "xinfra.default.lost.0.cc")
    ]
    assert (await service.ok("GET", f"/v1/vclusters/{VC}/topics/done"))["version"] == 1
    assert_problem(
        await service.http.get(f"/v1/vclusters/{VC}/topics/undone"), 404, "topic_not_found"
    )
    # A young intent is left alone by default.
    store.insert_topic_intent(
        VC,
        "young",
        {},
        EpochRow(
            VC, "young", 0, "k1", "xinfra.default.young.0.dd", shard_ranges(1), intent="creating"
        ),
    )
    report = await service.ok("POST", "/v1/admin/reconcile", params={"delete_orphans": True})
    assert [a["action"] for a in report["repaired"]] == ["deleted_orphan"]
    assert "xinfra.default.lost.0.cc" not in cluster.topics


async def test_vclusters(service: Service) -> None:
    assert [v["name"] for v in (await service.ok("GET", "/v1/vclusters"))["virtual_clusters"]] == [
        "default"
    ]
    await service.ok("POST", "/v1/vclusters", 201, json={"name": "team-a", "description": "A"})
    assert (await service.ok("GET", "/v1/vclusters/team-a"))["description"] == "A"
    await service.ok("DELETE", "/v1/vclusters/team-a", 204)
    assert_problem(await service.http.get("/v1/vclusters/team-a"), 404, "not_found")
