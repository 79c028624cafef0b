"""The store: SQLAlchemy Core tables and the repository that is the only code writing SQL."""

from metadata_service.store.repository import MetadataStore

__all__ = ["MetadataStore"]
