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

app = typer.Typer(help="Northguard: run a broker.", no_args_is_help=True)


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
    )
    run_broker(config, log_level)


@app.callback()
def _main() -> None:
    """Northguard commands."""


def broker_main() -> None:
    """Entry of ``python -m backends.northguard.broker``: the ``broker`` command alone."""
    typer.run(broker)
