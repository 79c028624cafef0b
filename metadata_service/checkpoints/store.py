"""Checkpoint rows in MySQL (or SQLite): one batched upsert per flush, reads per group.

Every statement touches one virtual cluster's rows except the flush, whose
one multi-row upsert may name several virtual clusters; on Vitess the buffer
would split a flush per shard (one statement each), which ``upsert`` allows by
taking any subset of rows.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Iterator, Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from metadata_service.store.repository import open_pool
from metadata_service.store.tables import checkpoints as table

_COLUMNS = ("virtual_cluster", "group_name", "topic", "epoch", "shard", "position", "updated_ms")

_MYSQL_ON_DUPLICATE = (
    "ON DUPLICATE KEY UPDATE position = VALUES(position), updated_ms = VALUES(updated_ms)"
)
FLUSH_CONNECTIONS = 4
"""The upserts' own connections: as many as the buffer has flights (``CoalescingBuffer``)."""
STATEMENT_BYTES_MAX = 1 << 20
"""The largest upsert statement (PyMySQL's own bound when it folds an ``executemany``); a
flush past it is several statements of one transaction."""

PREFIXES_MAX = 100_000
"""Row starts kept across flushes (``CheckpointStore._literal_upserts``); all dropped past it."""
_PLAIN = re.compile(r"[A-Za-z0-9._-]*")
"""Characters that are the same inside a MySQL string literal in any SQL mode."""
CheckpointKey = tuple[str, str, str, int, int]
"""(virtual cluster, group, topic, epoch, shard)."""
GroupCheckpoints = dict[tuple[str, int, int], int]
"""(topic, epoch, shard) -> position (the next offset to read)."""


