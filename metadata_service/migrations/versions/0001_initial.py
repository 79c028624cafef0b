"""The initial schema: clusters, virtual clusters, topics, epochs, clients, API tokens.

Revision ID: 0001
Revises:
Create Date: 2025-01-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

LongText = sa.Text().with_variant(mysql.MEDIUMTEXT(), "mysql", "mariadb")


def upgrade() -> None:
    op.create_table(
        "physical_clusters",
        sa.Column("name", sa.String(200), primary_key=True),
        sa.Column("kind", sa.String(20), nullable=False),
        sa.Column("bootstrap", sa.String(1000), nullable=False),
        sa.Column("attributes", sa.Text, nullable=False),
        sa.Column("version", sa.BigInteger, nullable=False),
        sa.Column("updated_ms", sa.BigInteger, nullable=False),
    )
    op.create_table(
        "virtual_clusters",
        sa.Column("name", sa.String(200), primary_key=True),
        sa.Column("description", sa.String(1000), nullable=False),
        sa.Column("version", sa.BigInteger, nullable=False),
        sa.Column("updated_ms", sa.BigInteger, nullable=False),
    )
    op.create_table(
        "topics",
        sa.Column("virtual_cluster", sa.String(200), primary_key=True),
        sa.Column("name", sa.String(200), primary_key=True),
        sa.Column("config", sa.Text, nullable=False),
        sa.Column("sealed", sa.Boolean, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("version", sa.BigInteger, nullable=False),
        sa.Column("updated_ms", sa.BigInteger, nullable=False),
    )
    op.create_table(
        "epochs",
        sa.Column("virtual_cluster", sa.String(200), primary_key=True),
        sa.Column("topic", sa.String(200), primary_key=True),
        sa.Column("number", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("cluster", sa.String(200), nullable=False),
        sa.Column("physical_topic", sa.String(249), nullable=False),
        sa.Column("shards", LongText, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("end_offsets", LongText, nullable=True),
        sa.Column("mirror_of", sa.Integer, nullable=True),
        sa.Column("intent", sa.String(16), nullable=False),
        sa.Column("updated_ms", sa.BigInteger, nullable=False),
    )
    op.create_index("ix_epochs_cluster", "epochs", ["cluster"])
    op.create_table(
        "clients",
        sa.Column("virtual_cluster", sa.String(200), primary_key=True),
        sa.Column("client_id", sa.String(200), primary_key=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("topics", sa.Text, nullable=False),
        sa.Column("acked", sa.Text, nullable=False),
        sa.Column("ttl_s", sa.Float, nullable=False),
        sa.Column("registered_ms", sa.BigInteger, nullable=False),
        sa.Column("heartbeat_ms", sa.BigInteger, nullable=False),
        sa.Column("expires_ms", sa.BigInteger, nullable=False),
        sa.Column("version", sa.BigInteger, nullable=False),
    )
    op.create_index("ix_clients_expires", "clients", ["expires_ms"])
    op.create_table(
        "api_tokens",
        sa.Column("token_hash", sa.String(64), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False, unique=True),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("scope", sa.String(200), nullable=False),
        sa.Column("created_ms", sa.BigInteger, nullable=False),
    )


def downgrade() -> None:
    for table in (
        "api_tokens",
        "clients",
        "epochs",
        "topics",
        "virtual_clusters",
        "physical_clusters",
    ):
        op.drop_table(table)
