"""The README's "A first tour" runs verbatim, in a fresh shell outside the repository.

The tour's bash block is read from README.md, only its documented placeholder (the path of
``.venv/bin/xinfra``) is replaced, and the block runs under ``bash -e -o pipefail`` in an empty
directory with a minimal environment (a private HOME and XDG_CONFIG_HOME, a short PATH, no
``XINFRA_*``), while a real ``xinfra up`` (the whole stack, started as test_up.py starts it)
runs with the same HOME and XDG_CONFIG_HOME, so the tour finds the stack through the user
config alone.  Before each line the wrapper prints a marker to stdout and stderr, nothing
else is added, and each command's output is checked against what the tour's comments
promise.  The tour's last line stops the stack: the supervisor and every child must be gone.
"""

from __future__ import annotations

import json
import re
import subprocess
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_up import _env, _listeners, up_in_pipe

from xinfra.services.ports import port_open

REPO = Path(__file__).resolve().parents[2]
XINFRA = REPO / ".venv" / "bin" / "xinfra"
PLACEHOLDER = "/path/to/checkout/.venv/bin/xinfra"
HEADING = "## A first tour"
RECORDS = [("alice", "hello"), ("bob", "world"), ("alice", "again")]  # what the tour produces
DEFAULT_PORTS = {  # xinfra/settings.py: what a tour that names an address would talk to
    "XINFRA_ZOOKEEPER": [2181],
    "XINFRA_KAFKA_BOOTSTRAP": [9092],
    "XINFRA_NORTHGUARD_BOOTSTRAP": [9470, 9472, 9474],
    "XINFRA_NORTHGUARD_HTTP_PORTS": [9471, 9473, 9475],
    "XINFRA_METADATA_URL": [8780],
}


def tour_block(readme: str) -> list[str]:
    """The lines of the first fenced ``bash`` block after the tour's heading."""
    lines = readme.splitlines()
    assert lines.count(HEADING) == 1, f"README.md has no single {HEADING!r} heading"
    start = lines.index(HEADING)
    following = lines[start + 1 :]
    fence = next(i for i, line in enumerate(following) if line.startswith("```"))
    assert following[fence] == "```bash", f"the tour's first block is {following[fence]!r}"
    assert not any(line.startswith("## ") for line in following[:fence]), "block after heading"
    end = following.index("```", fence + 1)
    block = [line for line in following[fence + 1 : end] if line.strip()]
    assert block, "the tour's bash block is empty"
    for line in block:
        assert not line.rstrip().endswith("\\"), f"one command per line, not {line!r}"
    return block


def substituted(block: list[str]) -> list[str]:
    """The block with only the documented placeholder replaced by this checkout's xinfra."""
    assert block[0].startswith(f"X={PLACEHOLDER} "), block[0]
    assert sum(PLACEHOLDER in line for line in block) == 1, "the placeholder appears once"
    return [line.replace(PLACEHOLDER, str(XINFRA)) for line in block]


@dataclass
class Step:
    line: str  # the README's line, verbatim (comment included)
    stdout: str
    stderr: str

    @property
    def command(self) -> str:
        return self.line.split("  #", 1)[0].strip()


def wrapped(lines: list[str], marker: str) -> str:
    """The script bash runs: each line verbatim, a numbered marker on both streams before it."""
    script = []
    for number, line in enumerate(lines):
        tag = f"{marker} {number}"
        script.append(f"printf '\\n%s\\n' '{tag}'; printf '\\n%s\\n' '{tag}' >&2")
        script.append(line)
    script.append(f"printf '\\n%s\\n' '{marker} end'; printf '\\n%s\\n' '{marker} end' >&2")
    return "\n".join(script) + "\n"


def split(output: str, marker: str) -> tuple[dict[int, str], bool]:
    """Each numbered section of ``output``, and whether the end marker was reached."""
    parts = re.split(rf"^{re.escape(marker)} (\d+|end)$", output, flags=re.MULTILINE)
    sections = {
        int(n): text.strip("\n")
        for n, text in zip(parts[1::2], parts[2::2], strict=True)
        if n != "end"
    }
    return sections, "end" in parts[1::2]


