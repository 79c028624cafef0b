"""The topic-metadata read path on real MariaDB: the uncached read (one query) serves exactly
what the cache serves, what the store holds, and nothing a token may not see."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from ms_harness import Service, running
from sqlalchemy.engine import make_url
from test_ms_api import VC, assert_problem, create_topic, register, wait_for

from metadata_service import ServiceConfig
from metadata_service.cluster_secrets import public_attributes
from metadata_service.metadata_reader import MysqlMetadataReads
from metadata_service.store.repository import metadata_body
from xinfra.keyspace import shard_ranges
from xinfra.model import TopicMetadata
from xinfra.services.mysql import MysqlServer


def lookups(metrics_text: str, name: str) -> dict[str, float]:
    """``{result: count}`` of a ``<name>_total{result=...}`` counter in a /metrics page."""
    counts: dict[str, float] = {}
    prefix = f"{name}_total{{"
    for line in metrics_text.splitlines():
        if line.startswith(prefix):
            labels, value = line[len(prefix) :].split("} ")
            counts[labels.split('"')[1]] = float(value)
    return counts


async def cache_lookups(service: Service) -> dict[str, float]:
    text = (await service.http.get("/metrics")).text
    return lookups(text, "xinfra_metadata_cache_lookups")


async def token_lookups(service: Service) -> dict[str, float]:
    text = (await service.http.get("/metrics")).text
    return lookups(text, "xinfra_metadata_token_cache_lookups")


async def client_token(service: Service, name: str = "app", scope: str = VC) -> dict[str, str]:
    created = await service.ok(
        "POST", "/v1/tokens", 201, json={"name": name, "role": "client", "scope": scope}
    )
    return {"Authorization": f"Bearer {created['token']}"}


def expected_metadata(service: Service, name: str) -> TopicMetadata:
    """The client view built from the store's full rows (``get_topic``), not from the read path."""
    store = service.app.state.services.runtime.store
    topic, epochs = store.get_topic(VC, name)
    ready = [e for e in epochs if e.intent == "ready"]
    clusters = {e.cluster: store.get_cluster(e.cluster)[0] for e in ready}
    return TopicMetadata.model_validate(
        {
            "topic": {
                "virtual_cluster": VC,
                "name": name,
                "config": topic.config,
                "sealed": topic.sealed,
            },
            "version": topic.version,
            "epochs": [e.to_model() for e in ready],
            "clusters": clusters,
        }
    )


async def test_uncached_read_is_the_cached_read_and_the_stored_rows(
    service: Service, bootstrap: str
) -> None:
    await register(service, bootstrap, "kafka-1")
    await register(service, bootstrap.replace(":9092", ":9093"), "ng-1", kind="northguard")
    await create_topic(service, "events", 3, cluster="kafka-1")
    await service.ok(
        "POST",
        f"/v1/vclusters/{VC}/topics/events/epochs",
        201,
        json={"cluster": "ng-1", "end_offsets": {"0": 10, "1": 20, "2": 30}},
    )
    as_client = await client_token(service)
    url = f"/v1/vclusters/{VC}/topics/events/metadata"
    service.app.state.services.runtime.cache.invalidate(None)
    before = await cache_lookups(service)
    cold = await service.http.get(url, headers=as_client)
    warm = await service.http.get(url, headers=as_client)
    after = await cache_lookups(service)
    assert after.get("miss", 0) - before.get("miss", 0) == 1
    assert after.get("hit", 0) - before.get("hit", 0) == 1
    assert cold.status_code == warm.status_code == 200
    assert cold.content == warm.content
    assert cold.headers["etag"] == warm.headers["etag"] == '"2"'
    assert cold.headers["content-type"] == warm.headers["content-type"] == "application/json"
    metadata = TopicMetadata.model_validate_json(cold.content)
    assert metadata == expected_metadata(service, "events")
    # The body is the model's own serialization, byte for byte.
    assert cold.content == metadata.model_dump_json().encode()
    assert [e.cluster for e in metadata.epochs] == ["kafka-1", "ng-1"]
    assert metadata.epochs[0].end_offsets == {0: 10, 1: 20, 2: 30}
    assert set(metadata.clusters) == {"kafka-1", "ng-1"}


