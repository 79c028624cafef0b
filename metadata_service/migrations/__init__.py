"""Alembic migrations of the metadata store (applied by ``xinfra db upgrade`` or on start)."""
