"""Owed settles: the durable intent to record a sealed epoch's end offsets.

A seal without given end offsets is two-phase (``metadata_service.settle``);
the row written with the version that seals survives a crash or a shutdown of
the instance that was waiting, so any instance can finish it.  Epochs already
left sealed without end offsets (by a service that died mid-settle before this
revision) get a row too, owed from now, so the first start finishes them.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23
"""

from __future__ import annotations

import time

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    settles = op.create_table(
        "settles",
        sa.Column("virtual_cluster", sa.String(200), primary_key=True),
        sa.Column("topic", sa.String(200), primary_key=True),
        sa.Column("epoch", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("version", sa.BigInteger, nullable=False),
        sa.Column("created_ms", sa.BigInteger, nullable=False),
    )
    connection = op.get_bind()
    half_sealed = connection.execute(
        sa.text(
            "SELECT e.virtual_cluster, e.topic, e.number, t.version FROM epochs e "
            "JOIN topics t ON t.virtual_cluster = e.virtual_cluster AND t.name = e.topic "
            "WHERE e.state = 'sealed' AND e.end_offsets IS NULL AND e.intent = 'ready'"
        )
    ).all()
    now_ms = int(time.time() * 1000)
    if half_sealed:
        op.bulk_insert(
            settles,
            [
                {
                    "virtual_cluster": row.virtual_cluster,
                    "topic": row.topic,
                    "epoch": row.number,
                    "version": row.version,
                    "created_ms": now_ms,
                }
                for row in half_sealed
            ],
        )


def downgrade() -> None:
    op.drop_table("settles")
