"""``xinfra migrate plan|start|advance|rollback|status|run``: move a topic to another cluster.

Each subcommand is one call of the service's migration API (the service runs
the state machine; see ``migration.machine``); ``run`` plans when needed and
advances step by step to ``completed``, showing the state, the target epoch
and the clients that have not acknowledged yet.  A paused step (late clients)
is retried until ``--timeout``; re-running ``run`` resumes an interrupted one.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from migration.machine import FINISHED, State
from xinfra.commands.options import JsonOption, TokenOption, UrlOption, VcOption, vc_name
from xinfra.commands.output import emit, err, out, service_call
from xinfra.errors import MigrationNotFound, Unavailable, XinfraError, error_from_code
from xinfra.names import NAME_PATTERN
from xinfra.rest import MetadataClient

app = typer.Typer(help="Migrate a topic between physical clusters, live.", no_args_is_help=True)
AckOption = Annotated[
    float, typer.Option("--ack-timeout", help="Seconds to wait for clients before pausing.")
]


def _path(vcluster: str | None, topic: str, step: str = "") -> str:
    return f"/v1/vclusters/{vc_name(vcluster)}/topics/{topic}/migration{step}"


def _show(migration: dict[str, Any]) -> None:
    table = Table("topic", "state", "pending", "source", "target", "late clients")
    table.add_row(
        escape(migration["topic"]),
        migration["state"] + (" (paused)" if migration["paused"] else ""),
        str(migration["pending"] or ""),
        f"{migration['source_cluster']} epoch {migration['source_epoch']}",
        f"{migration['target_cluster']} epoch {migration['target_epoch']}",
        escape(", ".join(migration["late_clients"])),
    )
    out.print(table)
    _show_orphans(migration.get("orphaned"))
    for group in migration.get("groups_on_source") or []:
        members = "?" if group["members"] is None else group["members"]
        out.print(
            f"group {escape(group['group'])} ({members} members) still reads the source: "
            f"shards {group['shards']}"
        )


def _show_orphans(orphaned: dict[str, Any] | None) -> None:
    """Records past a sealed Kafka epoch's end offsets: acknowledged, yet no reader delivers them."""
    if orphaned is None:
        return  # a step's answer: only the status checks the clusters
    out.print(f"{orphaned['records']} records orphaned past sealed Kafka epochs")
    for epoch in orphaned["epochs"]:
        if epoch["records"]:
            shards = ", ".join(f"shard {k}: {v}" for k, v in epoch["by_shard"].items())
            out.print(
                f"  epoch {epoch['epoch']} ({escape(epoch['cluster'])} topic "
                f"{escape(epoch['physical_topic'])}): {shards}"
            )
    for error in orphaned["errors"]:
        out.print(f"  [yellow]unknown:[/] {escape(error)}")


def _advance(
    client: MetadataClient, path: str, expected: State | None, ack_timeout_s: float
) -> dict[str, Any]:
    body: dict[str, Any] = {"ack_timeout_s": ack_timeout_s}
    if expected is not None:
        body["expected_state"] = expected.value
    result: dict[str, Any] = client.request(
        "POST", path + "/advance", json=body, timeout_s=ack_timeout_s + 120
    )
    return result