class CheckpointStore:
    """Synchronous; called from the runtime's bounded thread pool."""

    def __init__(
        self,
        engine: Engine,
        statement_bytes_max: int = STATEMENT_BYTES_MAX,
        flush_connections: int = FLUSH_CONNECTIONS,
    ) -> None:
        self.engine = engine
        self.statement_bytes_max = statement_bytes_max
        self._prefixes: dict[tuple[str, str, str], str] = {}
        """(virtual cluster, group, topic) of plain names -> the start of its rows' literal."""
        self.statements = 0
        """Upsert statements issued (the benchmark reports commits per statement)."""
        self.flush_engine = engine
        """The upserts' own pool on MySQL (``upsert``); the store's engine elsewhere."""
        if engine.dialect.driver == "pymysql":
            self.flush_engine = sa.create_engine(
                engine.url,
                pool_size=flush_connections,
                max_overflow=0,
                pool_pre_ping=False,
                pool_reset_on_return=None,
                pool_recycle=3600,
                pool_timeout=10,
                isolation_level="AUTOCOMMIT",
            )

    def open_pool(self) -> int:
        """Open the upserts' connections now (see ``repository.open_pool``); the count opened."""
        if self.flush_engine is self.engine:
            return 0
        return open_pool(self.flush_engine, self.flush_engine.pool.size())  # type: ignore[attr-defined]

    def close(self) -> None:
        if self.flush_engine is not self.engine:
            self.flush_engine.dispose()

    def upsert(self, rows: Mapping[CheckpointKey, int]) -> None:
        """Write every row in one transaction, in one statement up to ``STATEMENT_BYTES_MAX``
        (last value per key wins).

        On PyMySQL the multi-row INSERT is written here from literals the connection
        escapes (``Connection.escape``, what PyMySQL's own ``executemany`` uses), each
        distinct string once per flush and integers as integers: ``executemany``
        converted every value of every row through its encoders, ~17 us a row (a
        quarter of a commit's service CPU, on a worker thread holding the GIL).
        Elsewhere (SQLite) a raw driver ``executemany``.  Either way no SQL is compiled
        per flush: SQLAlchemy's ``insert().values(rows)`` compiled 1,400 bind parameters
        for 200 rows, 72 ms a flush against 4 ms in MariaDB.

        On MySQL through ``flush_engine``, a pool in autocommit without a ping at checkout
        and without a rollback at return, on the driver's connection (``_upsert_raw``): a
        flush of one statement is one round trip, durable when it returns.
        """
        if not rows:
            return
        now = int(time.time() * 1000)
        if self.flush_engine is not self.engine:
            self._upsert_raw(rows, now)
            return
        with self.engine.begin() as connection:
            params = [
                (vc, group, topic, epoch, shard, position, now)
                for (vc, group, topic, epoch, shard), position in rows.items()
            ]
            connection.exec_driver_sql(self._upsert_sql, params)
        self.statements += 1

    def _upsert_raw(self, rows: Mapping[CheckpointKey, int], now: int) -> None:
        """The upserts on a pooled PyMySQL connection in autocommit: one statement is its own
        transaction; several (past ``statement_bytes_max``) are one, BEGIN to COMMIT.

        The driver's cursor, not SQLAlchemy's execution and transaction: those were half
        the flush thread's CPU (~100 us of ~250 a flush of 88 rows), and their COMMIT a
        second round trip.  A driver error fails the flush as SQLAlchemy would have raised
        it (an ``OperationalError`` for a dropped connection: ``Runtime.db`` makes it
        ``Unavailable``), and the connection is discarded, never reused in an unknown state:
        the commits it held are refused, never acknowledged, and the next flush takes a
        live connection."""
        import pymysql

        connection = self.flush_engine.raw_connection()
        try:
            driver = connection.dbapi_connection
            assert driver is not None, "a pooled connection checked out holds its driver's"
            statements = list(self._literal_upserts(driver, rows, now))
            cursor = driver.cursor()
            if len(statements) > 1:
                cursor.execute("BEGIN")
            for statement in statements:
                # a query as it is: the literals may hold '%', which args would format
                cursor.execute(statement)
                self.statements += 1
            if len(statements) > 1:
                cursor.execute("COMMIT")
            cursor.close()
        except pymysql.err.Error as error:
            connection.invalidate(error)
            lost = isinstance(error, pymysql.err.OperationalError | pymysql.err.InterfaceError)
            raise sa.exc.DBAPIError.instance(
                None, None, error, pymysql.err.Error, connection_invalidated=lost
            ) from error
        except BaseException as error:
            connection.invalidate(error)
            raise
        finally:
            connection.close()

    def _literal_upserts(
        self, raw: Any, rows: Mapping[CheckpointKey, int], now: int
    ) -> Iterator[str]:
        """MySQL upserts of ``rows``, each at most ``STATEMENT_BYTES_MAX`` bytes of SQL (one
        row always fits: names are bounded to 200 characters)."""
        head = f"INSERT INTO {table.name} ({', '.join(_COLUMNS)}) VALUES "
        tail = f" {_MYSQL_ON_DUPLICATE}"
        escaped: dict[str, str] = {}
        prefixes = self._prefixes

        def literal(text: str) -> str:
            found = escaped.get(text)
            if found is None:
                found = escaped[text] = raw.escape(text)
            return found

        def prefix_of(vc: str, group: str, topic: str) -> str:
            names = (vc, group, topic)
            # Names of the naming rule's characters need no escaping: quoted as they are, and
            # the row's start kept across flushes (its group commits again); other names
            # through the driver's escape, each once a flush.
            if all(_PLAIN.fullmatch(name) for name in names):
                if len(prefixes) >= PREFIXES_MAX:
                    prefixes.clear()
                found = prefixes[names] = f"('{vc}','{group}','{topic}',"
                return found
            return f"({literal(vc)},{literal(group)},{literal(topic)},"

        values: list[str] = []
        size = len(head) + len(tail)
        for (vc, group, topic, epoch, shard), position in rows.items():
            start = prefixes.get((vc, group, topic)) or prefix_of(vc, group, topic)
            # :d formats integers only (a str would raise, never reach the SQL)
            row = f"{start}{epoch:d},{shard:d},{position:d},{now:d})"
            if values and size + len(row) + 1 > self.statement_bytes_max:
                yield head + ",".join(values) + tail
                values, size = [], len(head) + len(tail)
            values.append(row)
            size += len(row) + 1
        yield head + ",".join(values) + tail

    @functools.cached_property
    def _upsert_sql(self) -> str:
        dialect = self.engine.dialect
        marks = ", ".join(["?" if dialect.paramstyle == "qmark" else "%s"] * len(_COLUMNS))
        insert = f"INSERT INTO {table.name} ({', '.join(_COLUMNS)}) VALUES ({marks})"
        if dialect.name in ("mysql", "mariadb"):
            return f"{insert} {_MYSQL_ON_DUPLICATE}"
        keys = ", ".join(c.name for c in table.primary_key.columns)
        return (
            f"{insert} ON CONFLICT ({keys}) DO UPDATE SET "
            "position = excluded.position, updated_ms = excluded.updated_ms"
        )

    def read_group(self, vc: str, group: str) -> GroupCheckpoints:
        query = sa.select(table.c.topic, table.c.epoch, table.c.shard, table.c.position).where(
            table.c.virtual_cluster == vc, table.c.group_name == group
        )
        with self.engine.connect() as connection:
            return {(r.topic, r.epoch, r.shard): r.position for r in connection.execute(query)}

    def delete_group(
        self, vc: str, group: str, topic: str | None = None, epoch: int | None = None
    ) -> int:
        """Delete the group's rows: all, one topic's, or one topic's in one epoch."""
        where = [table.c.virtual_cluster == vc, table.c.group_name == group]
        if topic is not None:
            where.append(table.c.topic == topic)
        if epoch is not None:
            assert topic is not None, "an epoch is one topic's"
            where.append(table.c.epoch == epoch)
        with self.engine.begin() as connection:
            return int(connection.execute(sa.delete(table).where(*where)).rowcount)

    def list_groups(self, vc: str) -> list[str]:
        query = (
            sa.select(table.c.group_name)
            .where(table.c.virtual_cluster == vc)
            .distinct()
            .order_by(table.c.group_name)
        )
        with self.engine.connect() as connection:
            return [r.group_name for r in connection.execute(query)]
