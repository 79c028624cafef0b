"""``xinfra tokens list|create|revoke``: API tokens of the metadata service (admin of all).

The service keeps only a token's hash: ``create`` shows the token once, and
``list`` shows names, roles and scopes, never a token.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any

import typer
from rich.table import Table

from xinfra.commands.options import JsonOption, TokenOption, UrlOption
from xinfra.commands.output import emit, err, out, service_call

app = typer.Typer(help="API tokens: create, list, revoke (admin of all).", no_args_is_help=True)


class TokenRole(enum.StrEnum):
    """A token's role, as the service's ``TokenRole`` (the CLI imports no service module)."""

    ADMIN = "admin"
    CLIENT = "client"


@app.command("list")
def list_(url: UrlOption = None, token: TokenOption = None, as_json: JsonOption = False) -> None:
    """List the tokens: name, role, scope, creation time (never the token itself)."""
    with service_call(url, token) as client:
        tokens = list(client.request("GET", "/v1/tokens")["tokens"])

    def human(rows: list[dict[str, Any]]) -> None:
        table = Table("name", "role", "scope", "created_ms")
        for row in rows:
            table.add_row(row["name"], row["role"], row["scope"], str(row["created_ms"]))
        out.print(table)

    emit(tokens, as_json, human)


@app.command()
def create(
    name: Annotated[str, typer.Argument(help="The token's name (to list and revoke it by).")],
    role: Annotated[
        TokenRole, typer.Option(help="admin: manage its scope; client: produce and consume.")
    ] = TokenRole.CLIENT,
    scope: Annotated[str, typer.Option(help="A virtual cluster, or * for all.")] = "*",
    url: UrlOption = None,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Create a token; it is printed once (stdout), and only its hash is kept."""
    with service_call(url, token) as client:
        created = client.request(
            "POST", "/v1/tokens", json={"name": name, "role": role.value, "scope": scope}
        )

    def human(data: dict[str, Any]) -> None:
        err.print(f"created {data['role']} token {data['name']} for {data['scope']}; shown once:")
        print(data["token"])

    emit(created, as_json, human)


@app.command()
def revoke(
    name: Annotated[str, typer.Argument(help="The token's name.")],
    url: UrlOption = None,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Revoke a token: the service refuses it from now on."""
    with service_call(url, token) as client:
        client.request("DELETE", f"/v1/tokens/{name}")
    emit({"revoked": name}, as_json, lambda _d: out.print(f"revoked token {name}"))
