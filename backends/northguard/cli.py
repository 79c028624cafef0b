"""``xinfra northguard ...``: run a broker (``broker``), show a cluster (``status``), define
storage policies (``policies create|list|validate``).

The lead mounts ``app`` as ``xinfra northguard``; ``python -m
backends.northguard.broker`` runs the ``broker`` command alone.

Every option of ``broker`` that an operator sets per deployment has an
``XINFRA_`` environment variable (``--help`` names it), read by the command
itself rather than through ``xinfra.settings``, whose import (pydantic-settings
and its sources) was 0.13 s of every broker start: a broker started at 20,480
segments served 0.1 s sooner without it (medians of six starts each, the
recovery itself unchanged).  Typer still imports pydantic to parse the options.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any

import typer

from backends.northguard.broker.main import run_broker
from backends.northguard.broker.server import BrokerConfig
from backends.northguard.credentials import SECRET_ENV, check_secret
from backends.northguard.tls import CERT_ENV, KEY_ENV

DATA_DIR = Path(".xinfra/northguard")

app = typer.Typer(
    help="Northguard: run a broker, show a cluster, define storage policies.", no_args_is_help=True
)


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
    segment_bytes_max: int = typer.Option(
        BrokerConfig.segment_bytes_max,
        min=1,
        envvar="XINFRA_SEGMENT_BYTES_MAX",
        help="Seal segments at this size.",
    ),
    segment_age_s_max: float = typer.Option(
        BrokerConfig.segment_age_s_max,
        min=0.001,
        envvar="XINFRA_SEGMENT_AGE_S_MAX",
        help="Seal segments at this age.",
    ),
    group_commit_ms: float = typer.Option(
        BrokerConfig.group_commit_ms,
        min=0.0,
        envvar="XINFRA_GROUP_COMMIT_MS",
        help="Least ms between the starts of two flushes (an idle store flushes at once).",
    ),
    group_commit_bytes_max: int = typer.Option(
        BrokerConfig.group_commit_bytes_max,
        min=1,
        envvar="XINFRA_GROUP_COMMIT_BYTES_MAX",
        help="Most bytes one flush (one WAL write and fsync) takes.",
    ),
    group_commit_records_max: int = typer.Option(
        BrokerConfig.group_commit_records_max,
        min=1,
        envvar="XINFRA_GROUP_COMMIT_RECORDS_MAX",
        help="Most records one flush takes.",
    ),
    frame_bytes_max: int = typer.Option(
        BrokerConfig.frame_bytes_max,
        min=1 << 16,
        envvar="XINFRA_FRAME_BYTES_MAX",
        help="Largest protocol frame accepted; a larger one closes its connection.",
    ),
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
    metadata_replication_factor: int = typer.Option(
        1,
        help="Copies of the coordinator's metadata journal: its own and N-1 live members'; an "
        "op is acknowledged once every copy has fsynced it (1: the coordinator's disk only).",
    ),
    recover_metadata_from: str = typer.Option(
        "",
        help="Comma-separated member addresses: a coordinator whose journal is empty (a lost "
        "disk) rebuilds it from the most complete member copy among them, refusing to start "
        "when a member of the newest metadata replica set recorded among them did not answer.",
    ),
    metadata_policy: str = typer.Option(
        "",
        help="Storage policy (defined with `policies create`) placing the coordinator's "
        "metadata copies, e.g. distinct racks; until it is defined, "
        "--metadata-replication-factor applies. Empty: that factor alone.",
    ),
    force_unclean_metadata_recovery: bool = typer.Option(
        False,
        "--force-unclean-metadata-recovery",
        help="With --recover-metadata-from: take the most complete copy reached even when the "
        "rule refuses it (it may be behind: decided metadata ops may be lost).",
    ),
    replica_timeout_s: float = typer.Option(
        5.0, help="A follower that does not acknowledge a replicated append in this time fails."
    ),
    heartbeat_s: float = typer.Option(0.5, help="A member's heartbeat interval."),
    peer_tls_ca: Annotated[
        Path | None,
        typer.Option(
            help="PEM CA the other brokers' certificates are checked against, when the client "
            "port speaks TLS (brokers talk to each other over it). Default: the system's."
        ),
    ] = None,
    orphan_scan_s: float = typer.Option(
        30.0, help="How often the coordinator deletes members' segments they are no replica of."
    ),
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
    config = BrokerConfig(
        data_dir=data_dir,
        broker_id=broker_id,
        host=host,
        port=port,
        http_port=None if http_port < 0 else http_port,
        attributes=_attributes(attr or []),
        store=store,
        segment_bytes_max=segment_bytes_max,
        segment_age_s_max=segment_age_s_max,
        group_commit_ms=group_commit_ms,
        group_commit_bytes_max=group_commit_bytes_max,
        group_commit_records_max=group_commit_records_max,
        frame_bytes_max=frame_bytes_max,
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
        metadata_replication_factor=metadata_replication_factor,
        recover_metadata_from=tuple(a for a in recover_metadata_from.split(",") if a),
        metadata_policy=metadata_policy or None,
        force_unclean_metadata_recovery=force_unclean_metadata_recovery,
        replica_timeout_s=replica_timeout_s,
        heartbeat_s=heartbeat_s,
        broker_timeout_s=broker_timeout_s,
        orphan_scan_s=orphan_scan_s,
        peer_tls_ca=peer_tls_ca,
    )
    run_broker(config, log_level)


BOOTSTRAP_HELP = "Comma-separated broker addresses; the first that answers is used."


def _cluster_request(
    bootstrap: str, secret_file: Path | None, timeout_s: float, op: str, **arguments: Any
) -> dict[str, Any]:
    """One request to the first broker of ``bootstrap`` that answers (exit 4 when none does,
    1 with the error's code when the cluster refuses it)."""
    from backends.northguard.client.blocking import request_blocking
    from backends.northguard.credentials import ADMIN, ALL_TOPICS, OPERATIONS, sign
    from xinfra.errors import BackendUnavailable, XinfraError

    secret = _secret(secret_file)
    credential = (
        None if secret is None else sign(secret, f"cli:{ADMIN}", ALL_TOPICS, OPERATIONS, 300.0)
    )
    failure: BackendUnavailable | None = None
    for address in [a.strip() for a in bootstrap.split(",") if a.strip()]:
        try:
            return request_blocking(address, op, timeout_s, credential=credential, **arguments)
        except BackendUnavailable as error:
            failure = error
        except XinfraError as error:
            typer.echo(f"{error.code}: {error.message}", err=True)
            raise typer.Exit(1) from None
    typer.echo(f"backend_unavailable: {failure.message if failure else 'no address'}", err=True)
    raise typer.Exit(4)


@app.command("status")
def status(
    bootstrap: str = typer.Option("127.0.0.1:9470", help=BOOTSTRAP_HELP),
    secret_file: Annotated[
        Path | None, typer.Option(help=f"The cluster secret (else ${SECRET_ENV}), if it has one.")
    ] = None,
    as_json: bool = typer.Option(False, "--json", help="Print the status as JSON."),
    timeout_s: float = typer.Option(10.0, help="Request timeout."),
) -> None:
    """Brokers with attributes and load, segments with replica sets, under-replicated segments."""
    result = _cluster_request(bootstrap, secret_file, timeout_s, "cluster_status")
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
            f"leading={row.get('leading_segments', 0)} store_bytes={row['store_bytes']}"
        )
    typer.echo(f"segments: {result['segments_total']} ({len(result['segments'])} listed)")
    for segment in result["segments"]:
        typer.echo(
            f"  {segment['segment_id']:<14} {segment['topic']} range {segment['range_id']} "
            f"{segment['state']:<6} [{segment['start_offset']}, {segment['end_offset']}) "
            f"replicas={','.join(segment['replicas'])}"
        )
    metadata = result.get("metadata")
    if metadata is not None:
        policy = metadata.get("policy")
        rule = (
            f"policy {_policy_line(policy)}"
            if policy
            else f"replication factor {metadata['replication_factor']}"
        )
        typer.echo(
            f"metadata: {rule}; copies on {','.join(metadata['replicas'])} "
            f"(short {metadata['under_replicated']}, replaced {metadata['replaced']})"
        )
        if metadata.get("reason"):
            typer.echo(f"  metadata copies short: {metadata['reason']}")
    under = result["under_replicated"]
    typer.echo(
        f"under-replicated: {result['under_replicated_total']}"
        + (f" ({', '.join(under)})" if under else "")
    )


