"""``xinfra produce`` and ``xinfra consume`` as a user runs them: subprocesses, stdin and stdout."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from sdk_live import VC, LiveService, needs_kafka

from xinfra.rest import MetadataClient
from xinfra.services.ports import free_port
from xinfra.services.process import ManagedProcess

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
    result = run(["produce", "cli", "--input", "json", "--json", "-q"], live.url, token, json_lines)
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
    assert (
        run(["produce", "tools", "--input", "json", "-q"], live.url, token, lines).returncode == 0
    )

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
    result = run(["produce", "strict", "--input", "json", "-q"], live.url, token, bad)
    assert result.returncode == 1
    assert b"invalid_request" in result.stderr


def _client_token(live: LiveService, name: str) -> str:
    """A client token of the virtual cluster ``VC``, made through the real service."""
    with live.admin() as admin:
        token: str = admin.request(
            "POST", "/v1/tokens", json={"name": name, "role": "client", "scope": VC}
        )["token"]
    return token


def _json_lines(stdout: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stdout.decode().splitlines()]


@needs_kafka
def test_consume_format_string_like_kcat(live: LiveService, kafka: str) -> None:
    """``--format``: %t %s %o %e %k %v %h %T, \\n and \\t escapes, %% a percent; no newline added."""
    with live.admin() as admin:
        admin.create_topic(VC, "fmt", kafka, 1)
    token = _client_token(live, "fmt")
    lines = b"".join(
        json.dumps({"key": f"k{i}", "value": f"v{i}", "headers": [["h", "1"], ["h", "2"]]}).encode()
        + b"\n"
        for i in range(3)
    )
    result = run(["produce", "fmt", "--input", "json", "-q"], live.url, token, lines)
    assert result.returncode == 0, result.stderr.decode()

    fmt = r"%t|%s|%o|%e|%k|%v|%h|100%%\t%T\n"
    result = run(["consume", "fmt", "-e", "-q", "--format", fmt], live.url, token)
    assert result.returncode == 0, result.stderr.decode()
    rows = result.stdout.decode().split("\n")
    assert rows[-1] == "" and len(rows) == 4, rows
    for i, row in enumerate(rows[:3]):
        fields, timestamp = row.split("\t")
        assert fields == f"fmt|0|{i}|0|k{i}|v{i}|h=1,h=2|100%"
        assert int(timestamp) > 1_600_000_000_000

    no_newline = run(["consume", "fmt", "-e", "-q", "--format", "%v,"], live.url, token)
    assert no_newline.stdout == b"v0,v1,v2,"

    for bad in (
        ["--format", "%Z"],
        ["--format", "%v", "--json"],
        ["--format", "%v", "--print-key"],
    ):
        refused = run(["consume", "fmt", "-e", "-q", *bad], live.url, token)
        assert refused.returncode == 2, refused.stderr.decode()


@needs_kafka
def test_binary_keys_values_and_repeated_headers_round_trip_in_base64(
    live: LiveService, kafka: str
) -> None:
    """``produce --input json --base64`` then ``consume --json --base64``: the same bytes back."""
    with live.admin() as admin:
        admin.create_topic(VC, "binary", kafka, 2)
    token = _client_token(live, "binary")
    sent = [
        (
            os.urandom(8) + b"\xff\x00\n",
            os.urandom(64) + b"\xfe\r\n\x00",
            [("h", b"\x00\xff"), ("h", b"\n\x80"), ("x", os.urandom(5))],
        )
        for _ in range(20)
    ]
    lines = b"".join(
        json.dumps(
            {
                "key": base64.b64encode(key).decode(),
                "value": base64.b64encode(value).decode(),
                "headers": [[n, base64.b64encode(v).decode()] for n, v in headers],
            }
        ).encode()
        + b"\n"
        for key, value, headers in sent
    )
    result = run(["produce", "binary", "--input", "json", "--base64", "-q"], live.url, token, lines)
    assert result.returncode == 0, result.stderr.decode()

    result = run(["consume", "binary", "-e", "--json", "--base64", "-q"], live.url, token)
    assert result.returncode == 0, result.stderr.decode()
    got = [
        (
            base64.b64decode(r["key"]),
            base64.b64decode(r["value"]),
            [(n, base64.b64decode(v)) for n, v in r["headers"]],
        )
        for r in _json_lines(result.stdout)
    ]
    assert sorted(got) == sorted(sent)

    result = run(
        ["consume", "binary", "-e", "--base64", "-q", "--format", r"%k %v %h\n"], live.url, token
    )
    assert result.returncode == 0, result.stderr.decode()
    formatted = set()
    for row in result.stdout.decode().splitlines():
        key, value, headers = row.split(" ")
        pairs = [pair.split("=", 1) for pair in headers.split(",")]
        formatted.add(
            (
                base64.b64decode(key),
                base64.b64decode(value),
                tuple((n, base64.b64decode(v)) for n, v in pairs),
            )
        )
    assert formatted == {(k, v, tuple(h)) for k, v, h in sent}

    # Lines with --base64: each line is the base64 of the value (and of the key, with a separator).
    blob = os.urandom(32) + b"\n\x00"
    line = base64.b64encode(b"\x01key") + b":" + base64.b64encode(blob) + b"\n"
    result = run(
        ["produce", "binary", "--base64", "--key-separator", ":", "-q"], live.url, token, line
    )
    assert result.returncode == 0, result.stderr.decode()
    result = run(["consume", "binary", "-e", "--json", "--base64", "-q"], live.url, token)
    last = [r for r in _json_lines(result.stdout) if base64.b64decode(r["key"]) == b"\x01key"]
    assert [base64.b64decode(r["value"]) for r in last] == [blob]

    bad = run(
        ["produce", "binary", "--input", "json", "--base64", "-q"],
        live.url,
        token,
        b'{"value": "***"}\n',
    )
    assert bad.returncode == 1 and b"invalid_request" in bad.stderr, bad.stderr


@needs_kafka
def test_produce_json_means_output_and_json_values_stay_json(live: LiveService, kafka: str) -> None:
    """``--json`` is the summary on stdout, never the input format; JSON values are stored as JSON."""
    with live.admin() as admin:
        admin.create_topic(VC, "jsonish", kafka, 1)
    token = _client_token(live, "jsonish")

    # Lines in (the default), a JSON summary out: the line is the value, verbatim.
    result = run(["produce", "jsonish", "--json", "-q"], live.url, token, b'{"value": "raw"}\n')
    assert result.returncode == 0, result.stderr.decode()
    summary = json.loads(result.stdout.decode().strip().splitlines()[-1])
    assert summary["acknowledged"] == 1 and summary["failed"] == 0
    assert summary["input"] == "lines"

    objects = [
        {"value": {"a": 1, "b": [True, None]}, "key": {"id": 7}, "headers": [["h", {"x": 1}]]},
        {"value": 5, "key": "plain"},
        {"value": None, "key": "tombstone"},
    ]
    payload = b"".join(json.dumps(o).encode() + b"\n" for o in objects)
    result = run(["produce", "jsonish", "--input", "json", "-q"], live.url, token, payload)
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout == b""  # without --json, nothing on stdout

    result = run(["consume", "jsonish", "-e", "--json", "-q"], live.url, token)
    records = _json_lines(result.stdout)
    assert records[0]["value"] == '{"value": "raw"}'
    assert json.loads(records[1]["value"]) == {"a": 1, "b": [True, None]}
    assert json.loads(records[1]["key"]) == {"id": 7}
    assert json.loads(records[1]["headers"][0][1]) == {"x": 1}
    assert "'" not in records[1]["value"]  # JSON text, never a Python repr
    assert records[2]["value"] == "5" and records[2]["key"] == "plain"
    assert records[3]["value"] is None


def run_with_flags(
    args: list[str], tmp_path: Path, stdin: bytes = b"", timeout_s: float = 90
) -> subprocess.CompletedProcess[bytes]:
    """``xinfra`` whose settings all point elsewhere: only its --url/--token/--vc flags can work."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("XINFRA_")}
    env |= {
        "XINFRA_METADATA_URL": f"http://127.0.0.1:{free_port()}",
        "XINFRA_TOKEN": "not-the-token",
        "XINFRA_VIRTUAL_CLUSTER": "not-the-vcluster",
        "XINFRA_RUN_DIR": str(tmp_path / "no-run-dir"),
        "XDG_CONFIG_HOME": str(tmp_path / "no-config"),
    }
    return subprocess.run(
        [XINFRA, *args], input=stdin, capture_output=True, env=env, timeout=timeout_s, check=False
    )


