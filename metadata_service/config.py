"""The service's configuration: ``xinfra.settings`` resolved once, plus what tests inject.

Everything the service bounds is here with its unit, so that one place says how
large a long-poll, a request or a cache may grow.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from xinfra.backend import Backend, open_backend
from xinfra.model import PhysicalCluster
from xinfra.settings import Settings, get_settings

BackendFactory = Callable[[PhysicalCluster], Backend]


@dataclass(frozen=True)
class ServiceConfig:
    database_url: str = "sqlite:///.xinfra/metadata.db"
    zookeeper: str | None = None
    """ZooKeeper connect string for cross-instance notifications; None: in-process only."""
    run_dir: Path = Path(".xinfra")
    admin_token: str | None = None
    auto_upgrade: bool = True
    """Apply Alembic migrations on start (the embedded default); production runs `xinfra db upgrade`."""
    zk_root: str = "/xinfra/metadata"
    long_poll_s_max: float = 30.0
    northguard_credential_ttl_s: float = 900.0
    """Lifetime of the Northguard credentials signed into topic metadata (re-signed past half of
    it); clients refresh them by their long-poll, so keep it well above ``long_poll_s_max``."""
    long_poll_waiters_max: int = 10_000
    cache_topics_max: int = 100_000
    client_ttl_s_default: float = 30.0
    client_ttl_s_max: float = 300.0
    client_purge_interval_s: float = 1.0
    client_purge_batch_max: int = 1000
    clients_per_vcluster_max: int = 100_000
    request_bytes_max: int = 4 << 20
    token_cache_s: float = 5.0
    """A revoked token may still be accepted for this long by an instance that cached it."""
    token_cache_max: int = 10_000
    auth_failures_per_s: float = 5.0
    auth_failures_burst: int = 50
    """Unknown-token attempts a peer (IP address) may make: a token bucket of this size, refilled
    at ``auth_failures_per_s``; past it, 429 without a database lookup."""
    token_creations_per_s: float = 1.0
    token_creations_burst: int = 100
    """Tokens the service creates: a token bucket over all admins (each token is a row for ever)."""
    connections_max: int = 1000
    """Open HTTP connections; one more is closed on accept (uvicorn's ``limit_concurrency`` too)."""
    header_timeout_s: float = 10.0
    """A connection that has not sent a whole request head this long after it opened (or after
    its previous response) is closed."""
    keep_alive_s: float = 5.0
    header_bytes_max: int = 16 << 10
    """The largest request head (request line and headers) h11 buffers."""
    seal_settle_s_max: float = 30.0
    """How long a seal waits for live producers to acknowledge the version that retires an epoch
    before it reads the epoch's end offsets, counted from the seal (see ``metadata_service.settle``)."""
    intent_grace_s: float = 60.0
    """Reconcile leaves an intent younger than this alone: an instance may still be executing it."""
    db_threads_max: int = 32
    db_pool_size: int = 16
    backend_timeout_s: float = 30.0
    list_limit_max: int = 1000
    instance_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    advertised_url: str | None = None
    """This instance's URL as other instances and clients reach it (group requests are redirected here)."""
    group_session_s: float = 10.0
    """A consumer-group member that has not heartbeated for this long is removed and its shards move."""
    group_heartbeat_s: float = 0.5
    group_zk_session_s: float = 6.0
    """ZooKeeper session of the group coordinator: another instance takes its groups over this long
    after it dies (at once after a clean stop)."""
    checkpoint_cache: str = "memory://"
    """memory://, redis://host:port/db or couchbase://host/bucket?username=..&password=.."""
    checkpoint_flush_s: float = 0.005
    """The longest a batch of commits waits while an earlier flush is still out; with none
    out it is flushed at once (group commit: ``metadata_service.checkpoints.buffer``)."""
    checkpoint_buffer_keys_max: int = 10_000
    migration_orphan_check_s: float = 30.0
    """How often the records past sealed Kafka sources' end offsets are counted (the gauge
    ``xinfra_migration_orphaned_records``); 0 checks only when a status is asked."""
    backend_factory: BackendFactory = open_backend

    @classmethod
    def from_settings(cls, settings: Settings | None = None, **overrides: Any) -> ServiceConfig:
        """Resolve ``XINFRA_*`` settings; ``metadata_notify=auto`` uses ZooKeeper unless the store is SQLite."""
        s = settings or get_settings()
        mode = s.metadata_notify
        if mode not in ("auto", "zookeeper", "local"):
            raise ValueError(f"XINFRA_METADATA_NOTIFY={mode!r}: use auto, zookeeper or local")
        use_zk = mode == "zookeeper" or (mode == "auto" and not s.database_url.startswith("sqlite"))
        config = cls(
            database_url=s.database_url,
            zookeeper=s.zookeeper if use_zk else None,
            run_dir=s.run_dir,
            admin_token=s.admin_token,
            long_poll_s_max=s.long_poll_s_max,
            long_poll_waiters_max=s.long_poll_waiters_max,
            cache_topics_max=s.metadata_cache_topics_max,
            client_ttl_s_max=s.client_ttl_s_max,
            request_bytes_max=s.request_bytes_max,
            backend_timeout_s=s.request_timeout_s,
            checkpoint_cache=s.cache_url,
        )
        return replace(config, **overrides)