@app.callback()
def _main() -> None:
    """Northguard commands."""


def broker_main() -> None:
    """Entry of ``python -m backends.northguard.broker``: the ``broker`` command alone."""
    typer.run(broker)


policies_app = typer.Typer(
    help="Storage policies: constraints over broker attributes that place every new segment.",
    no_args_is_help=True,
)
app.add_typer(policies_app, name="policies")


def _constraints(values: list[str]) -> list[dict[str, Any]]:
    constraints: list[dict[str, Any]] = []
    for item in values:
        expression, sep, count = item.rpartition(":")
        if not sep or not count.isdigit():
            raise typer.BadParameter(
                f"constraint {item!r} is EXPRESSION:COUNT (e.g. 'rack=r1:1', '*:3')"
            )
        constraints.append({"expression": expression, "count": int(count)})
    return constraints


def _policy_line(policy: dict[str, Any]) -> str:
    constraints = " ".join(f"{c['expression']}:{c['count']}" for c in policy["constraints"])
    distinct = f" distinct_by={policy['distinct_by']}" if policy.get("distinct_by") else ""
    return f"{policy['name']}: {constraints}{distinct} retention_ms={policy['retention_ms']}"


@policies_app.command("create")
def policies_create(
    name: str,
    constraint: Annotated[
        list[str],
        typer.Option(
            help="EXPRESSION:COUNT over broker attributes (repeatable): 'rack=r1:1', '*:3'."
        ),
    ],
    distinct_by: str = typer.Option("", help="An attribute every replica must differ in."),
    retention_ms: int = typer.Option(7 * 24 * 3600 * 1000, help="Retention of sealed segments."),
    bootstrap: str = typer.Option("127.0.0.1:9470", help=BOOTSTRAP_HELP),
    secret_file: Annotated[Path | None, typer.Option(help="The cluster secret, if any.")] = None,
    timeout_s: float = typer.Option(10.0, help="Request timeout."),
) -> None:
    """Define a storage policy; refused with the reason when it is not valid."""
    policy = {
        "name": name,
        "constraints": _constraints(constraint),
        "retention_ms": retention_ms,
        "distinct_by": distinct_by or None,
    }
    result = _cluster_request(bootstrap, secret_file, timeout_s, "create_policy", policy=policy)
    typer.echo(f"created {_policy_line(result)}")


