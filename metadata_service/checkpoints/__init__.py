"""Consumer-group checkpoints: a coalescing buffer into MySQL, and a cache in front for reads.

Public surface: ``CheckpointService`` (commit, read, reset, delete),
``CheckpointCache`` and its adapters (``MemoryCache``, ``RedisCache``,
``CouchbaseCache``), ``open_cache`` to pick one from a URL.
"""

from metadata_service.checkpoints.cache import CheckpointCache, MemoryCache, RedisCache, open_cache
from metadata_service.checkpoints.service import CheckpointService

__all__ = ["CheckpointCache", "CheckpointService", "MemoryCache", "RedisCache", "open_cache"]
