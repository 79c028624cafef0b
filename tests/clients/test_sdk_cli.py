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
    assert {r["headers"]["h"] for r in records if r["key"] == "j"} == {"v"}

    result = run(
        ["consume", "cli", "--print-key", "--key-separator", "=", "--idle-s", "1", "-q"],
        live.url,
        token,
    )
    assert result.returncode == 0
    assert b"user3=event3\n" in result.stdout and result.stdout.count(b"\n") == 520


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