@policies_app.command("list")
def policies_list(
    bootstrap: str = typer.Option("127.0.0.1:9470", help=BOOTSTRAP_HELP),
    secret_file: Annotated[Path | None, typer.Option(help="The cluster secret, if any.")] = None,
    as_json: bool = typer.Option(False, "--json", help="Print the policies as JSON."),
    timeout_s: float = typer.Option(10.0, help="Request timeout."),
) -> None:
    """Every storage policy of the cluster."""
    result = _cluster_request(bootstrap, secret_file, timeout_s, "list_policies")
    if as_json:
        typer.echo(json.dumps(result["policies"], indent=2, sort_keys=True))
        return
    for policy in result["policies"]:
        typer.echo(_policy_line(policy))


@policies_app.command("validate")
def policies_validate(
    name: str,
    bootstrap: str = typer.Option("127.0.0.1:9470", help=BOOTSTRAP_HELP),
    secret_file: Annotated[Path | None, typer.Option(help="The cluster secret, if any.")] = None,
    timeout_s: float = typer.Option(10.0, help="Request timeout."),
) -> None:
    """Whether the live brokers can satisfy a policy now (exit 1 and why, when not)."""
    result = _cluster_request(bootstrap, secret_file, timeout_s, "validate_policy", policy=name)
    if result["satisfiable"]:
        typer.echo(f"{name}: satisfiable now, e.g. replicas {','.join(result['replicas'])}")
        return
    typer.echo(f"{name}: not satisfiable now: {result['reason']}", err=True)
    raise typer.Exit(1)
