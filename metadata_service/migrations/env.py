"""Alembic environment: the URL or an open connection comes from ``metadata_service.migrate``."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context

from metadata_service.store.tables import metadata as target_metadata

config = context.config


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        context.configure(connection=connection, target_metadata=target_metadata)
        with context.begin_transaction():
            context.run_migrations()
        return
    url = config.attributes.get("database_url") or config.get_main_option("sqlalchemy.url")
    engine = sa.create_engine(str(url), poolclass=sa.pool.NullPool)
    with engine.connect() as conn:
        context.configure(connection=conn, target_metadata=target_metadata)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


def run_migrations_offline() -> None:
    url = config.attributes.get("database_url") or config.get_main_option("sqlalchemy.url")
    context.configure(url=url, target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
