"""Apply the Alembic migrations programmatically (``xinfra db upgrade`` and start-up)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"


def alembic_config(database_url: str) -> Config:
    """An Alembic config without an ini file; the URL travels in attributes (no % interpolation)."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["database_url"] = database_url
    return config


def prepare_sqlite_path(database_url: str) -> None:
    """Create the directory of a SQLite file (the embedded default lives in the run dir)."""
    prefix = "sqlite:///"
    if database_url.startswith(prefix) and ":memory:" not in database_url:
        Path(database_url.removeprefix(prefix).split("?")[0]).parent.mkdir(
            parents=True, exist_ok=True
        )


def upgrade_database(database_url: str, revision: str = "head") -> None:
    """Bring the schema to ``revision``; idempotent, safe to run on every start."""
    prepare_sqlite_path(database_url)
    command.upgrade(alembic_config(database_url), revision)


def current_revision(database_url: str) -> str | None:
    import sqlalchemy as sa
    from alembic.runtime.migration import MigrationContext

    engine = sa.create_engine(database_url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()