async def test_change_is_visible_after_the_version_bump(service: Service, bootstrap: str) -> None:
    await register(service, bootstrap)
    await create_topic(service, "orders")
    as_client = await client_token(service)
    url = f"/v1/vclusters/{VC}/topics/orders/metadata"
    for _ in range(2):  # the second read is a cache hit
        assert (await service.ok("GET", url, headers=as_client))["version"] == 1
    await service.ok("PATCH", f"/v1/vclusters/{VC}/topics/orders", json={"config": {"a": "b"}})
    for _ in range(2):
        body = await service.ok("GET", url, headers=as_client)
        assert body["version"] == 2 and body["topic"]["config"] == {"a": "b"}
    await service.ok(
        "POST",
        f"/v1/vclusters/{VC}/topics/orders/seal",
        json={"end_offsets": {str(i): 0 for i in range(4)}},
    )
    body = await service.ok("GET", url, headers=as_client)
    assert body["version"] == 3 and body["topic"]["sealed"] is True


async def test_missing_and_creating_topics_are_not_found(service: Service, bootstrap: str) -> None:
    await register(service, bootstrap)
    as_client = await client_token(service)
    missing = await service.http.get(f"/v1/vclusters/{VC}/topics/nope/metadata", headers=as_client)
    assert_problem(missing, 404, "topic_not_found")
    store = service.app.state.services.runtime.store
    await create_topic(service, "orders")
    _topic, epochs = store.get_topic(VC, "orders")
    epoch0 = epochs[0]
    epoch0.topic, epoch0.intent = "half", "creating"
    store.insert_topic_intent(VC, "half", {}, epoch0)
    half = await service.http.get(f"/v1/vclusters/{VC}/topics/half/metadata", headers=as_client)
    assert_problem(half, 404, "topic_not_found")


async def test_scoped_token_reads_its_virtual_cluster_only(
    service: Service, bootstrap: str
) -> None:
    await register(service, bootstrap)
    await service.ok("POST", "/v1/vclusters", 201, json={"name": "other"})
    await service.ok(
        "POST",
        "/v1/vclusters/other/topics",
        201,
        json={"name": "orders", "cluster": "k1", "shards": 2},
    )
    await create_topic(service, "orders")
    as_client = await client_token(service)
    other_url = "/v1/vclusters/other/topics/orders/metadata"
    # The admin's read puts the other virtual cluster's topic in the cache first.
    await service.ok("GET", other_url)
    await service.ok("GET", other_url)
    assert_problem(await service.http.get(other_url, headers=as_client), 403, "forbidden")
    mine = await service.ok("GET", f"/v1/vclusters/{VC}/topics/orders/metadata", headers=as_client)
    assert mine["topic"]["virtual_cluster"] == VC
    unknown = {"Authorization": "Bearer xt_not-a-token"}
    assert_problem(await service.http.get(other_url, headers=unknown), 401, "unauthenticated")


async def test_revoked_token_is_refused_on_this_instance_at_once(
    service: Service, bootstrap: str
) -> None:
    await register(service, bootstrap)
    await create_topic(service, "orders")
    as_client = await client_token(service)
    url = f"/v1/vclusters/{VC}/topics/orders/metadata"
    before = await token_lookups(service)
    for _ in range(3):  # a miss, then cached; the metadata is cached too
        await service.ok("GET", url, headers=as_client)
    after = await token_lookups(service)
    assert after.get("miss", 0) - before.get("miss", 0) == 1
    assert after.get("hit", 0) - before.get("hit", 0) >= 2
    await service.ok("DELETE", "/v1/tokens/app", 204)
    assert_problem(await service.http.get(url, headers=as_client), 401, "unauthenticated")