def records(text: str) -> list[tuple[str, str]]:
    """``key<TAB>value`` lines (``consume --print-key``)."""
    rows = [line.split("\t") for line in text.splitlines() if line]
    assert all(len(row) == 2 for row in rows), text
    return [(key, value) for key, value in rows]


def assert_the_three_records_in_key_order(consumed: list[tuple[str, str]]) -> None:
    assert Counter(consumed) == Counter(RECORDS), consumed  # each once, nothing else
    for key in {key for key, _ in RECORDS}:
        assert [v for k, v in consumed if k == key] == [v for k, v in RECORDS if k == key], (
            f"per-key order of {key!r}: {consumed}"
        )


def table_rows(text: str) -> list[list[str]]:
    """The body rows of a rich table (``│``-separated)."""
    return [
        [cell.strip() for cell in line.strip().strip("│").split("│")]
        for line in text.splitlines()
        if line.lstrip().startswith("│")
    ]


def stack_env(tmp_path: Path, tour: str, home: Path) -> dict[str, str]:
    """``xinfra up``'s environment: free ports, unless the tour names an address (then the
    defaults, which must be free); HOME and XDG_CONFIG_HOME private either way."""
    env = {**_env(tmp_path), "HOME": str(home)}
    if not re.search(r"127\.0\.0\.1|localhost|:\d{4,5}\b", tour):
        return env
    for name, ports in DEFAULT_PORTS.items():
        for port in ports:
            if port_open("127.0.0.1", port):
                pytest.skip(
                    f"the tour names an address, so the stack needs the default ports, and "
                    f"127.0.0.1:{port} ({name}) is taken: {_listeners(port) or 'holder unknown'}"
                )
        host = "http://127.0.0.1" if name.endswith("_URL") else "127.0.0.1"
        env[name] = ",".join(str(p) if name.endswith("_PORTS") else f"{host}:{p}" for p in ports)
    return env


