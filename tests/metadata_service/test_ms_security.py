"""Tenants stay apart (issue 17) on real MariaDB: exact scopes, secrets kept, and a clients
registry bound to the principal that registered each client."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
from ms_harness import Service, running
from test_ms_api import assert_problem

from metadata_service import ServiceConfig
from xinfra.errors import Backpressure, Unauthenticated

CARDS = {"name": "cards", "cluster": "k1", "shards": 2, "config": {}}


async def token(service: Service, name: str, role: str, scope: str) -> dict[str, str]:
    created = await service.ok(
        "POST", "/v1/tokens", 201, json={"name": name, "role": role, "scope": scope}
    )
    return {"Authorization": f"Bearer {created['token']}"}


async def two_tenants(service: Service, bootstrap: str, **attributes: str) -> None:
    """vcs ``payments`` (topic ``cards``) and ``Payments`` (empty), on cluster k1."""
    await service.ok(
        "POST",
        "/v1/clusters",
        201,
        json={"name": "k1", "kind": "kafka", "bootstrap": bootstrap, "attributes": attributes},
    )
    await service.ok("POST", "/v1/vclusters", 201, json={"name": "payments"})
    await service.ok("POST", "/v1/vclusters", 201, json={"name": "Payments"})
    await service.ok("POST", "/v1/vclusters/payments/topics", 201, json=CARDS)


# ---- exact scopes -----------------------------------------------------------------------


async def test_vc_names_differing_by_case_are_distinct(service: Service, bootstrap: str) -> None:
    await two_tenants(service, bootstrap)
    names = {v["name"] for v in (await service.ok("GET", "/v1/vclusters"))["virtual_clusters"]}
    assert {"payments", "Payments"} <= names
    # The same topic name in both: two topics, each on its own.
    await service.ok("POST", "/v1/vclusters/Payments/topics", 201, json=CARDS)
    await service.ok("DELETE", "/v1/vclusters/Payments/topics/cards", 204)
    assert (await service.ok("GET", "/v1/vclusters/payments/topics/cards/metadata"))["topic"][
        "virtual_cluster"
    ] == "payments"


async def test_case_variant_scope_reaches_nothing(service: Service, bootstrap: str) -> None:
    await two_tenants(service, bootstrap)
    client = await token(service, "upper-client", "client", "Payments")
    admin = await token(service, "upper-admin", "admin", "Payments")
    http = service.http
    for path in ("/metadata", "", "/unacknowledged"):
        url = f"/v1/vclusters/Payments/topics/cards{path}"
        for headers in (client, admin):
            assert_problem(await http.get(url, headers=headers), 404, "topic_not_found")
    long_poll = "/v1/vclusters/Payments/topics/cards/metadata?after_version=0&timeout_s=0.1"
    assert_problem(await http.get(long_poll, headers=client), 404, "topic_not_found")
    listed = await service.ok("GET", "/v1/vclusters/Payments/topics", headers=client)
    assert listed["topics"] == []
    assert_problem(
        await http.delete("/v1/vclusters/Payments/topics/cards", headers=admin),
        404,
        "topic_not_found",
    )
    assert_problem(
        await http.get("/v1/vclusters/payments/topics/cards/metadata", headers=client),
        403,
        "forbidden",
    )
    # payments/cards is still there.
    await service.ok("GET", "/v1/vclusters/payments/topics/cards/metadata")


async def test_topic_names_differing_by_case_are_distinct(service: Service, bootstrap: str) -> None:
    await two_tenants(service, bootstrap)
    await service.ok("POST", "/v1/vclusters/payments/topics", 201, json={**CARDS, "name": "Cards"})
    assert_problem(
        await service.http.get("/v1/vclusters/payments/topics/CARDS/metadata"),
        404,
        "topic_not_found",
    )
    await service.ok("DELETE", "/v1/vclusters/payments/topics/Cards", 204)
    await service.ok("GET", "/v1/vclusters/payments/topics/cards/metadata")


async def test_token_scope_must_name_an_existing_vc(service: Service) -> None:
    for scope in ("nope", "DEFAULT"):
        response = await service.http.post(
            "/v1/tokens", json={"name": "t", "role": "client", "scope": scope}
        )
        assert_problem(response, 404, "not_found")
    await token(service, "t", "client", "default")
    await token(service, "all", "admin", "*")
    # A vc with a token scoped to it is not deleted under the token.
    await service.ok("POST", "/v1/vclusters", 201, json={"name": "team"})
    await token(service, "team-client", "client", "team")
    assert_problem(await service.http.delete("/v1/vclusters/team"), 409, "conflict")
    await service.ok("DELETE", "/v1/tokens/team-client", 204)
    await service.ok("DELETE", "/v1/vclusters/team", 204)


def test_exact_names_migration_round_trips(mysql_url: str) -> None:
    """0005 on MariaDB: case-insensitive before, binary after, and back on downgrade."""
    import sqlalchemy as sa
    from alembic import command

    from metadata_service.migrate import alembic_config, upgrade_database

    def collations() -> set[str]:
        engine = sa.create_engine(mysql_url, poolclass=sa.pool.NullPool)
        with engine.connect() as c:
            rows = c.execute(
                sa.text(
                    "SELECT COLLATION_NAME FROM information_schema.COLUMNS WHERE "
                    "TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'virtual_clusters' "
                    "AND COLUMN_NAME = 'name'"
                )
            ).all()
        engine.dispose()
        return {r[0] for r in rows}

    upgrade_database(mysql_url, "0004")
    assert collations() != {"utf8mb4_bin"}
    upgrade_database(mysql_url)
    assert collations() == {"utf8mb4_bin"}
    command.downgrade(alembic_config(mysql_url), "0004")
    assert collations() != {"utf8mb4_bin"}
    upgrade_database(mysql_url)
    assert collations() == {"utf8mb4_bin"}


# ---- secrets kept -----------------------------------------------------------------------

SECRETS = {
    "sasl_password": "hunter2-a",
    "sasl.password": "hunter2-b",
    "ssl.key.password": "env:XINFRA_TEST_KEY_PASSWORD",
    "api_key": "hunter2-c",
    "ssl.key.pem": "hunter2-e",  # librdkafka's inline private key
    "ssl.keystore.password": "hunter2-f",
    "sasl.kerberos.keytab": "hunter2-g",
    "sasl.oauthbearer.config": "hunter2-h",
    "sasl.oauthbearer.client.secret": "hunter2-i",
}
PUBLIC = {
    "request_timeout_s": "5",
    "security.protocol": "SASL_SSL",
    "sasl.username": "svc",
    "ssl.ca.pem": "a public certificate",
    "ssl.certificate.pem": "a public certificate",
}


async def test_cluster_secrets_never_reach_clients(
    service: Service, bootstrap: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XINFRA_TEST_KEY_PASSWORD", "hunter2-d")
    await two_tenants(service, bootstrap, **SECRETS, **PUBLIC)
    client = await token(service, "payments-client", "client", "payments")
    scoped_admin = await token(service, "payments-admin", "admin", "payments")
    http = service.http
    for headers in (client, scoped_admin):
        responses = [
            await http.get("/v1/clusters", headers=headers),
            await http.get("/v1/clusters/k1", headers=headers),
            await http.get("/v1/vclusters/payments/topics/cards/metadata", headers=headers),
            await http.get(
                "/v1/vclusters/payments/topics/cards/metadata?after_version=0&timeout_s=1",
                headers=headers,
            ),
        ]
        for response in responses:
            assert response.status_code == 200, response.text
            assert "hunter2" not in response.text and "XINFRA_TEST" not in response.text
        assert responses[0].json()["clusters"][0]["attributes"] == PUBLIC
        assert responses[1].json()["attributes"] == PUBLIC
        assert responses[2].json()["clusters"]["k1"]["attributes"] == PUBLIC
        assert responses[3].json()["clusters"]["k1"]["attributes"] == PUBLIC


async def test_admin_listings_redact_secrets(
    service: Service, bootstrap: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XINFRA_TEST_KEY_PASSWORD", "hunter2-d")
    registered = await service.http.post(
        "/v1/clusters",
        json={"name": "k1", "kind": "kafka", "bootstrap": bootstrap, "attributes": SECRETS},
    )
    for response in (
        registered,
        await service.http.get("/v1/clusters"),
        await service.http.get("/v1/clusters/k1"),
    ):
        assert response.status_code in (200, 201), response.text
        assert "hunter2" not in response.text and "XINFRA_TEST" not in response.text
    listed = (await service.ok("GET", "/v1/clusters/k1"))["attributes"]
    assert listed == dict.fromkeys(SECRETS, "<redacted>")
    # The store keeps them: the service itself still reaches the cluster with them.
    cluster, _ = service.app.state.services.runtime.store.get_cluster("k1")
    assert cluster.attributes == SECRETS


def test_secret_references_resolve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from metadata_service.cluster_secrets import resolve
    from xinfra.errors import BackendUnavailable
    from xinfra.model import PhysicalCluster

    secret_file = tmp_path / "password"
    secret_file.write_text("from-file\n")
    monkeypatch.setenv("XINFRA_TEST_KEY_PASSWORD", "from-env")
    cluster = PhysicalCluster.model_validate(
        {
            "name": "k1",
            "kind": "kafka",
            "bootstrap": "h:1",
            "attributes": {
                "ssl.key.password": "env:XINFRA_TEST_KEY_PASSWORD",
                "sasl.password": f"file:{secret_file}",
                "comment": "env:NOT_A_SECRET_KEY",
            },
        }
    )
    assert resolve(cluster).attributes == {
        "ssl.key.password": "from-env",
        "sasl.password": "from-file",
        "comment": "env:NOT_A_SECRET_KEY",
    }
    monkeypatch.delenv("XINFRA_TEST_KEY_PASSWORD")
    with pytest.raises(BackendUnavailable, match="XINFRA_TEST_KEY_PASSWORD"):
        resolve(cluster)


async def test_initial_admin_token_in_no_log(
    make_config: Callable[..., ServiceConfig],
    capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    config = make_config(admin_token=None)
    async with running(config) as service:
        path = config.run_dir / "admin-token"
        token_value = path.read_text().strip()
        assert path.stat().st_mode & 0o777 == 0o600
        headers = {"Authorization": f"Bearer {token_value}"}
        await service.ok("GET", "/v1/clusters", headers=headers)
        await service.http.get("/v1/clusters", headers={"Authorization": "Bearer xt_wrong"})
    out, err = capfd.readouterr()
    assert token_value not in out + err + caplog.text
    assert str(path) in caplog.text  # where it is, not what it is


# ---- the clients registry is bound to its principal ------------------------------------

REGISTRATION = {"kind": "producer", "host": "h1", "topics": ["cards"], "ttl_s": 60}


async def test_client_registration_belongs_to_its_token(service: Service, bootstrap: str) -> None:
    await two_tenants(service, bootstrap)
    alice = await token(service, "alice", "client", "payments")
    mallory = await token(service, "mallory", "client", "payments")
    vc_admin = await token(service, "payments-ops", "admin", "payments")
    http = service.http
    base = "/v1/vclusters/payments/clients/p-1"
    await service.ok("PUT", base, json=REGISTRATION, headers=alice)
    # Another token of the same vc can read it, but not heartbeat, overwrite or delete it.
    await service.ok("GET", base, headers=mallory)
    assert_problem(
        await http.post(f"{base}/heartbeat", json={"versions": {"cards": 1}}, headers=mallory),
        403,
        "forbidden",
    )
    assert_problem(
        await http.put(base, json={**REGISTRATION, "host": "evil"}, headers=mallory),
        403,
        "forbidden",
    )
    assert_problem(await http.delete(base, headers=mallory), 403, "forbidden")
    unacked = await service.ok("GET", "/v1/vclusters/payments/topics/cards/unacknowledged")
    assert [c["client_id"] for c in unacked["clients"]] == ["p-1"]
    assert (await service.ok("GET", base, headers=alice))["host"] == "h1"
    # Its own token heartbeats and re-registers it; an admin of the vc may remove it.
    await service.ok("POST", f"{base}/heartbeat", json={"versions": {"cards": 1}}, headers=alice)
    await service.ok("PUT", base, json=REGISTRATION, headers=alice)
    await service.ok("DELETE", base, 204, headers=vc_admin)
    # Once gone, the id is free for anyone.
    await service.ok("PUT", base, json=REGISTRATION, headers=mallory)


async def test_heartbeat_ahead_of_the_topic_is_refused(service: Service, bootstrap: str) -> None:
    await two_tenants(service, bootstrap)
    base = "/v1/vclusters/payments/clients/p-1"
    await service.ok("PUT", base, json=REGISTRATION)
    body = assert_problem(
        await service.http.post(f"{base}/heartbeat", json={"versions": {"cards": 999}}),
        400,
        "version_ahead",
    )
    assert "999" in body["detail"] and "cards" in body["detail"]
    assert (await service.ok("GET", base))["versions"] == {}
    # A version for a topic that does not exist is not recorded (it would ack its future).
    beat = await service.ok(
        "POST", f"{base}/heartbeat", json={"versions": {"cards": 1, "later": 5}}
    )
    assert beat["versions"] == {"cards": 1}
    unacked = await service.ok("GET", "/v1/vclusters/payments/topics/cards/unacknowledged")
    assert unacked["clients"] == []


# ---- deployment ---------------------------------------------------------------------------


@pytest.mark.parametrize("placeholder", ["change-me-admin-token", "short-token", "  admin "])
def test_placeholder_admin_token_is_refused(
    make_config: Callable[..., ServiceConfig], placeholder: str
) -> None:
    from metadata_service import create_app

    with pytest.raises(ValueError, match="XINFRA_ADMIN_TOKEN"):
        create_app(make_config(admin_token=placeholder))


def test_compose_refuses_placeholders_and_publishes_only_client_ports() -> None:
    import os
    import shutil
    import subprocess

    import yaml

    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose is not installed: `apt-get install docker-compose`")
    root = Path(__file__).resolve().parents[2]
    secrets = {
        "XINFRA_ADMIN_TOKEN": "a" * 40,
        "MYSQL_ROOT_PASSWORD": "b" * 20,
        "XINFRA_DB_PASSWORD": "c" * 20,
        "XINFRA_COUCHBASE_PASSWORD": "d" * 20,
        "XINFRA_NORTHGUARD_SECRET": "e" * 40,
    }
    base = {k: v for k, v in os.environ.items() if k not in secrets}
    for missing in secrets:
        env = {**base, **{k: v for k, v in secrets.items() if k != missing}}
        refused = subprocess.run(
            [binary, "config", "-q"], cwd=root, env=env, capture_output=True, text=True, timeout=60
        )
        assert refused.returncode != 0 and missing in refused.stderr, refused.stderr
    rendered = subprocess.run(
        [binary, "config"],
        cwd=root,
        env={**base, **secrets},
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    services = yaml.safe_load(rendered)["services"]
    published = {name: s["ports"] for name, s in services.items() if s.get("ports")}
    assert set(published) == {"metadata-service", "kafka"}, published
    assert "xinfra-secret" not in rendered and "root" not in json_values(services["mysql"])


def json_values(service: dict[str, object]) -> str:
    import json

    return json.dumps(service.get("environment", {}))


# ---- token lookups ----------------------------------------------------------------------


async def test_a_known_tokens_expired_cache_entry_costs_one_lookup_not_a_429(
    make_config: Callable[..., ServiceConfig],
) -> None:
    """Concurrent requests of a known token whose cache entry just expired share one store
    lookup; none spends a failure of its peer's bucket, so none is refused with 429."""
    config = make_config(token_cache_s=0.0, auth_failures_burst=5, auth_failures_per_s=0.001)
    async with running(config) as service:
        headers = await token(service, "busy", "client", "default")
        tokens = service.app.state.services.tokens
        store = service.app.state.services.runtime.store
        lookups = 0
        find_token = store.find_token

        def counted(digest: str) -> object:
            nonlocal lookups
            lookups += 1
            return find_token(digest)

        store.find_token = counted
        for _ in range(3):  # each round finds the entry expired (token_cache_s=0)
            principals = await asyncio.gather(
                *(tokens.authenticate(headers["Authorization"], "10.0.0.1") for _ in range(40))
            )
            assert {p.name for p in principals} == {"busy"}
        assert lookups == 3, f"{lookups} store lookups for 3 rounds of 40 concurrent requests"
        # An unknown token is still bounded per peer: the bucket of 5 runs out.
        refused = 0
        for i in range(8):
            try:
                await tokens.authenticate(f"Bearer xt_unknown_{i}", "10.0.0.2")
            except Backpressure:
                refused += 1
            except Unauthenticated:
                pass
        assert refused == 3
