"""The CLI (xinfra.commands over xinfra.rest) against a live uvicorn server, and `db upgrade`."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from alembic.script import ScriptDirectory
from ms_memory_backend import memory_cluster
from typer.testing import CliRunner

from metadata_service.cli import db_app
from metadata_service.migrate import alembic_config
from xinfra.commands.clusters import app as clusters_app
from xinfra.commands.topics import app as topics_app
from xinfra.settings import get_settings


def run(app, *args: str) -> object:  # type: ignore[no-untyped-def]
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_clusters_and_topics_commands(live_url: str) -> None:
    bootstrap = f"memory-{uuid.uuid4().hex[:8]}:9092"
    memory_cluster(bootstrap)
    cluster = run(
        clusters_app,
        "register",
        "k1",
        "--kind",
        "kafka",
        "--bootstrap",
        bootstrap,
        "--attr",
        "rack=r1",
        "--json",
    )
    assert cluster == {
        "name": "k1",
        "kind": "kafka",
        "bootstrap": bootstrap,
        "attributes": {"rack": "r1"},
        "version": 1,
    }
    run(
        clusters_app,
        "register",
        "ng",
        "--kind",
        "northguard",
        "--bootstrap",
        bootstrap.replace(":9092", ":9093"),
        "--json",
    )
    assert [c["name"] for c in run(clusters_app, "list", "--json")] == ["k1", "ng"]
    assert run(clusters_app, "describe", "ng", "--json")["kind"] == "northguard"

    created = run(
        topics_app,
        "create",
        "orders",
        "--cluster",
        "k1",
        "--shards",
        "3",
        "--config",
        "a=b",
        "--json",
    )
    assert created["version"] == 1 and created["topic"]["config"] == {"a": "b"}
    assert [t["name"] for t in run(topics_app, "list", "--json")] == ["orders"]
    moved = run(
        topics_app,
        "add-epoch",
        "orders",
        "--cluster",
        "ng",
        "--end-offset",
        "0=5",
        "--end-offset",
        "1=6",
        "--end-offset",
        "2=7",
        "--json",
    )
    assert [e["cluster"] for e in moved["epochs"]] == ["k1", "ng"]
    assert moved["epochs"][0]["end_offsets"] == {"0": 5, "1": 6, "2": 7}
    sealed = run(topics_app, "seal", "orders", "--json")
    # Two-phase: version 3 retires epoch 1 with end offsets unknown, version 4 records them.
    assert sealed["topic"]["sealed"] and sealed["version"] == 4
    assert sealed["epochs"][1]["end_offsets"] is not None
    assert run(topics_app, "describe", "orders", "--json")["version"] == 4
    assert run(topics_app, "reconcile", "--json")["errors"] == []
    run(topics_app, "delete", "orders", "--json")
    assert run(topics_app, "list", "--json") == []

    # A failing operation exits 1 with the service's message; human output works too.
    result = CliRunner().invoke(topics_app, ["describe", "nope"])
    assert result.exit_code == 1 and "topic_not_found" in result.output
    assert CliRunner().invoke(clusters_app, ["list"]).exit_code == 0


def test_invalid_registration_is_refused_with_its_reason(live_url: str) -> None:
    """The service's 400 becomes exit 1 with the reason; what the model refuses, exit 2."""
    runner = CliRunner()
    refused = runner.invoke(
        clusters_app, ["register", "c", "--kind", "kafka", "--bootstrap", "127.0.0.1:99999"]
    )
    assert refused.exit_code == 1, refused.output
    assert "port in 1..65535" in refused.output and "invalid_request" in refused.output
    refused = runner.invoke(
        clusters_app,
        [
            "register",
            "c",
            "--kind",
            "kafka",
            "--bootstrap",
            "h:1",
            "--attr",
            "request_timeout_s=nan",
        ],
    )
    assert refused.exit_code == 1 and "finite" in refused.output, refused.output
    for argv in (
        ["register", "bad/name", "--kind", "kafka", "--bootstrap", "h:1"],
        ["register", "c", "--kind", "kafka", "--bootstrap", ""],
        ["register", "c", "--kind", "kafka", "--bootstrap", "h:1", "--attr", "novalue"],
    ):
        refused = runner.invoke(clusters_app, argv)
        assert refused.exit_code == 2, refused.output
        assert refused.exception is None or isinstance(refused.exception, SystemExit)
    assert run(clusters_app, "list", "--json") == []


def test_unreachable_service_exits_3(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XINFRA_METADATA_URL", "http://127.0.0.1:1")
    get_settings.cache_clear()
    try:
        result = CliRunner().invoke(topics_app, ["list"])
        assert result.exit_code == 3, result.output
    finally:
        get_settings.cache_clear()


def test_db_upgrade(tmp_path: Path, mysql_url: str) -> None:
    url = f"sqlite:///{tmp_path / 'sub' / 'metadata.db'}"
    head = {"revision": ScriptDirectory.from_config(alembic_config(url)).get_current_head()}
    assert run(db_app, "upgrade", "--database-url", url, "--json") == head
    assert run(db_app, "upgrade", "--database-url", url, "--json") == head
    assert run(db_app, "upgrade", "--database-url", mysql_url, "--json") == head
