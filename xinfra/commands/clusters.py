"""``xinfra clusters register|list|describe|delete``: physical clusters in the metadata service."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from pydantic import ValidationError
from rich.table import Table

from xinfra.commands.options import JsonOption, TokenOption, UrlOption
from xinfra.commands.output import emit, out, service_call
from xinfra.model import ClusterKind, PhysicalCluster

app = typer.Typer(help="Physical clusters (Kafka, Northguard).", no_args_is_help=True)


def _attributes(pairs: list[str]) -> dict[str, str]:
    attributes = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise typer.BadParameter(f"--attr {pair!r}: use key=value")
        attributes[key] = value
    return attributes


def _show(cluster: dict[str, Any]) -> None:
    out.print(
        f"[bold]{cluster['name']}[/bold] {cluster['kind']} {cluster['bootstrap']} v{cluster['version']}"
    )
    for key, value in cluster.get("attributes", {}).items():
        out.print(f"  {key}={value}")


@app.command()
def register(
    name: Annotated[str, typer.Argument(help="Cluster name.")],
    kind: Annotated[ClusterKind, typer.Option(help="kafka or northguard.")],
    bootstrap: Annotated[str, typer.Option(help="host:port[,host:port...]")],
    attr: Annotated[list[str] | None, typer.Option(help="key=value attribute (repeat).")] = None,
    no_check: Annotated[
        bool, typer.Option("--no-check", help="Skip the connectivity check.")
    ] = False,
    url: UrlOption = None,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Register a physical cluster (the service validates it, then checks its connectivity)."""
    try:
        cluster = PhysicalCluster(
            name=name, kind=kind, bootstrap=bootstrap, attributes=_attributes(attr or [])
        )
    except ValidationError as error:
        reasons = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
        raise typer.BadParameter(reasons) from None
    with service_call(url, token) as client:
        emit(client.register_cluster(cluster, check=not no_check), as_json, _show)


@app.command("list")
def list_(url: UrlOption = None, token: TokenOption = None, as_json: JsonOption = False) -> None:
    """List physical clusters."""
    with service_call(url, token) as client:
        clusters = client.list_clusters()

    def human(rows: list[dict[str, Any]]) -> None:
        table = Table("name", "kind", "bootstrap", "version")
        for row in rows:
            table.add_row(row["name"], row["kind"], row["bootstrap"], str(row["version"]))
        out.print(table)

    emit(clusters, as_json, human)


@app.command()
def describe(
    name: str, url: UrlOption = None, token: TokenOption = None, as_json: JsonOption = False
) -> None:
    """Show one physical cluster."""
    with service_call(url, token) as client:
        emit(client.describe_cluster(name), as_json, _show)


@app.command()
def delete(
    name: str, url: UrlOption = None, token: TokenOption = None, as_json: JsonOption = False
) -> None:
    """Unregister a physical cluster no epoch lives on."""
    with service_call(url, token) as client:
        client.delete_cluster(name)
    emit({"deleted": name}, as_json, lambda d: out.print(f"deleted cluster {name}"))
