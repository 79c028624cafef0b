"""``xinfra serve`` and ``xinfra db``: run the service, migrate its store.

Mounted by the ``xinfra`` CLI through the ``xinfra.commands`` entry points
(``serve = metadata_service.cli:serve_command``, ``db = metadata_service.cli:db_app``).
Options override ``XINFRA_*`` settings.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer

from xinfra.settings import get_settings


def serve_command(
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8780,
    database_url: Annotated[
        str | None, typer.Option(help="SQLAlchemy URL (default: XINFRA_DATABASE_URL).")
    ] = None,
    zookeeper: Annotated[
        str | None, typer.Option(help="ZooKeeper for cross-instance notifications.")
    ] = None,
    notify: Annotated[
        str | None, typer.Option(help="auto | zookeeper | local (default: XINFRA_METADATA_NOTIFY).")
    ] = None,
    no_upgrade: Annotated[
        bool, typer.Option("--no-upgrade", help="Do not apply migrations on start.")
    ] = False,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "info",
    advertised_url: Annotated[
        str | None,
        typer.Option(
            help="The URL other instances send a consumer group's clients to when this one "
            "coordinates it (default: http://HOST:PORT, the host name for 0.0.0.0)."
        ),
    ] = None,
) -> None:
    """Run the metadata service (HTTP API under /v1, /health, /ready, /metrics)."""
    from metadata_service.app import create_app
    from metadata_service.config import ServiceConfig
    from metadata_service.server import serve

    settings = get_settings()
    updates: dict[str, object] = {}
    if database_url is not None:
        updates["database_url"] = database_url
    if zookeeper is not None:
        updates["zookeeper"] = zookeeper
    if notify is not None:
        updates["metadata_notify"] = notify
    if updates:
        settings = settings.model_copy(update=updates)
    if advertised_url is None:
        import socket

        reachable = socket.gethostname() if host in ("0.0.0.0", "::") else host
        advertised_url = f"http://{reachable}:{port}"
    config = ServiceConfig.from_settings(
        settings, auto_upgrade=not no_upgrade, advertised_url=advertised_url
    )
    serve(
        create_app(config),
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
    )


db_app = typer.Typer(help="The metadata store's schema (Alembic).", no_args_is_help=True)


@db_app.command("upgrade")
def db_upgrade(
    database_url: Annotated[
        str | None, typer.Option(help="SQLAlchemy URL (default: XINFRA_DATABASE_URL).")
    ] = None,
    revision: Annotated[str, typer.Option(help="Target revision.")] = "head",
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Apply migrations up to a revision (idempotent)."""
    from metadata_service.migrate import current_revision, upgrade_database

    url = database_url or get_settings().database_url
    try:
        upgrade_database(url, revision)
    except Exception as error:
        typer.echo(f"upgrade failed: {error}", err=True)
        raise typer.Exit(1) from None
    current = current_revision(url)
    if as_json:
        typer.echo(json.dumps({"revision": current}))
    else:
        typer.echo(f"database at revision {current}")


@db_app.command("current")
def db_current(
    database_url: Annotated[str | None, typer.Option(help="SQLAlchemy URL.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Print the schema revision of the database."""
    from metadata_service.migrate import current_revision

    current = current_revision(database_url or get_settings().database_url)
    typer.echo(json.dumps({"revision": current}) if as_json else str(current))


def main() -> None:
    app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False)
    app.command("serve")(serve_command)
    app.add_typer(db_app, name="db")
    app()
