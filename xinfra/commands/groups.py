"""``xinfra groups list|describe|reset-offsets|delete``: consumer groups, like ``kafka-consumer-groups``.

Group requests are served by the instance that coordinates the group; a 307
from another instance is followed here (with the token, which an HTTP client
drops on a redirect to another origin).
"""

from __future__ import annotations

from typing import Annotated, Any
from urllib.parse import urlsplit

import httpx
import typer
from rich.table import Table

from xinfra.commands.options import JsonOption, TokenOption, UrlOption, VcOption, vc_name
from xinfra.commands.output import emit, out, service_call
from xinfra.errors import Unavailable
from xinfra.rest import MetadataClient, resolve_token
from xinfra.settings import get_settings

app = typer.Typer(
    help="Consumer groups: members, shards, committed positions, lag.", no_args_is_help=True
)
REDIRECTS_MAX = 3


def _call(
    client: MetadataClient, token: str | None, method: str, path: str, json: Any = None
) -> Any:
    """One request with ``token`` (``--token``, else the settings'), following redirects to the
    coordinating instance (an HTTP client drops the token on a redirect to another origin)."""
    settings = get_settings()
    token = resolve_token(settings, token)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    base = client.url
    for _ in range(REDIRECTS_MAX + 1):
        try:
            response = httpx.request(
                method, base + path, json=json, headers=headers, timeout=settings.request_timeout_s
            )
        except httpx.TransportError as error:
            raise Unavailable(f"the metadata service at {base} is unreachable ({error})") from None
        if response.status_code == 307 and "location" in response.headers:
            parts = urlsplit(response.headers["location"])
            base = f"{parts.scheme}://{parts.netloc}"
            continue
        if response.status_code >= 400:
            raise MetadataClient._error(response)
        return response.json() if response.content else None
    raise Unavailable(f"the coordinator of {path} did not answer; retry")


@app.command("list")
def list_(
    vc: VcOption = None,
    url: UrlOption = None,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """List the groups of a virtual cluster with their state and member count."""
    with service_call(url, token) as client:
        groups = _call(client, token, "GET", f"/v1/vclusters/{vc_name(vc)}/groups")["groups"]

    def human(rows: list[dict[str, Any]]) -> None:
        table = Table("group", "state", "members", "epoch")
        for row in rows:
            table.add_row(row["name"], row["state"], str(row["members"]), str(row["group_epoch"]))
        out.print(table)

    emit(groups, as_json, human)


@app.command()
def describe(
    group: str,
    vc: VcOption = None,
    url: UrlOption = None,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Members, their shards, committed positions and lag per shard."""
    with service_call(url, token) as client:
        body = _call(client, token, "GET", f"/v1/vclusters/{vc_name(vc)}/groups/{group}")

    def human(data: dict[str, Any]) -> None:
        out.print(
            f"[bold]{data['virtual_cluster']}/{data['name']}[/bold] {data['state']}, "
            f"epoch {data['group_epoch']}, {data['members']} members, "
            f"coordinator {data['coordinator']}"
        )
        members = Table("member", "client", "epoch", "shards")
        for m in data["member_list"]:
            shards = ",".join(f"{t}/{s}" for t, s in m["assignment"])
            members.add_row(m["member_id"], m["client_id"], str(m["member_epoch"]), shards)
        out.print(members)
        shards_table = Table("topic", "shard", "member", "committed", "end", "lag")
        for s in data["shards"]:
            committed = s["committed"]
            shards_table.add_row(
                s["topic"],
                str(s["shard"]),
                s["member_id"] or "-",
                f"{committed['epoch']}:{committed['offset']}" if committed else "-",
                f"{s['end_epoch']}:{s['end_offset']}",
                "-" if s["lag"] is None else str(s["lag"]),
            )
        out.print(shards_table)

    emit(body, as_json, human)


@app.command("reset-offsets")
def reset_offsets(
    group: str,
    topic: Annotated[str, typer.Option(help="The topic whose positions are reset.")],
    to_earliest: Annotated[bool, typer.Option("--to-earliest")] = False,
    to_latest: Annotated[bool, typer.Option("--to-latest")] = False,
    to_timestamp: Annotated[int | None, typer.Option("--to-timestamp", help="ms")] = None,
    to_position: Annotated[
        list[str] | None,
        typer.Option("--to-position", help="epoch:shard:offset (repeat)."),
    ] = None,
    force: Annotated[bool, typer.Option(help="Reset even while members run.")] = False,
    vc: VcOption = None,
    url: UrlOption = None,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Set a topic's committed positions; refused while the group has members unless --force."""
    chosen = [to_earliest, to_latest, to_timestamp is not None, bool(to_position)]
    if sum(chosen) != 1:
        raise typer.BadParameter(
            "give exactly one of --to-earliest, --to-latest, --to-timestamp, --to-position"
        )
    body: dict[str, Any] = {"topic": topic, "force": force}
    if to_earliest:
        body["to"] = "earliest"
    elif to_latest:
        body["to"] = "latest"
    elif to_timestamp is not None:
        body["to"], body["timestamp_ms"] = "timestamp", to_timestamp
    else:
        positions = []
        for item in to_position or []:
            parts = item.split(":")
            if len(parts) != 3 or not all(p.isdigit() for p in parts):
                raise typer.BadParameter(f"--to-position {item!r}: use epoch:shard:offset")
            epoch, shard, offset = (int(p) for p in parts)
            positions.append({"topic": topic, "epoch": epoch, "shard": shard, "offset": offset})
        body["to"], body["positions"] = "position", positions
    with service_call(url, token) as client:
        result = _call(
            client, token, "POST", f"/v1/vclusters/{vc_name(vc)}/groups/{group}/reset", body
        )

    def human(data: dict[str, Any]) -> None:
        table = Table("topic", "epoch", "shard", "offset")
        for p in data["positions"]:
            table.add_row(p["topic"], str(p["epoch"]), str(p["shard"]), str(p["offset"]))
        out.print(table)

    emit(result, as_json, human)


@app.command()
def delete(
    group: str,
    force: Annotated[bool, typer.Option(help="Delete even while members run.")] = False,
    vc: VcOption = None,
    url: UrlOption = None,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Delete a group's state and checkpoints."""
    suffix = "?force=true" if force else ""
    with service_call(url, token) as client:
        _call(client, token, "DELETE", f"/v1/vclusters/{vc_name(vc)}/groups/{group}{suffix}")
    emit({"deleted": group}, as_json, lambda _d: out.print(f"deleted group {group}"))
