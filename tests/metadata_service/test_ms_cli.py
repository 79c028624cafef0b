"""The CLI (xinfra.commands over xinfra.rest) against a live uvicorn server, and `db upgrade`."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from ms_memory_backend import memory_cluster
from typer.testing import CliRunner

from metadata_service.cli import db_app
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
        bootstrap + "n",
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
    assert run(db_app, "upgrade", "--database-url", url, "--json") == {"revision": "0001"}
    assert run(db_app, "upgrade", "--database-url", url, "--json") == {"revision": "0001"}
    assert run(db_app, "upgrade", "--database-url", mysql_url, "--json") == {"revision": "0001"}
