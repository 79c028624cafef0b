"""``xinfra clients list``: the producers and consumers connected to a virtual cluster.

Over the service's clients registry (``/v1/vclusters/{vc}/clients``): a
client is listed while its lease runs, with the metadata versions it last
reported, which is what a migration waits on.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from xinfra.commands.options import JsonOption, TokenOption, UrlOption, VcOption, vc_name
from xinfra.commands.output import emit, out, service_call

app = typer.Typer(help="Connected producers and consumers.", no_args_is_help=True)


@app.command("list")
def list_(
    topic: Annotated[str | None, typer.Option(help="Only the clients of this topic.")] = None,
    vc: VcOption = None,
    url: UrlOption = None,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """List the live clients of a virtual cluster: id, kind, host, topics, versions, expiry."""
    with service_call(url, token) as client:
        clients = list(
            client.request("GET", f"/v1/vclusters/{vc_name(vc)}/clients", params={"topic": topic})[
                "clients"
            ]
        )

    def human(rows: list[dict[str, Any]]) -> None:
        table = Table("client", "kind", "host", "topics", "versions", "expires_ms")
        for row in rows:
            versions = ",".join(f"{t}={v}" for t, v in sorted(row["versions"].items()))
            table.add_row(
                row["client_id"],
                row["kind"],
                row["host"],
                ",".join(row["topics"]),
                versions,
                str(row["expires_ms"]),
            )
        out.print(table)

    emit(clients, as_json, human)
