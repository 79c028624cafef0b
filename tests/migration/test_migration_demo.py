"""``xinfra demo migration`` as a user runs it, small and quick, on the test fixtures' brokers."""

from __future__ import annotations

import json

from sdk_live import ADMIN_TOKEN, LiveService, needs_kafka, needs_northguard
from test_sdk_cli import run

pytestmark = [needs_kafka, needs_northguard]


def test_demo_migrates_a_loaded_kafka_topic_and_verifies_every_record(
    live: LiveService, kafka: str, northguard: str
) -> None:
    args = ["demo", "migration", "--topic", "demo-moving", "--rate", "150", "--phase-s", "0.5"]
    result = run([*args, "--shards", "3", "--json"], live.url, ADMIN_TOKEN, timeout_s=180)
    assert result.returncode == 0, result.stderr.decode() + result.stdout.decode()
    report = json.loads(result.stdout)
    assert report["ok"] and report["state"] == "completed"
    assert [s["state"] for s in report["steps"]] == [
        "planned",
        "dual_write",
        "cut_over",
        "completed",
    ]
    assert [(e["cluster"], e["state"]) for e in report["epochs"]] == [
        (kafka, "sealed"),
        (northguard, "active"),
    ]
    assert report["produced"] == report["acknowledged"] > 0
    for figures in (report, report["read_through"]):
        assert (figures["lost"], figures["read_twice"], figures["order_violations"]) == (0, 0, 0)
    assert report["read_through"]["consumed"] == report["acknowledged"]
    assert report["longest_stall_ms"] > 0

    text = run(
        [*args[:2], "--rate", "50", "--phase-s", "0.2"], live.url, ADMIN_TOKEN, timeout_s=180
    )
    assert text.returncode == 0, text.stderr.decode()
    assert "nothing lost, nothing read twice" in text.stdout.decode()
    assert "longest producer stall" in text.stdout.decode()
