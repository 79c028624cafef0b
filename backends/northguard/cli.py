"""``xinfra northguard ...``: run a broker (``broker``) from the command line.

The lead mounts ``app`` as ``xinfra northguard``; ``python -m
backends.northguard.broker`` runs the ``broker`` command alone.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from backends.northguard.broker.main import run_broker
from backends.northguard.broker.server import BrokerConfig
from backends.northguard.credentials import SECRET_ENV, check_secret
from backends.northguard.tls import CERT_ENV, KEY_ENV
from xinfra.settings import get_settings

DATA_DIR = Path(".xinfra/northguard")

app = typer.Typer(help="Northguard: run a broker, show a cluster.", no_args_is_help=True)


def _attributes(values: list[str]) -> dict[str, str]:
    attributes: dict[str, str] = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"attribute {item!r} is not key=value")
        attributes[key] = value
    return attributes


def _secret(path: Path | None) -> bytes | None:
    """The cluster secret from a file (not argv: ``ps`` shows argv) or the environment."""
    if path is not None:
        value = path.read_bytes().rstrip(b"\n")
    elif os.environ.get(SECRET_ENV):
        value = os.environ[SECRET_ENV].encode()
    else:
        return None
    try:
        return check_secret(value)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None


@app.command("broker")
def broker(
    broker_id: str = typer.Option("1", "--id", help="This broker's id in the cluster."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(9470, help="Client port."),
    http_port: int = typer.Option(0, help="Health and metrics port (0: any free port, -1: none)."),
    data_dir: Annotated[Path, typer.Option(help="Where segments and metadata live.")] = DATA_DIR,
    attr: Annotated[
        list[str] | None, typer.Option("--attr", help="Broker attribute key=value (repeatable).")
    ] = None,
    store: str = typer.Option("fps", help="Segment store: fps (durable) or memory."),
    segment_bytes_max: int = typer.Option(0, help="Seal segments at this size (0: settings)."),
    segment_age_s_max: float = typer.Option(0.0, help="Seal segments at this age (0: settings)."),
    group_commit_ms: float = typer.Option(-1.0, help="Group commit window (-1: settings)."),
    descriptors_max: int = typer.Option(
        0,
        help="Bound of the open segment file pool (0: a quarter of RLIMIT_NOFILE, at most 4096; "
        "refused at start when not well under the limit).",
    ),
    sealed_segments_max: int = typer.Option(
        10_000,
        help="Sealed segments a range keeps; past it the oldest are deleted (data and metadata), "
        "like retention: this bounds the metadata snapshot at about 230 B per kept segment.",
    ),
    snapshot_ops_max: int = typer.Option(
        0, help="Metadata journal ops between snapshots (0: the default, 10,000)."
    ),
    connections_max: int = typer.Option(
        4096, help="Client connections in total; one more is closed as it is accepted."
    ),
    connections_per_peer_max: int = typer.Option(
        512, help="Client connections from one peer address; one more is closed on accept."
    ),
    coordinator: str = typer.Option(
        "",
        help="host:port of the cluster's coordinator broker: this broker joins it as a member "
        "(registers, heartbeats, holds replicas, forwards metadata requests). Empty: this broker "
        "is the coordinator.",
    ),
    cluster: bool = typer.Option(
        False, help="The coordinator of a multi-broker cluster (members join it by --coordinator)."
    ),
    advertised_address: str = typer.Option(
        "", help="host:port other brokers and clients reach this broker at (empty: host:port)."
    ),
    replication_factor: int = typer.Option(
        1,
        help="Replicas of every new segment under the default storage policy (topics may set "
        "replication.factor).",
    ),
    replica_timeout_s: float = typer.Option(
        5.0, help="A follower that does not acknowledge a replicated append in this time fails."
    ),
    heartbeat_s: float = typer.Option(0.5, help="A member's heartbeat interval."),
    broker_timeout_s: float = typer.Option(
        3.0, help="A member without a heartbeat for this long is out of new replica sets."
    ),
    log_level: str = typer.Option("INFO", help="Logging level."),
    secret_file: Annotated[
        Path | None,
        typer.Option(
            help=f"File holding the cluster secret (else ${SECRET_ENV}); with one, every "
            "connection must present a credential signed with it. Without: open to anyone."
        ),
    ] = None,
    tls_cert: Annotated[
        Path | None,
        typer.Option(
            envvar=CERT_ENV,
            help="PEM certificate (chain) of the client port: with --tls-key, the port speaks "
            "TLS 1.2+ only. Without: plaintext. The HTTP port stays plaintext.",
        ),
    ] = None,
    tls_key: Annotated[
        Path | None,
        typer.Option(envvar=KEY_ENV, help="PEM private key of --tls-cert."),
    ] = None,
) -> None:
    """Run one Northguard broker until SIGTERM or Ctrl-C."""
    if (tls_cert is None) != (tls_key is None):
        raise typer.BadParameter(f"--tls-cert (${CERT_ENV}) and --tls-key (${KEY_ENV}) go together")
    settings = get_settings()
    config = BrokerConfig(
        data_dir=data_dir,
        broker_id=broker_id,
        host=host,
        port=port,
        http_port=None if http_port < 0 else http_port,
        attributes=_attributes(attr or []),
        store=store,
        segment_bytes_max=segment_bytes_max or settings.segment_bytes_max,
        segment_age_s_max=segment_age_s_max or settings.segment_age_s_max,
        group_commit_ms=settings.group_commit_ms if group_commit_ms < 0 else group_commit_ms,
        group_commit_bytes_max=settings.group_commit_bytes_max,
        group_commit_records_max=settings.group_commit_records_max,
        frame_bytes_max=settings.frame_bytes_max,
        descriptors_max=descriptors_max or None,
        sealed_segments_max=sealed_segments_max,
        snapshot_ops_max=snapshot_ops_max or None,
        secret=_secret(secret_file),
        tls_cert=tls_cert,
        tls_key=tls_key,
        connections_max=connections_max,
        connections_per_peer_max=connections_per_peer_max,
        coordinator=coordinator or None,
        cluster=cluster,
        advertised_address=advertised_address or None,
        replication_factor=replication_factor,
        replica_timeout_s=replica_timeout_s,
        heartbeat_s=heartbeat_s,
        broker_timeout_s=broker_timeout_s,
    )
    run_broker(config, log_level)


@app.command("status")
def status(
    bootstrap: str = typer.Option(
        "127.0.0.1:9470", help="Comma-separated broker addresses; the first that answers is used."
    ),
    secret_file: Annotated[
        Path | None, typer.Option(help=f"The cluster secret (else ${SECRET_ENV}), if it has one.")
    ] = None,
    as_json: bool = typer.Option(False, "--json", help="Print the status as JSON."),
    timeout_s: float = typer.Option(10.0, help="Request timeout."),
) -> None:
    """Brokers with attributes and load, segments with replica sets, under-replicated segments."""
    import json

    from backends.northguard.client.blocking import request_blocking
    from backends.northguard.credentials import ADMIN, ALL_TOPICS, OPERATIONS, sign
    from xinfra.errors import BackendUnavailable

    secret = _secret(secret_file)
    credential = (
        None if secret is None else sign(secret, f"cli:{ADMIN}", ALL_TOPICS, OPERATIONS, 300.0)
    )
    result = None
    failure: BackendUnavailable | None = None
    for address in [a.strip() for a in bootstrap.split(",") if a.strip()]:
        try:
            result = request_blocking(address, "cluster_status", timeout_s, credential=credential)
            break
        except BackendUnavailable as error:
            failure = error
    if result is None:
        typer.echo(f"backend_unavailable: {failure.message if failure else 'no address'}", err=True)
        raise typer.Exit(4)
    if as_json:
        typer.echo(json.dumps(result, indent=2, sort_keys=True))
        return
    typer.echo(f"coordinator: broker {result['coordinator']}")
    typer.echo("brokers:")
    for row in result["brokers"]:
        attributes = ",".join(f"{k}={v}" for k, v in sorted(row["attributes"].items())) or "-"
        typer.echo(
            f"  {row['broker_id']:>6} {row['address']:<21} {'live' if row['live'] else 'DOWN':<4} "
            f"{row['role']:<11} attrs={attributes} active_segments={row['active_segments']} "
            f"store_bytes={row['store_bytes']}"
        )
    typer.echo(f"segments: {len(result['segments'])} listed")
    for segment in result["segments"]:
        typer.echo(
            f"  {segment['segment_id']:<14} {segment['topic']} range {segment['range_id']} "
            f"{segment['state']:<6} [{segment['start_offset']}, {segment['end_offset']}) "
            f"replicas={','.join(segment['replicas'])}"
        )
    under = result["under_replicated"]
    typer.echo(f"under-replicated: {len(under)}" + (f" ({', '.join(under)})" if under else ""))


@app.callback()
def _main() -> None:
    """Northguard commands."""


def broker_main() -> None:
    """Entry of ``python -m backends.northguard.broker``: the ``broker`` command alone."""
    typer.run(broker)
