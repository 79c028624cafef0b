"""The clients registry bound to its principal: each client row names the token that registered it.

Rows written before this revision have an empty owner: the next registration
of their id (by any token) claims them; they expire within ``client_ttl_s_max``.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "clients",
        sa.Column(
            "owner",
            sa.String(200).with_variant(
                mysql.VARCHAR(200, charset="utf8mb4", collation="utf8mb4_bin"), "mysql", "mariadb"
            ),
            nullable=False,
            server_default="",
        ),
    )


def downgrade() -> None:
    with op.batch_alter_table("clients") as batch:
        batch.drop_column("owner")