@needs_kafka
def test_url_token_and_vc_flags_on_every_service_command(
    live: LiveService, kafka: str, tmp_path: Path
) -> None:
    """Every command that talks to the service takes --url, --token and (where a virtual
    cluster applies) --vc, and they override the settings."""
    from sdk_live import ADMIN_TOKEN

    with live.admin() as admin:
        admin.request("POST", "/v1/vclusters", json={"name": "other"})
    service = ["--url", live.url, "--token", ADMIN_TOKEN]
    scoped = [*service, "--vc", "other"]

    def ok(*args: str, stdin: bytes = b"") -> Any:
        result = run_with_flags([*args, "--json"], tmp_path, stdin)
        assert result.returncode == 0, (args, result.stderr.decode())
        return json.loads(result.stdout.decode().strip().splitlines()[-1])

    # Without the flags the settings (a dead URL) are used: exit 3.
    assert run_with_flags(["topics", "list"], tmp_path).returncode == 3

    assert [c["name"] for c in ok("clusters", "list", *service)] == ["kafka"]
    assert ok("clusters", "describe", "kafka", *service)["kind"] == "kafka"
    assert ok("topics", "create", "flagged", "--cluster", kafka, *scoped)["version"] == 1
    assert [t["name"] for t in ok("topics", "list", *scoped)] == ["flagged"]
    assert ok("topics", "list", *service, "--vc", VC) == []
    assert ok("topics", "describe", "flagged", *scoped)["topic"]["virtual_cluster"] == "other"
    assert ok("produce", "flagged", "-q", *scoped, stdin=b"a\nb\n")["acknowledged"] == 2
    offsets = ok("topics", "offsets", "flagged", *scoped)
    assert sum(row["count"] for row in offsets) == 2
    consumed = run_with_flags(["consume", "flagged", "-e", "-q", *scoped], tmp_path)
    assert consumed.returncode == 0 and consumed.stdout == b"a\nb\n", consumed.stderr
    assert ok("groups", "list", *scoped) == []
    assert ok("topics", "reconcile", *service)["errors"] == []
    assert ok("topics", "seal", "flagged", *scoped)["topic"]["sealed"]
    assert ok("topics", "delete", "flagged", *scoped) == {"deleted": "flagged"}

    # A wrong --token is refused even though the URL is right: exit 1, unauthenticated.
    refused = run_with_flags(["topics", "list", "--url", live.url, "--token", "nope"], tmp_path)
    assert refused.returncode == 1 and b"unauthenticated" in refused.stderr


