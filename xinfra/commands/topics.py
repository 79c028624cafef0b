"""``xinfra topics create|list|describe|delete|seal|add-epoch|reconcile``: virtual topics."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from xinfra.commands.output import emit, out, service_call
from xinfra.model import TopicMetadata
from xinfra.settings import get_settings

app = typer.Typer(help="Virtual topics and their epochs.", no_args_is_help=True)
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON.")]
VcOption = Annotated[
    str | None,
    typer.Option("--vcluster", "-v", help="Virtual cluster (default: XINFRA_VIRTUAL_CLUSTER)."),
]


def _vc(value: str | None) -> str:
    return value or get_settings().virtual_cluster


def _config(pairs: list[str] | None) -> dict[str, str]:
    config = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep:
            raise typer.BadParameter(f"--config {pair!r}: use key=value")
        config[key] = value
    return config


def _offsets(pairs: list[str] | None) -> dict[int, int] | None:
    if not pairs:
        return None
    offsets = {}
    for pair in pairs:
        shard, sep, offset = pair.partition("=")
        if not sep or not shard.isdigit() or not offset.isdigit():
            raise typer.BadParameter(f"--end-offset {pair!r}: use shard=offset")
        offsets[int(shard)] = int(offset)
    return offsets


def _show(metadata: TopicMetadata) -> None:
    topic = metadata.topic
    sealed = " [yellow]sealed[/yellow]" if topic.sealed else ""
    out.print(
        f"[bold]{topic.virtual_cluster}/{topic.name}[/bold] version {metadata.version}{sealed}"
    )
    for key, value in topic.config.items():
        out.print(f"  config {key}={value}")
    table = Table("epoch", "cluster", "physical topic", "shards", "state", "end offsets")
    for epoch in metadata.epochs:
        table.add_row(
            str(epoch.number),
            epoch.cluster,
            epoch.physical_topic,
            str(len(epoch.shards)),
            epoch.state.value,
            ""
            if epoch.end_offsets is None
            else ",".join(f"{k}={v}" for k, v in sorted(epoch.end_offsets.items())),
        )
    out.print(table)


def _emit_metadata(metadata: TopicMetadata, as_json: bool) -> None:
    emit(metadata.model_dump(mode="json"), as_json, lambda _d: _show(metadata))


@app.command()
def create(
    name: str,
    cluster: Annotated[str, typer.Option(help="Physical cluster of epoch 0.")],
    shards: Annotated[int, typer.Option(min=1, help="Number of shards.")] = 1,
    config: Annotated[list[str] | None, typer.Option(help="key=value (repeat).")] = None,
    vcluster: VcOption = None,
    as_json: JsonOption = False,
) -> None:
    """Create a virtual topic with N shards on a physical cluster."""
    with service_call() as client:
        _emit_metadata(
            client.create_topic(_vc(vcluster), name, cluster, shards, _config(config)), as_json
        )


@app.command("list")
def list_(vcluster: VcOption = None, as_json: JsonOption = False) -> None:
    """List the topics of a virtual cluster."""
    with service_call() as client:
        topics = client.list_topics(_vc(vcluster))

    def human(rows: list[dict[str, Any]]) -> None:
        table = Table("name", "version", "state", "sealed")
        for row in rows:
            table.add_row(
                row["name"], str(row["version"]), row["state"], "yes" if row["sealed"] else ""
            )
        out.print(table)

    emit(topics, as_json, human)


@app.command()
def describe(name: str, vcluster: VcOption = None, as_json: JsonOption = False) -> None:
    """Show a topic's metadata: version, epochs, shards, clusters."""
    with service_call() as client:
        _emit_metadata(client.topic_metadata(_vc(vcluster), name), as_json)


@app.command()
def delete(
    name: str,
    expected_version: Annotated[
        int | None, typer.Option(help="Fail unless at this version.")
    ] = None,
    vcluster: VcOption = None,
    as_json: JsonOption = False,
) -> None:
    """Delete a topic and its physical topics."""
    with service_call() as client:
        client.delete_topic(_vc(vcluster), name, expected_version)
    emit({"deleted": name}, as_json, lambda _d: out.print(f"deleted topic {name}"))


@app.command()
def seal(
    name: str,
    end_offset: Annotated[
        list[str] | None,
        typer.Option(help="shard=offset (repeat); default: read from the backend."),
    ] = None,
    expected_version: Annotated[int | None, typer.Option()] = None,
    vcluster: VcOption = None,
    as_json: JsonOption = False,
) -> None:
    """Seal a topic: no more writes; unsealed epochs get their end offsets."""
    with service_call() as client:
        _emit_metadata(
            client.seal_topic(_vc(vcluster), name, _offsets(end_offset), expected_version), as_json
        )


@app.command("add-epoch")
def add_epoch(
    name: str,
    cluster: Annotated[str, typer.Option(help="Physical cluster of the new epoch.")],
    shards: Annotated[int | None, typer.Option(help="Default: as the current epoch.")] = None,
    state: Annotated[str, typer.Option(help="active or dual_write.")] = "active",
    no_seal: Annotated[
        bool, typer.Option("--no-seal", help="Keep the current epoch unsealed.")
    ] = False,
    end_offset: Annotated[
        list[str] | None, typer.Option(help="shard=offset of the sealed epoch (repeat).")
    ] = None,
    mirror_of: Annotated[
        int | None, typer.Option(help="Epoch whose records this one mirrors.")
    ] = None,
    expected_version: Annotated[int | None, typer.Option()] = None,
    vcluster: VcOption = None,
    as_json: JsonOption = False,
) -> None:
    """Seal the current epoch and add a new one on another physical cluster."""
    with service_call() as client:
        _emit_metadata(
            client.add_epoch(
                _vc(vcluster),
                name,
                cluster,
                shards,
                state,
                not no_seal,
                _offsets(end_offset),
                mirror_of,
                expected_version,
            ),
            as_json,
        )


@app.command()
def reconcile(
    grace_s: Annotated[float | None, typer.Option(help="Leave younger intents alone.")] = None,
    delete_orphans: Annotated[
        bool, typer.Option("--delete-orphans", help="Delete unreferenced xinfra.* physical topics.")
    ] = False,
    as_json: JsonOption = False,
) -> None:
    """Finish or undo interrupted operations; report drift from the physical clusters."""
    with service_call() as client:
        report = client.reconcile(grace_s, delete_orphans)

    def human(data: dict[str, Any]) -> None:
        out.print(f"checked {data['checked_topics']} topics")
        for item in data["repaired"]:
            out.print(
                f"[green]repaired[/green] {item['action']} {item.get('virtual_cluster') or item.get('cluster')}/{item.get('topic') or item.get('physical_topic')}"
            )
        for item in data["drift"]:
            out.print(
                f"[yellow]drift[/yellow] {item['action']} {item.get('cluster')}/{item.get('physical_topic')} {item['detail']}"
            )
        for error in data["errors"]:
            out.print(f"[red]error[/red] {error}")

    emit(report, as_json, human)
    if report["errors"]:
        raise typer.Exit(1)