@app.command()
def plan(
    topic: str,
    to: Annotated[str, typer.Option("--to", help="The target physical cluster.")],
    shards: Annotated[int | None, typer.Option(help="Must equal the source's count.")] = None,
    vcluster: VcOption = None,
    url: UrlOption = None,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Plan the migration of TOPIC to cluster --to (nothing changes for clients yet)."""
    with service_call(url, token) as client:
        body = client.request(
            "POST", _path(vcluster, topic), json={"target_cluster": to, "shards": shards}
        )
    emit(body, as_json, _show)


@app.command()
def start(
    topic: str,
    vcluster: VcOption = None,
    url: UrlOption = None,
    token: TokenOption = None,
    ack_timeout: AckOption = 30.0,
    as_json: JsonOption = False,
) -> None:
    """Create the target epoch and start dual writes."""
    with service_call(url, token) as client:
        body = _advance(client, _path(vcluster, topic), State.DUAL_WRITE, ack_timeout)
    emit(body, as_json, _show)


@app.command()
def advance(
    topic: str,
    expect: Annotated[
        State | None, typer.Option(help="Refuse unless this is the state the step leads to.")
    ] = None,
    vcluster: VcOption = None,
    url: UrlOption = None,
    token: TokenOption = None,
    ack_timeout: AckOption = 30.0,
    as_json: JsonOption = False,
) -> None:
    """Perform the next step (or resume the interrupted one)."""
    with service_call(url, token) as client:
        body = _advance(client, _path(vcluster, topic), expect, ack_timeout)
    emit(body, as_json, _show)


@app.command()
def rollback(
    topic: str,
    vcluster: VcOption = None,
    url: UrlOption = None,
    token: TokenOption = None,
    ack_timeout: AckOption = 30.0,
    as_json: JsonOption = False,
) -> None:
    """Back to the source alone (possible until dual writes stop)."""
    with service_call(url, token) as client:
        body = client.request(
            "POST",
            _path(vcluster, topic, "/rollback"),
            json={"ack_timeout_s": ack_timeout},
            timeout_s=ack_timeout + 120,
        )
    emit(body, as_json, _show)


@app.command()
def status(
    topic: str,
    vcluster: VcOption = None,
    url: UrlOption = None,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """The migration's state, pending step, late clients and history."""
    with service_call(url, token) as client:
        body = client.request("GET", _path(vcluster, topic))
    emit(body, as_json, _show)


def read_topics(path: Path) -> list[str]:
    """Topic names, one a line (``#`` comments and blank lines skipped); ``-`` reads stdin.

    Bad input is refused before anything moves: a name that is not a topic
    name, or one named twice.
    """
    text = sys.stdin.read() if str(path) == "-" else path.read_text(encoding="utf-8")
    topics: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        name = line.split("#", 1)[0].strip()
        if not name:
            continue
        if not _NAME.fullmatch(name):
            raise typer.BadParameter(f"line {number}: {name!r} is not a topic name")
        if name in topics:
            raise typer.BadParameter(f"line {number}: {name!r} is named twice")
        topics.append(name)
    if not topics:
        raise typer.BadParameter(f"{path} names no topic")
    return topics


_NAME = re.compile(NAME_PATTERN)


class _Progress:
    """What every topic's migration is doing, for one progress view over all of them."""

    def __init__(self, topics: list[str]) -> None:
        self.topics = topics
        self.lock = threading.Lock()
        self.now: dict[str, str] = {}
        self.results: dict[str, dict[str, Any]] = {}

    def update(self, topic: str, text: str) -> None:
        with self.lock:
            self.now[topic] = text

    def finish(self, topic: str, result: dict[str, Any]) -> None:
        with self.lock:
            self.now.pop(topic, None)
            self.results[topic] = result

    def line(self) -> str:
        with self.lock:
            done = sum(1 for r in self.results.values() if r.get("state") == State.COMPLETED)
            failed = len(self.results) - done
            running = "; ".join(f"{escape(t)}: {escape(s)}" for t, s in list(self.now.items())[:4])
            more = len(self.now) - 4
        return f"{done}/{len(self.topics)} completed, {failed} failed, {len(self.now)} running" + (
            f" ({running}{f', +{more} more' if more > 0 else ''})" if running else ""
        )


def _run_one(
    client: MetadataClient,
    vcluster: str | None,
    topic: str,
    to: str,
    ack_timeout_s: float,
    deadline: float,
    progress: _Progress,
) -> dict[str, Any]:
    """Plan (unless under way) and advance TOPIC to ``completed``; its last answer.

    A paused step is retried until ``deadline``; the answer then carries
    ``timed_out``.  A service error is the answer's ``error`` and ``code``.
    """
    path = _path(vcluster, topic)
    try:
        try:
            current: dict[str, Any] | None = client.request("GET", path)
        except MigrationNotFound:
            current = None
        if current is None or State(current["state"]) in FINISHED:
            current = client.request("POST", path, json={"target_cluster": to})
        assert current is not None
        while State(current["state"]) != State.COMPLETED:
            if time.monotonic() >= deadline:
                return {**current, "timed_out": True}
            late = ", ".join(current["late_clients"])
            progress.update(
                topic,
                str(current["pending"] or current["state"])
                + (f" (waiting for {late})" if late else ""),
            )
            current = _advance(client, path, None, ack_timeout_s)
        return current
    except XinfraError as error:
        return {"topic": topic, "error": error.message, "code": error.code}


@app.command()
def run(
    topic: Annotated[str | None, typer.Argument(help="The topic (or --topics-from).")] = None,
    to: Annotated[str, typer.Option("--to", help="The target physical cluster.")] = "",
    topics_from: Annotated[
        Path | None,
        typer.Option(
            "--topics-from", help="Migrate the topics named in FILE, one a line ('-': stdin)."
        ),
    ] = None,
    parallel: Annotated[
        int, typer.Option("--parallel", min=1, max=64, help="Topics migrated at once.")
    ] = 1,
    vcluster: VcOption = None,
    url: UrlOption = None,
    token: TokenOption = None,
    ack_timeout: AckOption = 30.0,
    timeout: Annotated[
        float, typer.Option(help="Give up (exit 1) after this many seconds.")
    ] = 600.0,
    as_json: JsonOption = False,
) -> None:
    """Plan (unless a migration is under way) and perform every step to ``completed``.

    With ``--topics-from``, every topic of the file, ``--parallel`` at a time,
    under one progress view; the exit status is 1 unless all completed.
    """
    if not to:
        raise typer.BadParameter("--to names the target cluster", param_hint="--to")
    if (topic is None) == (topics_from is None):
        raise typer.BadParameter("name one TOPIC or --topics-from FILE, not both")
    topics = [topic] if topic is not None else read_topics(topics_from)  # type: ignore[arg-type]
    deadline = time.monotonic() + timeout
    progress = _Progress(topics)

    def one(name: str) -> dict[str, Any]:
        with MetadataClient(url, token=token) as client:
            result = _run_one(client, vcluster, name, to, ack_timeout, deadline, progress)
        progress.finish(name, result)
        if not as_json:
            out.print(_outcome(name, result))
        return result

    with out.status(progress.line()) as view:
        with ThreadPoolExecutor(max_workers=min(parallel, len(topics))) as pool:
            futures = [pool.submit(one, name) for name in topics]
            while not all(f.done() for f in futures):
                view.update(progress.line())
                wait(futures, timeout=0.2)
        results = [f.result() for f in futures]
    failed = [r for r in results if r.get("state") != State.COMPLETED]
    if topics_from is None:
        single = results[0]
        if "error" in single:
            err.print(f"[red]{escape(single['error'] + ' [' + single['code'] + ']')}[/red]")
            unreachable = isinstance(error_from_code(single["code"], ""), Unavailable)
            raise typer.Exit(3 if unreachable else 1)
        emit(single, as_json, _show)
    elif as_json:
        emit(
            {"completed": len(results) - len(failed), "failed": len(failed), "migrations": results},
            True,
            _show,
        )
    else:
        out.print(progress.line())
    if failed:
        raise typer.Exit(1)


def _outcome(topic: str, result: dict[str, Any]) -> str:
    if "error" in result:
        text = f"{topic}: {result['error']} [{result['code']}]"
        return f"[red]{escape(text)}[/red]"
    if result.get("timed_out"):
        late = ", ".join(result["late_clients"])
        return (
            f"[yellow]{escape(topic)}: gave up in {escape(str(result['pending'] or result['state']))}"
            + (f", waiting for {escape(late)}[/yellow]" if late else "[/yellow]")
        )
    return f"{escape(topic)}: {escape(result['state'])}"