def test_unreachable_physical_cluster_exits_4(live: LiveService, tmp_path: Path) -> None:
    """A physical cluster that does not answer is exit 4, apart from the service's 3."""
    from sdk_live import ADMIN_TOKEN

    dead = f"127.0.0.1:{free_port()}"
    result = run_with_flags(
        [
            "clusters", "register", "dead", "--kind", "kafka", "--bootstrap", dead,
            "--url", live.url, "--token", ADMIN_TOKEN,
        ],
        tmp_path,
    )  # fmt: skip
    assert result.returncode == 4, result.stderr.decode()
    assert b"backend_unavailable" in result.stderr and b"physical cluster" in result.stderr


def test_vclusters_tokens_and_clients_commands(live: LiveService, tmp_path: Path) -> None:
    """``vclusters list|create``, ``tokens list|create|revoke``, ``clients list`` over /v1."""
    from sdk_live import ADMIN_TOKEN

    admin = ["--url", live.url, "--token", ADMIN_TOKEN]

    def ok(*args: str) -> Any:
        result = run_with_flags([*args, "--json"], tmp_path)
        assert result.returncode == 0, (args, result.stderr.decode())
        return json.loads(result.stdout.decode().strip().splitlines()[-1])

    created = ok("vclusters", "create", "team", "--description", "the team's topics", *admin)
    assert created["name"] == "team" and created["description"] == "the team's topics"
    assert "team" in [v["name"] for v in ok("vclusters", "list", *admin)]
    human = run_with_flags(["vclusters", "list", *admin], tmp_path)
    assert human.returncode == 0 and b"team" in human.stdout

    token = ok("tokens", "create", "app", "--role", "client", "--scope", "team", *admin)
    assert token["name"] == "app" and token["scope"] == "team" and token["token"]
    listed = {t["name"]: t for t in ok("tokens", "list", *admin)}
    assert listed["app"]["role"] == "client" and "token" not in listed["app"]
    app = ["--url", live.url, "--token", token["token"]]
    assert ok("topics", "list", *app, "--vc", "team") == []
    forbidden = run_with_flags(["topics", "list", *app, "--vc", VC], tmp_path)
    assert forbidden.returncode == 1 and b"forbidden" in forbidden.stderr
    # The scoped token sees only its virtual cluster.
    assert [v["name"] for v in ok("vclusters", "list", *app)] == ["team"]

    assert ok("clients", "list", *app, "--vc", "team") == []
    with MetadataClient(live.url, token=token["token"]) as client:
        client.register_client("team", "cli-probe", "consumer", ["orders"], host="here")
    clients = ok("clients", "list", *app, "--vc", "team")
    assert [(c["client_id"], c["kind"], c["topics"]) for c in clients] == [
        ("cli-probe", "consumer", ["orders"])
    ]
    assert ok("clients", "list", *app, "--vc", "team", "--topic", "other") == []
    human = run_with_flags(["clients", "list", *app, "--vc", "team"], tmp_path)
    assert human.returncode == 0 and b"cli-probe" in human.stdout

    assert ok("tokens", "revoke", "app", *admin) == {"revoked": "app"}
    assert "app" not in [t["name"] for t in ok("tokens", "list", *admin)]
    revoked = run_with_flags(["topics", "list", *app, "--vc", "team"], tmp_path)
    assert revoked.returncode == 1 and b"unauthenticated" in revoked.stderr

    bad_role = run_with_flags(["tokens", "create", "x", "--role", "root", *admin], tmp_path)
    assert bad_role.returncode == 2, bad_role.stderr.decode()
    # Only an admin of all manages tokens: the service's 403 is exit 1.
    denied = run_with_flags(["tokens", "list", *app], tmp_path)
    assert denied.returncode == 1


