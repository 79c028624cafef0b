"""Consumer-group checkpoints, keyed (virtual cluster, group, topic, epoch, shard).

The primary key leads with ``virtual_cluster`` (the Vitess sharding key), so
one batched upsert of a group's checkpoints touches one shard.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "checkpoints",
        sa.Column("virtual_cluster", sa.String(200), primary_key=True),
        sa.Column("group_name", sa.String(200), primary_key=True),
        sa.Column("topic", sa.String(200), primary_key=True),
        sa.Column("epoch", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("shard", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("position", sa.BigInteger, nullable=False),
        sa.Column("updated_ms", sa.BigInteger, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("checkpoints")
