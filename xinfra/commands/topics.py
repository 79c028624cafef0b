"""``xinfra topics create|list|describe|alter|delete|seal|add-epoch|reconcile|offsets``: virtual topics."""

from __future__ import annotations

import enum
from typing import Annotated, Any

import typer
from rich.table import Table

from xinfra.commands.options import JsonOption, TokenOption, UrlOption, VcOption, vc_name
from xinfra.commands.output import emit, err, out, service_call
from xinfra.errors import XinfraError
from xinfra.model import EpochState, PhysicalCluster, TopicMetadata
from xinfra.rest import MetadataClient

app = typer.Typer(help="Virtual topics and their epochs.", no_args_is_help=True)


class NewEpochState(enum.StrEnum):
    """The states an added epoch may start in (``EpochState`` without ``sealed``)."""

    ACTIVE = EpochState.ACTIVE.value
    DUAL_WRITE = EpochState.DUAL_WRITE.value


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
    vc: VcOption = None,
    url: UrlOption = None,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Create a virtual topic with N shards on a physical cluster."""
    with service_call(url, token) as client:
        _emit_metadata(
            client.create_topic(vc_name(vc), name, cluster, shards, _config(config)), as_json
        )


@app.command("list")
def list_(
    vc: VcOption = None,
    url: UrlOption = None,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """List the topics of a virtual cluster."""
    with service_call(url, token) as client:
        topics = client.list_topics(vc_name(vc))

    def human(rows: list[dict[str, Any]]) -> None:
        table = Table("name", "version", "state", "sealed")
        for row in rows:
            table.add_row(
                row["name"], str(row["version"]), row["state"], "yes" if row["sealed"] else ""
            )
        out.print(table)

    emit(topics, as_json, human)


@app.command()
def describe(
    name: str,
    vc: VcOption = None,
    url: UrlOption = None,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Show a topic's metadata: version, epochs, shards, clusters."""
    with service_call(url, token) as client:
        _emit_metadata(client.topic_metadata(vc_name(vc), name), as_json)


