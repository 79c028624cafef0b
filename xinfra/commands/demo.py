"""``xinfra demo ...``: short end-to-end runs on the local stack, one subcommand each."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from xinfra.commands.output import emit, err, error_line, exit_code, out
from xinfra.errors import XinfraError
from xinfra.rest import MetadataClient, resolve_token
from xinfra.settings import get_settings

app = typer.Typer(help="End-to-end demos on the local stack.", no_args_is_help=True)


@app.command("spark")
def spark(
    topic: Annotated[
        str | None, typer.Option("--topic", help="Topic to create (default: demo-spark-<random>).")
    ] = None,
    records: Annotated[int, typer.Option("--records", min=2, help="Records in all.")] = 10_000,
    keys: Annotated[int, typer.Option("--keys", min=1, help="Distinct keys.")] = 10,
    shards: Annotated[int, typer.Option("--shards", min=1, help="Shards of the topic.")] = 4,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Count records per key with Spark across a Kafka epoch and a Northguard epoch, beside the SDK."""
    from clients.spark.demo import Stack, default_topic, local_spark, pick_clusters, run_demo

    settings = get_settings()
    stack = Stack(settings.metadata_url, resolve_token(settings), settings.virtual_cluster)
    try:
        with MetadataClient(stack.url, token=stack.token) as admin:
            pick_clusters(admin)  # fails fast, before the JVM starts
        session = local_spark()
        try:
            result = run_demo(session, stack, topic or default_topic(), records, keys, shards)
        finally:
            session.stop()
    except XinfraError as error:
        err.print(f"[red]{escape(error_line(error))}[/red]", soft_wrap=True)
        raise typer.Exit(exit_code(error)) from None
    emit(result, as_json, _show)
    if not result["match"]:
        raise typer.Exit(1)


def _show(result: dict[str, Any]) -> None:
    epochs = ", ".join(
        f"epoch {e['epoch']} on {e['cluster']}: {e['records']} records" for e in result["epochs"]
    )
    out.print(f"[bold]{result['topic']}[/bold]  {epochs}")
    table = Table("key", "Spark", "SDK")
    for row in result["counts"]:
        style = "" if row["spark"] == row["sdk"] else "red"
        table.add_row(row["key"], str(row["spark"]), str(row["sdk"]), style=style)
    table.add_row("total", str(result["spark_total"]), str(result["sdk_total"]), style="bold")
    out.print(table)
    out.print("[green]counts agree[/green]" if result["match"] else "[red]counts differ[/red]")


@app.command("migration")
def migration(
    topic: Annotated[
        str | None,
        typer.Option("--topic", help="Topic to create (default: demo-migration-<random>)."),
    ] = None,
    producers: Annotated[int, typer.Option("--producers", min=1, help="Keyed producers.")] = 2,
    consumers: Annotated[int, typer.Option("--consumers", min=1, help="Group members.")] = 2,
    keys: Annotated[int, typer.Option("--keys", min=1, help="Keys per producer.")] = 16,
    shards: Annotated[int, typer.Option("--shards", min=1, help="Shards of the topic.")] = 4,
    rate: Annotated[
        float, typer.Option("--rate", min=1, help="Records per second per producer.")
    ] = 500.0,
    phase_s: Annotated[
        float,
        typer.Option("--phase-s", min=0, help="Seconds of load before, between and after steps."),
    ] = 2.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Migrate a loaded Kafka topic to Northguard, then check every acknowledged record."""
    import asyncio
    import dataclasses

    from migration.demo import DemoConfig, run_demo

    settings = get_settings()
    config = DemoConfig(
        producers=producers,
        consumers=consumers,
        keys=keys,
        shards=shards,
        rate=rate,
        phase_s=phase_s,
    )
    if topic is not None:
        config = dataclasses.replace(config, topic=topic)
    try:
        result = asyncio.run(
            run_demo(
                settings.metadata_url, resolve_token(settings), settings.virtual_cluster, config
            )
        )
    except XinfraError as error:
        err.print(f"[red]{escape(error_line(error))}[/red]", soft_wrap=True)
        raise typer.Exit(exit_code(error)) from None
    emit(result, as_json, _show_migration)
    if not result["ok"]:
        raise typer.Exit(1)


def _show_migration(result: dict[str, Any]) -> None:
    steps = " -> ".join(
        f"{s['state']} ({s['took_s']:.1f} s)"
        + (" paused: " + ", ".join(s["late_clients"]) if s["paused"] else "")
        for s in result["steps"]
    )
    out.print(
        f"[bold]{escape(result['topic'])}[/bold]  {escape(result['source_cluster'])} -> "
        f"{escape(result['target_cluster'])}: {escape(steps)}"
    )
    table = Table("records", "group", "read from the beginning")
    through = result["read_through"]
    table.add_row("produced", str(result["produced"]), "")
    table.add_row("acknowledged", str(result["acknowledged"]), "")
    table.add_row("failed", str(result["failed"]), "", style="red" if result["failed"] else "")
    table.add_row("consumed", str(result["consumed"]), str(through["consumed"]))
    for key, label in (
        ("lost", "lost"),
        ("read_twice", "read twice"),
        ("order_violations", "per-key order violations"),
    ):
        bad = result[key] or through[key]
        table.add_row(label, str(result[key]), str(through[key]), style="red" if bad else "")
    out.print(table)
    out.print(
        f"longest producer stall {result['longest_stall_ms']:.1f} ms "
        f"(produce p99 {result['produce_p99_ms']:.1f} ms)"
    )
    out.print(
        "[green]nothing lost, nothing read twice, per-key order kept[/green]"
        if result["ok"]
        else "[red]verification failed[/red]"
    )
