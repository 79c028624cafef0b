"""Topic migrations: one row per topic holding its migration's state and history.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "migrations",
        sa.Column("virtual_cluster", sa.String(200), primary_key=True),
        sa.Column("topic", sa.String(200), primary_key=True),
        sa.Column(
            "body", sa.Text().with_variant(mysql.MEDIUMTEXT(), "mysql", "mariadb"), nullable=False
        ),
        sa.Column("version", sa.BigInteger, nullable=False),
        sa.Column("updated_ms", sa.BigInteger, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("migrations")