async def test_revoked_token_is_refused_by_another_instance_within_its_cache_time(
    make_config: Callable[..., ServiceConfig], bootstrap: str
) -> None:
    async with (
        running(make_config()) as a,
        running(make_config(token_cache_s=0.5)) as b,
    ):
        await register(a, bootstrap)
        await create_topic(a, "orders")
        as_client = await client_token(a)
        url = f"/v1/vclusters/{VC}/topics/orders/metadata"
        await b.ok("GET", url, headers=as_client)
        await b.ok("GET", url, headers=as_client)  # token and metadata cached on b
        await a.ok("DELETE", "/v1/tokens/app", 204)

        async def refused() -> bool:
            return (await b.http.get(url, headers=as_client)).status_code == 401

        await wait_for(refused, timeout_s=5)


async def test_token_revoked_while_its_lookup_is_in_flight_is_not_cached(
    service: Service, bootstrap: str
) -> None:
    """A lookup that read the row before the delete must not put it back in the cache."""
    await register(service, bootstrap)
    await create_topic(service, "orders")
    headers = await client_token(service)
    tokens = service.app.state.services.tokens
    runtime = service.app.state.services.runtime
    original = runtime.store.find_token
    entered, release = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()

    def slow_find(token_hash: str):  # type: ignore[no-untyped-def]
        row = original(token_hash)
        loop.call_soon_threadsafe(entered.set)
        asyncio.run_coroutine_threadsafe(release.wait(), loop).result(10)
        return row

    runtime.store.find_token = slow_find
    try:
        lookup = asyncio.create_task(tokens.authenticate(headers["Authorization"]))
        await asyncio.wait_for(entered.wait(), 10)
        await tokens.delete("app")
        release.set()
        assert (await lookup).name == "app"  # it started before the delete: it may pass once
    finally:
        runtime.store.find_token = original
    url = f"/v1/vclusters/{VC}/topics/orders/metadata"
    assert_problem(await service.http.get(url, headers=headers), 401, "unauthenticated")


async def test_cold_reads_miss_when_the_cache_holds_fewer_topics(
    make_config: Callable[..., ServiceConfig], bootstrap: str
) -> None:
    """How the bench produces its 0%-hit path: reads cycle over more topics than the cache holds."""
    async with running(make_config(cache_topics_max=2)) as service:
        await register(service, bootstrap)
        names = ["t0", "t1", "t2"]
        for name in names:
            await create_topic(service, name, 1)
        as_client = await client_token(service)
        before = await cache_lookups(service)
        for _ in range(3):
            for name in names:
                url = f"/v1/vclusters/{VC}/topics/{name}/metadata"
                body = await service.ok("GET", url, headers=as_client)
                assert body["topic"]["name"] == name
        after = await cache_lookups(service)
        assert after.get("miss", 0) - before.get("miss", 0) == 9
        assert after.get("hit", 0) == before.get("hit", 0)


async def test_read_path_over_a_real_socket(live_url: str, service_config: ServiceConfig) -> None:
    """The fast path sits in the ASGI stack that uvicorn runs: same answers over HTTP/1.1."""
    headers = {"Authorization": f"Bearer {service_config.admin_token}"}
    async with httpx.AsyncClient(base_url=live_url, headers=headers, timeout=30) as http:
        missing = await http.get(f"/v1/vclusters/{VC}/topics/nope/metadata")
        assert_problem(missing, 404, "topic_not_found")
        assert missing.headers["content-type"].startswith("application/problem+json")


