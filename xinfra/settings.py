"""The one settings object.  Environment prefix ``XINFRA_``; every URL has a local default.

The defaults are the embedded local stack that ``xinfra up`` runs, so that
every command works on a fresh machine with no configuration.  Production sets
the URLs (``XINFRA_DATABASE_URL=mysql+pymysql://...``, ``XINFRA_ZOOKEEPER=...``).
Names carry their unit.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

RENAMED = {"XINFRA_NORTHGUARD_HTTP_PORT": "XINFRA_NORTHGUARD_HTTP_PORTS"}
"""Settings that were renamed: the old name would otherwise be ignored without a word."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="XINFRA_", extra="ignore")

    def __init__(self, **values: Any) -> None:
        for old, new in RENAMED.items():
            if old in os.environ and new not in os.environ:
                raise ValueError(f"{old} was renamed {new}; set {new} instead")
        super().__init__(**values)

    run_dir: Path = Field(
        default=Path(".xinfra"), description="Where `xinfra up` keeps data and logs."
    )

    # The metadata service.
    metadata_url: str = "http://127.0.0.1:8780"
    token: str | None = None
    virtual_cluster: str = "default"
    database_url: str = "sqlite:///.xinfra/metadata.db"
    zookeeper: str = "127.0.0.1:2181"
    cache_url: str = "memory://"
    """Checkpoint cache: memory://, redis://host:port/db or couchbase://host/bucket."""

    # Physical clusters of the local stack.
    kafka_bootstrap: str = "127.0.0.1:9092"
    northguard_bootstrap: str = "127.0.0.1:9470,127.0.0.1:9472,127.0.0.1:9474"
    """The local Northguard cluster: its brokers' client addresses, comma-separated, the
    coordinator first.  ``xinfra up`` runs one broker per address as one cluster and registers
    ``northguard-local`` with this bootstrap."""
    northguard_http_ports: str = "9471,9473,9475"
    """Health and metrics ports (``/health``, ``/metrics``) of those brokers, in the same order."""
    northguard_replication_factor: int = 3
    """Replicas of every new segment in the local Northguard cluster (at most its broker count),
    and copies of its coordinator's metadata journal."""

    # A Northguard broker's own options (segment size and age, group commit, frame bound) are
    # flags of its command, each with an ``XINFRA_`` variable (``xinfra northguard broker
    # --help``), as its secret and TLS files are: importing this object (pydantic-settings) was
    # 0.13 s of every broker start.

    # Client bounds.
    request_timeout_s: float = 30.0
    long_poll_s_max: float = 30.0

    # Metadata service (issue 4).  Bounds carry their unit; see metadata_service/config.py.
    admin_token: str | None = None
    """A bootstrap admin token (all virtual clusters) the service accepts; set it from a secret."""
    metadata_notify: str = "auto"
    """How instances wake each other's long-polls: zookeeper, local, or auto (local for SQLite)."""
    long_poll_waiters_max: int = 10_000
    metadata_cache_topics_max: int = 100_000
    client_ttl_s_max: float = 300.0
    request_bytes_max: int = 4 << 20


LOCAL_STACK_FIELDS = (
    "metadata_url",
    "zookeeper",
    "kafka_bootstrap",
    "northguard_bootstrap",
    "northguard_http_ports",
)


def with_local_stack(settings: Settings) -> Settings:
    """Fill what ``XINFRA_*`` leaves unset from the local stack, so any shell finds it.

    The order is: ``XINFRA_*`` settings; then the user config that ``xinfra up``
    writes (``$XDG_CONFIG_HOME/xinfra/stack.json``: run directory, URLs, token
    file) when the stack it names still runs; then the repository's run
    directory (``.xinfra`` in the current directory, else beside the package of
    a source checkout).  The token is then found as ``<run_dir>/admin-token``.
    """
    from xinfra.services.state import live_stack, read_user_config

    explicit = settings.model_fields_set
    updates: dict[str, object] = {}
    if live_stack() is not None:
        config = read_user_config() or {}
        if "run_dir" not in explicit:
            updates["run_dir"] = Path(config["run_dir"])
        for name in LOCAL_STACK_FIELDS:
            if name not in explicit and name in config:
                updates[name] = config[name]
    elif "run_dir" not in explicit and not settings.run_dir.exists():
        checkout = Path(__file__).resolve().parent.parent / ".xinfra"
        if checkout.is_dir():
            updates["run_dir"] = checkout
    return settings.model_copy(update=updates) if updates else settings


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read from the environment (and the local stack) once."""
    return with_local_stack(Settings())
