"""``xinfra vclusters list|create``: virtual clusters, the namespaces of virtual topics.

Over ``/v1/vclusters`` of the metadata service; creating one takes an admin
of all, listing shows what the token may read.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from xinfra.commands.options import JsonOption, TokenOption, UrlOption
from xinfra.commands.output import emit, out, service_call

app = typer.Typer(help="Virtual clusters: namespaces of virtual topics.", no_args_is_help=True)


@app.command("list")
def list_(url: UrlOption = None, token: TokenOption = None, as_json: JsonOption = False) -> None:
    """List the virtual clusters this token may read."""
    with service_call(url, token) as client:
        vclusters = list(client.request("GET", "/v1/vclusters")["virtual_clusters"])

    def human(rows: list[dict[str, Any]]) -> None:
        table = Table("name", "version", "description")
        for row in rows:
            table.add_row(row["name"], str(row["version"]), row.get("description", ""))
        out.print(table)

    emit(vclusters, as_json, human)


@app.command()
def create(
    name: Annotated[str, typer.Argument(help="The virtual cluster's name.")],
    description: Annotated[str, typer.Option(help="What it is for.")] = "",
    url: UrlOption = None,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Create a virtual cluster (admin of all)."""
    with service_call(url, token) as client:
        created = client.request(
            "POST", "/v1/vclusters", json={"name": name, "description": description}
        )
    emit(created, as_json, lambda c: out.print(f"created virtual cluster {c['name']}"))