async def test_concurrent_misses_share_batched_queries(service: Service, bootstrap: str) -> None:
    """Misses queue behind the batch in flight and go together in the next query; misses of one
    topic share one read; a miss never joins a batch that started before it arrived."""
    await register(service, bootstrap)
    for name in ("a", "b", "c"):
        await create_topic(service, name, 1)
    services = service.app.state.services
    store = services.runtime.store
    reader = services.topics.reader
    original = reader.fetch
    batches: list[list[tuple[str, str]]] = []
    entered, release = asyncio.Event(), asyncio.Event()

    async def recording(keys):  # type: ignore[no-untyped-def]
        batches.append(list(keys))
        entered.set()
        await release.wait()
        return await original(keys)

    services.runtime.cache.invalidate(None)
    reader.fetch = recording
    try:
        first = asyncio.create_task(services.topics.metadata_body(VC, "a"))
        await asyncio.wait_for(entered.wait(), 10)
        # Changed while the first batch is in flight: the later misses must see the change.
        version = await asyncio.to_thread(store.update_topic, VC, "b", 1, config={"x": "1"})
        await services.runtime.publish((VC, "b"), version)
        later = [
            asyncio.create_task(services.topics.metadata_body(VC, name))
            for name in ("b", "c", "b", "missing")
        ]
        await asyncio.sleep(0)  # let them queue
        release.set()
        assert (await first)[0] == 1
        b1, c, b2, missing = await asyncio.gather(*later, return_exceptions=True)
    finally:
        reader.fetch = original
    assert batches == [[(VC, "a")], [(VC, "b"), (VC, "c"), (VC, "missing")]]
    assert b1 == b2 and b1[0] == 2 and b'"x":"1"' in b1[1]
    assert c[0] == 1
    assert isinstance(missing, Exception) and "does not exist" in str(missing)


