"""The relational schema, as SQLAlchemy Core tables (the Alembic migrations freeze it).

Vitess rules kept: every table scoped to a virtual cluster has a primary key
that leads with ``virtual_cluster`` (the sharding key), so a topic, its epochs
and the clients of that virtual cluster live on one shard and every
transaction the service runs touches one shard.  ``physical_clusters``,
``virtual_clusters`` and ``api_tokens`` are small reference tables
(unsharded keyspace).  There are no foreign keys: integrity across tables is
the service's job (intent columns, reconcile).

Every name column has a binary collation on MySQL/MariaDB (revision 0005):
names are compared exactly, as the service's scope checks compare them.

Mutable rows carry a ``version`` for optimistic concurrency.  JSON values are
text (portable across SQLite, MySQL and Vitess).  Times are integer
milliseconds since the epoch (no time-zone surprises across drivers).
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import mysql

LongText = sa.Text().with_variant(mysql.MEDIUMTEXT(), "mysql", "mariadb")


def _exact(length: int) -> sa.types.TypeEngine[str]:
    """A name column compared byte for byte: MySQL's default collations ignore case (0005)."""
    return sa.String(length).with_variant(
        mysql.VARCHAR(length, charset="utf8mb4", collation="utf8mb4_bin"), "mysql", "mariadb"
    )


Name = _exact(200)

metadata = sa.MetaData()

physical_clusters = sa.Table(
    "physical_clusters",
    metadata,
    sa.Column("name", Name, primary_key=True),
    sa.Column("kind", sa.String(20), nullable=False),
    sa.Column("bootstrap", sa.String(1000), nullable=False),
    sa.Column("attributes", sa.Text, nullable=False),
    sa.Column("version", sa.BigInteger, nullable=False),
    sa.Column("updated_ms", sa.BigInteger, nullable=False),
)

virtual_clusters = sa.Table(
    "virtual_clusters",
    metadata,
    sa.Column("name", Name, primary_key=True),
    sa.Column("description", sa.String(1000), nullable=False),
    sa.Column("version", sa.BigInteger, nullable=False),
    sa.Column("updated_ms", sa.BigInteger, nullable=False),
)

topics = sa.Table(
    "topics",
    metadata,
    sa.Column("virtual_cluster", Name, primary_key=True),
    sa.Column("name", Name, primary_key=True),
    sa.Column("config", sa.Text, nullable=False),
    sa.Column("sealed", sa.Boolean, nullable=False),
    sa.Column("state", sa.String(16), nullable=False),  # creating | active | deleting
    sa.Column("version", sa.BigInteger, nullable=False),  # the TopicMetadata version
    sa.Column("updated_ms", sa.BigInteger, nullable=False),
)

epochs = sa.Table(
    "epochs",
    metadata,
    sa.Column("virtual_cluster", Name, primary_key=True),
    sa.Column("topic", Name, primary_key=True),
    sa.Column("number", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("cluster", Name, nullable=False),
    sa.Column("physical_topic", _exact(249), nullable=False),
    sa.Column("shards", LongText, nullable=False),  # JSON list of [start, end] decimal strings
    sa.Column("state", sa.String(16), nullable=False),  # xinfra.model.EpochState
    sa.Column("end_offsets", LongText, nullable=True),
    sa.Column("mirror_of", sa.Integer, nullable=True),
    sa.Column("intent", sa.String(16), nullable=False),  # creating | ready
    sa.Column("updated_ms", sa.BigInteger, nullable=False),
    sa.Index("ix_epochs_cluster", "cluster"),
)

settles = sa.Table(
    "settles",
    metadata,
    sa.Column("virtual_cluster", Name, primary_key=True),
    sa.Column("topic", Name, primary_key=True),
    sa.Column("epoch", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("version", sa.BigInteger, nullable=False),  # producers must acknowledge this one
    sa.Column("created_ms", sa.BigInteger, nullable=False),  # the wait is bounded from here
)
"""Owed settles: a sealed epoch whose end offsets are still to be read (``metadata_service.settle``)."""

clients = sa.Table(
    "clients",
    metadata,
    sa.Column("virtual_cluster", Name, primary_key=True),
    sa.Column("client_id", Name, primary_key=True),
    sa.Column("kind", sa.String(16), nullable=False),
    sa.Column("host", sa.String(255), nullable=False),
    sa.Column("topics", sa.Text, nullable=False),  # JSON list of topic names
    sa.Column("acked", sa.Text, nullable=False),  # JSON {topic: version}
    sa.Column("ttl_s", sa.Float, nullable=False),
    sa.Column("registered_ms", sa.BigInteger, nullable=False),
    sa.Column("heartbeat_ms", sa.BigInteger, nullable=False),
    sa.Column("expires_ms", sa.BigInteger, nullable=False),
    sa.Column("version", sa.BigInteger, nullable=False),
    # The token (its name) that registered the client: only it heartbeats or re-registers it.
    sa.Column("owner", Name, nullable=False, server_default=""),
    sa.Index("ix_clients_expires", "expires_ms"),
)

api_tokens = sa.Table(
    "api_tokens",
    metadata,
    sa.Column("token_hash", sa.String(64), primary_key=True),  # sha256 hex of the token
    sa.Column("name", Name, nullable=False, unique=True),
    sa.Column("role", sa.String(16), nullable=False),  # admin | client
    sa.Column("scope", Name, nullable=False),  # a virtual cluster, or * for all
    sa.Column("created_ms", sa.BigInteger, nullable=False),
)

checkpoints = sa.Table(
    "checkpoints",
    metadata,
    # The primary key leads with the sharding key: a group's checkpoints live on one shard.
    sa.Column("virtual_cluster", Name, primary_key=True),
    sa.Column("group_name", Name, primary_key=True),
    sa.Column("topic", Name, primary_key=True),
    sa.Column("epoch", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("shard", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("position", sa.BigInteger, nullable=False),  # the next offset to read
    sa.Column("updated_ms", sa.BigInteger, nullable=False),
)

migrations = sa.Table(
    "migrations",
    metadata,
    # One row per topic: its current (or last) migration; a finished one is replaced by a new plan.
    sa.Column("virtual_cluster", Name, primary_key=True),
    sa.Column("topic", Name, primary_key=True),
    sa.Column("body", LongText, nullable=False),  # JSON of migration.machine.Migration
    sa.Column("version", sa.BigInteger, nullable=False),  # compare-and-set between steps
    sa.Column("updated_ms", sa.BigInteger, nullable=False),
)
"""Topic migrations between clusters: state and history (``migration.machine``)."""
