"""``xinfra produce`` and ``xinfra consume`` as a user runs them: subprocesses, stdin and stdout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sdk_live import VC, LiveService, needs_kafka

from xinfra.services.ports import free_port

XINFRA = str(Path(sys.executable).with_name("xinfra"))


def run(
    args: list[str], url: str, token: str, stdin: bytes = b"", timeout_s: float = 90
) -> subprocess.CompletedProcess[bytes]:
    env = {
        **os.environ,
        "XINFRA_METADATA_URL": url,
        "XINFRA_TOKEN": token,
        "XINFRA_VIRTUAL_CLUSTER": VC,
    }
    return subprocess.run(
        [XINFRA, *args], input=stdin, capture_output=True, env=env, timeout=timeout_s, check=False
    )


def test_unreachable_service_exits_3_and_unknown_topic_exits_1(live: LiveService) -> None:
    down = f"http://127.0.0.1:{free_port()}"
    result = run(["produce", "t", "--connect-timeout-s", "0.5", "-q"], down, "x", b"a\n")
    assert result.returncode == 3, result.stderr.decode()
    assert b"127.0.0.1" in result.stderr
    result = run(["consume", "t", "--connect-timeout-s", "0.5", "-q"], down, "x")
    assert result.returncode == 3, result.stderr.decode()

    from sdk_live import ADMIN_TOKEN

    from xinfra.rest import MetadataClient

    with MetadataClient(live.url, token=ADMIN_TOKEN) as admin:
        token = admin.request(
            "POST", "/v1/tokens", json={"name": "cli", "role": "client", "scope": VC}
        )["token"]
    result = run(["produce", "missing", "-q"], live.url, token, b"a\n")
    assert result.returncode == 1 and b"topic_not_found" in result.stderr, result.stderr
    result = run(["consume", "missing", "-q", "--idle-s", "1"], live.url, token)
    assert result.returncode == 1 and b"topic_not_found" in result.stderr, result.stderr


@needs_kafka
def test_produce_lines_and_json_then_consume_them(live: LiveService, kafka: str) -> None:
    with live.admin() as admin:
        admin.create_topic(VC, "cli", kafka, 3)
        token = admin.request(
            "POST", "/v1/tokens", json={"name": "cli", "role": "client", "scope": VC}
        )["token"]

    lines = b"".join(b"user%d:event%d\n" % (i % 7, i) for i in range(500))
    result = run(["produce", "cli", "--key-separator", ":"], live.url, token, lines)
    assert result.returncode == 0, result.stderr.decode()
    assert b"500 records acknowledged, 0 failed" in result.stderr

    json_lines = b"".join(
        json.dumps({"key": "j", "value": f"json{i}", "headers": {"h": "v"}}).encode() + b"\n"
        for i in range(20)
    )
    result = run(["produce", "cli", "--json", "-q"], live.url, token, json_lines)
    assert result.returncode == 0, result.stderr.decode()
    summary = json.loads(result.stdout.decode().strip().splitlines()[-1])
    assert summary["acknowledged"] == 20 and summary["failed"] == 0

    result = run(["consume", "cli", "--json", "-n", "520", "-q"], live.url, token)
    assert result.returncode == 0, result.stderr.decode()
    records = [json.loads(line) for line in result.stdout.decode().splitlines()]
    assert len(records) == 520
    assert {r["topic"] for r in records} == {"cli"}
    assert {"epoch", "shard", "offset", "timestamp_ms", "key", "value", "headers"} <= set(
        records[0]
    )
    per_user: dict[str, list[int]] = {}
    for r in records:
        if r["value"].startswith("event"):
            per_user.setdefault(r["key"], []).append(int(r["value"][5:]))
    assert sum(len(v) for v in per_user.values()) == 500
    assert all(seq == sorted(seq) for seq in per_user.values()), "per-key order"
    assert [r["value"] for r in records if r["key"] == "j"] == [f"json{i}" for i in range(20)]
    assert {tuple(map(tuple, r["headers"])) for r in records if r["key"] == "j"} == {(("h", "v"),)}

    result = run(
        ["consume", "cli", "--print-key", "--key-separator", "=", "--idle-s", "1", "-q"],
        live.url,
        token,
    )
    assert result.returncode == 0
    assert b"user3=event3\n" in result.stdout and result.stdout.count(b"\n") == 520


@needs_kafka
def test_offsets_exit_at_end_last_n_and_repeated_headers(live: LiveService, kafka: str) -> None:
    """The Kafka-tool equivalents: kafka-get-offsets, kcat -e, kcat -o -N, headers that repeat."""
    with live.admin() as admin:
        admin.create_topic(VC, "tools", kafka, 3)
        token = admin.request(
            "POST", "/v1/tokens", json={"name": "tools", "role": "client", "scope": VC}
        )["token"]
    lines = b"".join(
        json.dumps(
            {"key": f"k{i}", "value": f"v{i}", "headers": [["h", "1"], ["h", "2"], ["x", str(i)]]}
        ).encode()
        + b"\n"
        for i in range(30)
    )
    assert run(["produce", "tools", "--json", "-q"], live.url, token, lines).returncode == 0

    result = run(["topics", "offsets", "tools", "--json"], live.url, token)
    assert result.returncode == 0, result.stderr.decode()
    rows = json.loads(result.stdout)
    assert [(r["epoch"], r["shard"]) for r in rows] == [(0, 0), (0, 1), (0, 2)]
    assert all(r["low"] == 0 and r["count"] == r["high"] - r["low"] for r in rows)
    assert sum(r["count"] for r in rows) == 30
    human = run(["topics", "offsets", "tools"], live.url, token)
    assert b"30 records in 3 shard(s)" in human.stdout

    # -e: every record there was, then exit 0 on its own (no -n, no --idle-s).
    result = run(["consume", "tools", "-e", "--json", "-q"], live.url, token, timeout_s=60)
    assert result.returncode == 0, result.stderr.decode()
    records = [json.loads(line) for line in result.stdout.decode().splitlines()]
    assert sorted(r["value"] for r in records) == sorted(f"v{i}" for i in range(30))
    assert records[0]["headers"] == [["h", "1"], ["h", "2"], ["x", records[0]["value"][1:]]]

    # --from -N: the last N records of each shard.
    result = run(["consume", "tools", "--from", "-2", "-e", "--json", "-q"], live.url, token)
    assert result.returncode == 0, result.stderr.decode()
    last = [json.loads(line) for line in result.stdout.decode().splitlines()]
    highs = {r["shard"]: r["high"] for r in rows}
    assert sorted((r["shard"], r["offset"]) for r in last) == sorted(
        (shard, offset) for shard, high in highs.items() for offset in range(max(high - 2, 0), high)
    )
    bad = run(["consume", "tools", "--from", "-0", "-q"], live.url, token)
    assert bad.returncode == 2 and b"-N" in bad.stderr


@pytest.mark.parametrize("bad", [b"not json\n", b"[1, 2]\n", b'{"valu": "typo"}\n'])
@needs_kafka
def test_bad_json_lines_fail_with_a_message(live: LiveService, kafka: str, bad: bytes) -> None:
    with live.admin() as admin:
        admin.create_topic(VC, "strict", kafka, 1)
        token = admin.request(
            "POST", "/v1/tokens", json={"name": "strict", "role": "client", "scope": VC}
        )["token"]
    result = run(["produce", "strict", "--json", "-q"], live.url, token, bad)
    assert result.returncode == 1
    assert b"invalid_request" in result.stderr