async def test_misses_on_mysql_are_read_on_the_loop_as_the_models_write_them(
    service: Service, bootstrap: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On MySQL a miss never takes a worker thread (the store's threaded read is not called),
    and its body is the models' own bytes: secret attributes left out, text beyond ASCII, a
    sealed epoch with its end offsets, several clusters."""
    monkeypatch.setenv("NG_SECRET", "s3cret")
    await register(service, bootstrap, "kafka-1")
    await service.ok(
        "POST",
        "/v1/clusters",
        201,
        json={
            "name": "ng-1",
            "kind": "northguard",
            "bootstrap": bootstrap.replace(":9092", ":9093"),
            "attributes": {"rack": "é-1", "sasl.password": "env:NG_SECRET"},
        },
    )
    await create_topic(service, "events", 2, cluster="kafka-1")
    await service.ok(
        "PATCH", f"/v1/vclusters/{VC}/topics/events", json={"config": {"note": "naïve ✓"}}
    )
    await service.ok(
        "POST",
        f"/v1/vclusters/{VC}/topics/events/epochs",
        201,
        json={"cluster": "ng-1", "end_offsets": {"0": 7, "1": 9}},
    )
    runtime = service.app.state.services.runtime
    store = runtime.store

    def no_thread(keys):  # type: ignore[no-untyped-def]
        raise AssertionError(f"a threaded store read for {keys}")

    runtime.cache.invalidate(None)
    store.read_metadata_bodies = no_thread
    try:
        response = await service.http.get(f"/v1/vclusters/{VC}/topics/events/metadata")
    finally:
        del store.read_metadata_bodies
    assert response.status_code == 200, response.text
    stored = expected_metadata(service, "events")
    assert stored.clusters["ng-1"].attributes["sasl.password"] == "env:NG_SECRET"
    metadata = stored.model_copy(
        update={
            "clusters": {
                name: cluster.model_copy(
                    update={"attributes": public_attributes(cluster.attributes)}
                )
                for name, cluster in stored.clusters.items()
            }
        }
    )
    assert metadata.clusters["ng-1"].attributes == {"rack": "é-1"}
    assert response.content == metadata.model_dump_json().encode()
    assert metadata.epochs[0].state == "sealed" and metadata.epochs[0].end_offsets == {0: 7, 1: 9}
    # The threaded read (SQLite's path, and the registry's) answers the same bytes.
    assert store.read_metadata_bodies([(VC, "events")]) == {
        (VC, "events"): (metadata.version, response.content)
    }


async def test_a_miss_after_the_server_dropped_the_connection_reconnects(
    service: Service, bootstrap: str, mysql_server: MysqlServer
) -> None:
    """The loop's MySQL connection closed by the server while idle (wait_timeout, a restart):
    the next miss reads on a new connection, with no error for the client."""
    await register(service, bootstrap)
    await create_topic(service, "orders", 1)
    services = service.app.state.services
    url = f"/v1/vclusters/{VC}/topics/orders/metadata"
    services.runtime.cache.invalidate(None)
    assert (await service.http.get(url)).status_code == 200
    reads = services.topics.reader.fetch
    thread_id = reads._connection.thread_id()  # type: ignore[attr-defined]
    with mysql_server.connect() as admin, admin.cursor() as cursor:
        cursor.execute(f"KILL {int(thread_id)}")
    services.runtime.cache.invalidate(None)
    again = await service.http.get(url)
    assert again.status_code == 200, again.text
    assert again.json()["topic"]["name"] == "orders"
    assert reads._connection.thread_id() != thread_id  # type: ignore[attr-defined]


def test_the_body_built_from_rows_is_the_models_own_bytes() -> None:
    """``metadata_body`` writes what ``TopicMetadata.model_dump_json`` writes, for text that
    JSON escapes, epochs out of order, one cluster under several epochs, a mirror and a
    sealed epoch; and a topic that is not active, or has no ready epoch, is not visible."""
    layout = json.dumps([r.to_json() for r in shard_ranges(3)])
    config = json.dumps({'quote"s': "back\\slash", "ctl": "a\nb\t\x01", "wide": "é ✓ 🚀"})

    def row(number: int, cluster: str, state: str, end: str | None, mirror: int | None) -> tuple:
        kind = "northguard" if cluster == "ng-1" else "kafka"
        attributes = json.dumps({"rack": "r1", "sasl.password": "env:X"})
        return (VC, "t", "active", config, 1, 9, number, cluster, f"xinfra.t.{number}", layout,
                state, end, mirror, kind, f"{cluster}:9092", attributes)  # fmt: skip

    rows = [
        row(2, "kafka-1", "dual_write", None, 1),
        row(0, "kafka-1", "sealed", json.dumps({"0": 5, "1": 0, "2": 12}), None),
        row(1, "ng-1", "active", None, None),
    ]
    found = metadata_body((VC, "t"), list(rows))
    assert found is not None
    version, body = found
    model = TopicMetadata.model_validate_json(body)
    assert version == model.version == 9
    assert body == model.model_dump_json().encode()
    assert [e.number for e in model.epochs] == [0, 1, 2] and model.epochs[2].mirror_of == 1
    assert model.topic.config["wide"] == "é ✓ 🚀" and model.topic.sealed
    assert all(c.attributes == {"rack": "r1"} for c in model.clusters.values())
    assert list(model.clusters) == ["kafka-1", "ng-1"]
    assert metadata_body((VC, "t"), []) is None
    deleting = (*rows[0][:2], "deleting", *rows[0][3:])
    assert metadata_body((VC, "t"), [deleting]) is None
    no_epoch = (*rows[0][:6], *(None,) * 10)
    assert metadata_body((VC, "t"), [no_epoch]) is None


def test_misses_go_on_the_loop_for_plain_mysql_urls_only() -> None:
    """SQLite and MySQL with TLS or other driver options keep the threaded store read."""
    assert MysqlMetadataReads.supports(make_url("mysql+pymysql://root@127.0.0.1:3306/x"))
    assert MysqlMetadataReads.supports(make_url("mariadb+pymysql://u:p@h/x?charset=utf8mb4"))
    assert not MysqlMetadataReads.supports(make_url("sqlite:///x.db"))
    assert not MysqlMetadataReads.supports(make_url("mysql+pymysql://u@h/x?ssl_ca=/ca.pem"))


async def test_misses_on_sqlite_are_read_by_the_store_thread(
    make_config: Callable[..., ServiceConfig], bootstrap: str, tmp_path: Path
) -> None:
    async with running(make_config(database_url=f"sqlite:///{tmp_path / 'm.db'}")) as service:
        assert service.app.state.services.topics.reader._mysql is None
        await register(service, bootstrap)
        await create_topic(service, "orders", 2)
        service.app.state.services.runtime.cache.invalidate(None)
        response = await service.http.get(f"/v1/vclusters/{VC}/topics/orders/metadata")
        assert response.status_code == 200, response.text
        assert response.content == expected_metadata(service, "orders").model_dump_json().encode()