@app.command()
def alter(
    name: str,
    config: Annotated[list[str] | None, typer.Option(help="key=value to set (repeat).")] = None,
    delete_config: Annotated[
        list[str] | None, typer.Option("--delete-config", help="Key to remove (repeat).")
    ] = None,
    expected_version: Annotated[
        int | None, typer.Option(help="Fail unless the topic is at this version.")
    ] = None,
    vc: VcOption = None,
    url: UrlOption = None,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Change a topic's config: set and remove keys, keep the others (kafka-configs --alter).

    The service replaces the whole config at a version, so this reads the topic,
    merges, and writes at the version it read: a concurrent change makes it fail
    (version_conflict, exit 1) instead of being lost.  The config is the virtual
    topic's; physical topics are not reconfigured.
    """
    updates = _config(config)
    removed = set(delete_config or [])
    if not updates and not removed:
        raise typer.BadParameter("give --config key=value or --delete-config key")
    if removed & updates.keys():
        raise typer.BadParameter(f"both set and deleted: {sorted(removed & updates.keys())}")
    with service_call(url, token) as client:
        current = client.topic_metadata(vc_name(vc), name)
        at = current.version if expected_version is None else expected_version
        merged = {k: v for k, v in current.topic.config.items() if k not in removed} | updates
        _emit_metadata(client.update_topic_config(vc_name(vc), name, merged, at), as_json)


@app.command()
def delete(
    name: str,
    expected_version: Annotated[
        int | None, typer.Option(help="Fail unless at this version.")
    ] = None,
    vc: VcOption = None,
    url: UrlOption = None,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Delete a topic and its physical topics."""
    with service_call(url, token) as client:
        client.delete_topic(vc_name(vc), name, expected_version)
    emit({"deleted": name}, as_json, lambda _d: out.print(f"deleted topic {name}"))


@app.command()
def seal(
    name: str,
    end_offset: Annotated[
        list[str] | None,
        typer.Option(help="shard=offset (repeat); default: read from the backend."),
    ] = None,
    expected_version: Annotated[int | None, typer.Option()] = None,
    vc: VcOption = None,
    url: UrlOption = None,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Seal a topic: no more writes; unsealed epochs get their end offsets."""
    with service_call(url, token) as client:
        _emit_metadata(
            client.seal_topic(vc_name(vc), name, _offsets(end_offset), expected_version), as_json
        )


@app.command("add-epoch")
def add_epoch(
    name: str,
    cluster: Annotated[str, typer.Option(help="Physical cluster of the new epoch.")],
    shards: Annotated[int | None, typer.Option(help="Default: as the current epoch.")] = None,
    state: Annotated[NewEpochState, typer.Option(help="The new epoch's state.")] = (
        NewEpochState.ACTIVE
    ),
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
    vc: VcOption = None,
    url: UrlOption = None,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Seal the current epoch and add a new one on another physical cluster."""
    with service_call(url, token) as client:
        _emit_metadata(
            client.add_epoch(
                vc_name(vc),
                name,
                cluster,
                shards,
                state.value,
                not no_seal,
                _offsets(end_offset),
                mirror_of,
                expected_version,
            ),
            as_json,
        )


async def _epoch_offsets(metadata: TopicMetadata) -> list[dict[str, Any]]:
    """Low and high offset of every shard of every epoch, read from the physical clusters."""
    from xinfra.backend import open_backend
    from xinfra.errors import TopicNotFound

    rows: list[dict[str, Any]] = []
    for epoch in metadata.epochs:
        base = {
            "epoch": epoch.number,
            "cluster": epoch.cluster,
            "physical_topic": epoch.physical_topic,
            "state": epoch.state.value,
        }
        backend = open_backend(metadata.clusters[epoch.cluster])
        reader = backend.reader(epoch.physical_topic)
        try:
            lows = await reader.start_offsets()
            highs = await reader.end_offsets()
        except TopicNotFound:
            rows.extend(
                {
                    **base,
                    "shard": shard.index,
                    "low": None,
                    "high": None,
                    "count": None,
                    "error": "physical topic missing: `xinfra topics reconcile --repair`",
                }
                for shard in epoch.shards
            )
            continue
        finally:
            await reader.close()
            await backend.close()
        for shard in epoch.shards:
            low, high = lows.get(shard.index, 0), highs.get(shard.index, 0)
            end = None if epoch.end_offsets is None else epoch.end_offsets.get(shard.index)
            rows.append(
                {
                    **base,
                    "shard": shard.index,
                    "low": low,
                    "high": high,
                    "count": max(high - low, 0),
                    "sealed_end": end,
                }
            )
    return rows


@app.command()
def offsets(
    name: str,
    vc: VcOption = None,
    url: UrlOption = None,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Per epoch and shard: low (first retained offset), high (one past the last), record count.

    Like kafka-get-offsets / kcat -Q, across the epochs of a virtual topic.  The count
    is high - low (exact on Kafka without transactions and on Northguard).
    """
    import asyncio

    with service_call(url, token) as client:
        metadata = client.topic_metadata(vc_name(vc), name)
        rows = asyncio.run(_epoch_offsets(metadata))

    def human(data: list[dict[str, Any]]) -> None:
        table = Table("epoch", "shard", "cluster", "state", "low", "high", "count")
        for row in data:
            table.add_row(
                str(row["epoch"]),
                str(row["shard"]),
                row["cluster"],
                row["state"],
                *(
                    [str(row["low"]), str(row["high"]), str(row["count"])]
                    if row["low"] is not None
                    else ["-", "-", f"[red]{row['error']}[/red]"]
                ),
            )
        out.print(table)
        total = sum(row["count"] or 0 for row in data)
        out.print(
            f"{total} records in {len(data)} shard(s) of {len({r['epoch'] for r in data})} epoch(s)"
        )

    emit(rows, as_json, human)
    if any(row["low"] is None for row in rows):
        raise typer.Exit(1)


def repair_missing_physical_topics(
    client: MetadataClient, drift: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[str]]:
    """Recreate, empty, the physical topic of every epoch reported ``missing_physical_topic``.

    Why: the local Kafka-protocol broker (tansu) keeps nothing across a restart
    while the topic metadata persists, so every Kafka-backed epoch loses its
    physical topic and the topic becomes unusable.  Recreating it with the
    epoch's shards makes the topic writable and readable again; the records it
    held are lost, and each repaired item says so.  Returns (repaired, errors).
    """
    import asyncio

    from xinfra.backend import open_backend

    missing = [item for item in drift if item.get("action") == "missing_physical_topic"]
    if not missing:
        return [], []
    clusters = {c["name"]: c for c in client.list_clusters()}
    repaired: list[dict[str, Any]] = []
    errors: list[str] = []

    async def recreate(item: dict[str, Any]) -> None:
        metadata = client.topic_metadata(item["virtual_cluster"], item["topic"])
        epoch = next(e for e in metadata.epochs if e.number == item["epoch"])
        cluster = PhysicalCluster.model_validate(
            {
                k: v
                for k, v in clusters[item["cluster"]].items()
                if k in PhysicalCluster.model_fields
            }
        )
        backend = open_backend(cluster)
        try:
            ranges = [shard.key_range for shard in epoch.shards]
            await backend.create_topic(epoch.physical_topic, ranges, metadata.topic.config)
        finally:
            await backend.close()
        lost = (
            f"records below end offsets {epoch.end_offsets} are lost; readers of this sealed "
            "epoch find it empty"
            if epoch.end_offsets
            else "its records are lost; new records go to it again"
        )
        repaired.append(
            {
                **item,
                "action": "recreated_physical_topic",
                "shards": len(epoch.shards),
                "lost": lost,
            }
        )

    for item in missing:
        try:
            asyncio.run(recreate(item))
        except (XinfraError, KeyError, StopIteration, ValueError) as error:
            errors.append(
                f"{item.get('virtual_cluster')}/{item.get('topic')} epoch {item.get('epoch')}: "
                f"cannot recreate {item.get('cluster')}/{item.get('physical_topic')}: {error}"
            )
    return repaired, errors


@app.command()
def reconcile(
    grace_s: Annotated[float | None, typer.Option(help="Leave younger intents alone.")] = None,
    delete_orphans: Annotated[
        bool, typer.Option("--delete-orphans", help="Delete unreferenced xinfra.* physical topics.")
    ] = False,
    repair: Annotated[
        bool,
        typer.Option(
            "--repair",
            help="Recreate (empty) the physical topics of epochs whose topics are gone, as after "
            "a restart of the memory-only local Kafka; their records are lost.",
        ),
    ] = False,
    url: UrlOption = None,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Finish or undo interrupted operations; report drift from the physical clusters.

    Exit 1 when an error remains or, without --repair, an epoch's physical topic is missing.
    """
    with service_call(url, token) as client:
        report = client.reconcile(grace_s, delete_orphans)
        if repair:
            fixed, errors = repair_missing_physical_topics(client, report["drift"])
            report["repaired"] += fixed
            report["errors"] += errors
            fixed_topics = {(i["cluster"], i["physical_topic"]) for i in fixed}
            report["drift"] = [
                i
                for i in report["drift"]
                if (i.get("cluster"), i.get("physical_topic")) not in fixed_topics
            ]
    missing = [i for i in report["drift"] if i["action"] == "missing_physical_topic"]

    def human(data: dict[str, Any]) -> None:
        out.print(f"checked {data['checked_topics']} topics")
        for item in data["repaired"]:
            where = item.get("virtual_cluster") or item.get("cluster")
            what = item.get("topic") or item.get("physical_topic")
            epoch = f" epoch {item['epoch']}" if item.get("epoch") is not None else ""
            lost = f": {item['lost']}" if item.get("lost") else ""
            out.print(f"[green]repaired[/green] {item['action']} {where}/{what}{epoch}{lost}")
        for item in data["drift"]:
            out.print(
                f"[yellow]drift[/yellow] {item['action']} {item.get('cluster')}/{item.get('physical_topic')} {item['detail']}"
            )
        for error in data["errors"]:
            out.print(f"[red]error[/red] {error}")

    emit(report, as_json, human)
    if missing and not as_json:
        err.print(
            f"[yellow]{len(missing)} epoch(s) have lost their physical topic; "
            "`xinfra topics reconcile --repair` recreates them (empty)[/yellow]"
        )
    if report["errors"] or missing:
        raise typer.Exit(1)