@needs_kafka
def test_topics_alter_merges_config_optimistically(
    live: LiveService, kafka: str, tmp_path: Path
) -> None:
    """``topics alter NAME --config k=v --delete-config k``: a read-merge-write at one version."""
    from sdk_live import ADMIN_TOKEN

    admin = ["--url", live.url, "--token", ADMIN_TOKEN, "--vc", VC]

    def alter(*args: str) -> subprocess.CompletedProcess[bytes]:
        return run_with_flags(["topics", "alter", "conf", *args, *admin, "--json"], tmp_path)

    with live.admin() as client:
        client.create_topic(VC, "conf", kafka, 1, {"a": "b", "keep": "1"})
    result = alter("--config", "a=z", "--config", "c=d")
    assert result.returncode == 0, result.stderr.decode()
    altered = json.loads(result.stdout)
    assert altered["topic"]["config"] == {"a": "z", "c": "d", "keep": "1"}
    assert altered["version"] == 2
    result = alter("--delete-config", "a", "--expected-version", "2")
    assert result.returncode == 0, result.stderr.decode()
    assert json.loads(result.stdout)["topic"]["config"] == {"c": "d", "keep": "1"}

    stale = alter("--config", "x=y", "--expected-version", "1")
    assert stale.returncode == 1 and b"version_conflict" in stale.stderr
    assert alter().returncode == 2  # nothing to change is a usage error
    assert alter("--config", "novalue").returncode == 2
    missing = run_with_flags(["topics", "alter", "nope", "--config", "a=b", *admin], tmp_path)
    assert missing.returncode == 1 and b"topic_not_found" in missing.stderr


def test_offsets_of_a_stopped_cluster_exit_4(
    live: LiveService, doomed_kafka: tuple[str, ManagedProcess], tmp_path: Path
) -> None:
    """The CLI's own backend call (not the service's) to a cluster that went away: exit 4."""
    from sdk_live import ADMIN_TOKEN

    cluster, process = doomed_kafka
    with live.admin() as admin:
        admin.create_topic(VC, "gone", cluster, 1)
    process.stop()
    result = run_with_flags(
        ["topics", "offsets", "gone", "--url", live.url, "--token", ADMIN_TOKEN, "--vc", VC],
        tmp_path,
        timeout_s=120,
    )
    assert result.returncode == 4, result.stderr.decode()
    assert b"backend_unavailable" in result.stderr or b"backend_timeout" in result.stderr
