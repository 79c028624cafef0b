"""Exact names: every name column compares byte for byte (``utf8mb4_bin``) on MySQL and MariaDB.

MySQL's and MariaDB's default collations match case-insensitively, so a token
scoped to ``Payments`` (compared exactly by the service) read the rows of the
virtual cluster ``payments`` (matched by the database), and ``Payments``
could not even be created next to it.  A binary collation makes the database
agree with the service: names are case-sensitive everywhere, as Kafka's topic
names are.  (The alternative, lower-case-only names, would have renamed
existing virtual clusters and topics under their clients.)  SQLite already
compares with BINARY: nothing to do there.

The upgrade fails on a database that holds two names equal but for case in
one key (they could not have been written: the old collation refused them).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-24
"""

from __future__ import annotations

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

NAME_COLUMNS: dict[str, dict[str, int]] = {
    "physical_clusters": {"name": 200},
    "virtual_clusters": {"name": 200},
    "topics": {"virtual_cluster": 200, "name": 200},
    "epochs": {"virtual_cluster": 200, "topic": 200, "cluster": 200, "physical_topic": 249},
    "settles": {"virtual_cluster": 200, "topic": 200},
    "clients": {"virtual_cluster": 200, "client_id": 200},
    "api_tokens": {"name": 200, "scope": 200},
    "checkpoints": {"virtual_cluster": 200, "group_name": 200, "topic": 200},
    "migrations": {"virtual_cluster": 200, "topic": 200},
}
"""Table -> name column -> VARCHAR length (all NOT NULL, as 0001-0004 made them)."""


def _modify(collate: str) -> None:
    if op.get_bind().dialect.name not in ("mysql", "mariadb"):
        return
    for table, columns in NAME_COLUMNS.items():
        clauses = ", ".join(
            f"MODIFY `{column}` VARCHAR({length}){collate} NOT NULL"
            for column, length in columns.items()
        )
        op.execute(f"ALTER TABLE `{table}` {clauses}")


def upgrade() -> None:
    _modify(" CHARACTER SET utf8mb4 COLLATE utf8mb4_bin")


def downgrade() -> None:
    _modify("")  # back to the table's default collation
