"""``xinfra migrate`` as a user runs it: a subprocess against the live service."""

from __future__ import annotations

import json
from pathlib import Path

from sdk_live import ADMIN_TOKEN, VC, LiveService, needs_kafka, needs_northguard
from test_sdk_cli import run  # the subprocess runner of the SDK CLI tests

pytestmark = [needs_kafka, needs_northguard]


def test_plan_run_status_and_a_refused_rollback(
    live: LiveService, kafka: str, northguard: str
) -> None:
    with live.admin() as admin:
        admin.create_topic(VC, "cli-moving", kafka, 2)

    same = run(["migrate", "plan", "cli-moving", "--to", kafka], live.url, ADMIN_TOKEN)
    assert same.returncode == 1 and b"migration_same_cluster" in same.stderr

    planned = run(
        ["migrate", "plan", "cli-moving", "--to", northguard, "--json"], live.url, ADMIN_TOKEN
    )
    assert planned.returncode == 0, planned.stderr
    assert json.loads(planned.stdout)["state"] == "planned"

    done = run(
        ["migrate", "run", "cli-moving", "--to", northguard, "--json"], live.url, ADMIN_TOKEN
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["state"] == "completed"

    status = run(["migrate", "status", "cli-moving", "--json"], live.url, ADMIN_TOKEN)
    events = [h["event"] for h in json.loads(status.stdout)["history"]]
    assert events == ["planned", "dual_write", "cut_over", "completed"]

    late = run(["migrate", "rollback", "cli-moving"], live.url, ADMIN_TOKEN)
    assert late.returncode == 1 and b"migration_step_out_of_order" in late.stderr

    with live.admin() as admin:
        metadata = admin.topic_metadata(VC, "cli-moving")
    assert [(e.cluster, e.state.value) for e in metadata.epochs] == [
        (kafka, "sealed"),
        (northguard, "active"),
    ]


def test_run_many_topics_from_a_file_in_parallel(
    live: LiveService, kafka: str, northguard: str, tmp_path: Path
) -> None:
    names = [f"many-{i}" for i in range(6)]
    with live.admin() as admin:
        for name in names:
            admin.create_topic(VC, name, kafka, 1)
    listing = tmp_path / "topics.txt"
    listing.write_text("# the topics to move\n" + "\n".join(names) + "\n\n")

    args = ["migrate", "run", "--topics-from", str(listing), "--to", northguard, "--parallel", "3"]
    done = run([*args, "--json"], live.url, ADMIN_TOKEN)
    assert done.returncode == 0, done.stderr
    body = json.loads(done.stdout)
    assert (body["completed"], body["failed"]) == (6, 0)
    assert sorted(m["topic"] for m in body["migrations"]) == names
    assert {m["state"] for m in body["migrations"]} == {"completed"}

    # Run again: each is completed, so each is planned anew (northguard is now its cluster).
    again = run(args, live.url, ADMIN_TOKEN)
    assert again.returncode == 1
    assert again.stdout.decode().count("migration_same_cluster") == 6


def test_run_refuses_bad_input_before_anything_moves(
    live: LiveService, kafka: str, northguard: str, tmp_path: Path
) -> None:
    twice = tmp_path / "twice.txt"
    twice.write_text("a\nb\na\n")
    bad = tmp_path / "bad.txt"
    bad.write_text("ok\nnot a name!\n")
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing\n")
    to = ["--to", northguard]
    for args, message in (
        (["--topics-from", str(twice), *to], b"named twice"),
        (["--topics-from", str(bad), *to], b"is not a topic name"),
        (["--topics-from", str(empty), *to], b"names no topic"),
        (["t", "--topics-from", str(twice), *to], b"not both"),
        (["t"], b"--to"),
        (["t", *to, "--parallel", "0"], b"--parallel"),
    ):
        result = run(["migrate", "run", *args], live.url, ADMIN_TOKEN)
        assert result.returncode == 2, (args, result.stderr)
        assert message in result.stderr, (args, result.stderr)