def test_readme_tour_runs_verbatim_outside_the_repository(tmp_path: Path) -> None:
    assert XINFRA.is_file(), f"{XINFRA} is missing: bash scripts/setup.sh makes it"
    block = tour_block((REPO / "README.md").read_text())
    lines = substituted(block)
    home = tmp_path / "home"
    home.mkdir()
    workdir = tmp_path / "fresh-shell"
    workdir.mkdir()
    assert not workdir.resolve().is_relative_to(REPO)
    env = stack_env(tmp_path, "\n".join(lines), home)
    shell = {  # a fresh login-less shell: nothing from this process, no XINFRA_*
        "HOME": str(home),
        "XDG_CONFIG_HOME": env["XDG_CONFIG_HOME"],
        "PATH": "/usr/bin:/bin",
    }
    marker = f"@@tour-{uuid.uuid4().hex}"

    with up_in_pipe(tmp_path, env=env) as (stack, process):
        ready = stack.wait_ready()
        components = {c["name"]: c for c in ready["components"]}
        assert {"zookeeper", "kafka", "metadata-service"} <= components.keys()
        assert {"northguard-0", "northguard-1", "northguard-2"} <= components.keys()
        pids = stack.pids()

        tour = subprocess.run(
            ["bash", "-e", "-o", "pipefail", "-c", wrapped(lines, marker)],
            env=shell,
            cwd=workdir,
            capture_output=True,
            text=True,
            timeout=240,
        )
        out, out_done = split(tour.stdout, marker)
        err, _ = split(tour.stderr, marker)
        steps = [Step(block[n], out.get(n, ""), err.get(n, "")) for n in range(len(block))]
        if tour.returncode != 0 or not out_done:
            failed = max(out, default=0)
            raise AssertionError(
                f"the tour stopped (exit {tour.returncode}) at line {failed + 1}: "
                f"{block[failed]!r}\nstdout:\n{out.get(failed, '')}\nstderr:\n{err.get(failed, '')}"
                f"\nwhole stderr:\n{tour.stderr[-4000:]}"
            )
        # The last line stopped the stack: the supervisor exits 0 and leaves nothing.
        assert process.wait(timeout=60) == 0
        assert json.loads(stack.wait_for('"event"'))["event"] == "stopped"
    stack.assert_nothing_left(pids)
    assert not (stack.run_dir / "stack.json").exists()

    def one(command: str) -> Step:
        [step] = where(command)
        return step

    def where(command: str) -> list[Step]:
        found = [step for step in steps if step.command == command]
        assert found, f"the tour no longer runs {command!r}: update this test with it"
        return found

    # status: what runs, pids, health, found from here through the user config alone
    status = one("$X status").stdout
    header = f"stack of {stack.run_dir} (supervisor pid {process.pid})"
    assert header in " ".join(status.split()), status
    for name, component in components.items():
        [row] = [line.split() for line in status.splitlines() if line.split()[:1] == [name]]
        assert f"{component['pid']}" in row and "healthy" in row, (name, status)

    listed = {row[0] for row in table_rows(one("$X clusters list").stdout)}
    assert {"kafka-local", "northguard-local"} <= listed, listed

    created = one("$X topics create orders --cluster kafka-local --shards 4").stdout
    assert "default/orders" in created
    assert table_rows(created)[0][1:2] == ["kafka-local"] and table_rows(created)[0][3] == "4"

    produced = one(
        "printf 'alice:hello\\nbob:world\\nalice:again\\n' | $X produce orders --key-separator :"
    )
    assert "3 records acknowledged, 0 failed" in produced.stdout + produced.stderr

    # consume -e: every record once, per-key order, and it exits at the end (bash went on)
    first, second = where("$X consume orders -e --print-key")
    assert_the_three_records_in_key_order(records(first.stdout))

    positioned = [
        json.loads(line) for line in one("$X consume orders -e --json").stdout.splitlines()
    ]
    assert_the_three_records_in_key_order([(r["key"], r["value"]) for r in positioned])
    assert {r["epoch"] for r in positioned} == {0}
    positions = {(r["shard"], r["offset"]) for r in positioned}
    assert len(positions) == 3
    for key in ("alice", "bob"):
        assert len({r["shard"] for r in positioned if r["key"] == key}) == 1, positioned

    formatted = one("$X consume orders -e --format '%s:%o %k=%v\\n'").stdout.splitlines()
    expected = [f"{r['shard']}:{r['offset']} {r['key']}={r['value']}" for r in positioned]
    # The same records; shards interleave in any order from one read to the next.
    assert sorted(formatted) == sorted(expected), formatted
    for shard in {r["shard"] for r in positioned}:
        assert [line for line in formatted if line.startswith(f"{shard}:")] == [
            line for line in expected if line.startswith(f"{shard}:")
        ], formatted

    # topics offsets: per epoch and shard low, high, count; the counts sum to the three records
    offsets = one("$X topics offsets orders").stdout
    rows = table_rows(offsets)
    assert [(row[0], row[1]) for row in rows] == [("0", str(shard)) for shard in range(4)], rows
    counts = {int(row[1]): int(row[6]) for row in rows}
    assert all(int(row[5]) - int(row[4]) == int(row[6]) for row in rows), rows
    assert sum(counts.values()) == 3, rows
    assert counts == {shard: sum(r["shard"] == shard for r in positioned) for shard in range(4)}
    assert "3 records in 4 shard(s) of 1 epoch(s)" in offsets

    migrated = one("$X migrate run orders --to northguard-local").stdout
    assert "orders: completed" in migrated, migrated

    # the same three records, once, read through both epochs
    assert_the_three_records_in_key_order(records(second.stdout))

    down = one("$X down")
    said = " ".join((down.stdout + down.stderr).split())  # rich wraps long paths
    assert f"stopped the stack of {stack.run_dir}" in said, said
