"""The Xinfra metadata service (DESIGN.md §4).

Public surface: ``create_app`` (the FastAPI factory), ``ServiceConfig`` and
``upgrade_database`` (Alembic, programmatic).  The service depends on
``xinfra`` only; clients talk to it over HTTP (``xinfra.rest``).
"""

from metadata_service.app import create_app
from metadata_service.config import ServiceConfig
from metadata_service.migrate import upgrade_database

__all__ = ["ServiceConfig", "create_app", "upgrade_database"]
