"""Topic-metadata cache misses, coalesced: one store query per batch of topics, on the event loop.

Why: every miss was a store call on a worker thread (SQLAlchemy's pool
checkout with its pre-ping, the query, the rollback on return: three round
trips) and about 270 us of GIL-holding Python per batch, then the models'
validation and dump.  Under the 90%-hit mix those threads convoyed with the
event loop on the GIL, and the loop's cached answers queued behind them: the
mix's p99 was 20+ ms where a hit costs microseconds.  On MySQL the batches
now go through one asyncmy connection of the loop's own (a Cython protocol:
50 us of CPU for a batch of one, 4 us a topic in a batch of 16, and no thread
to hand the GIL to), straight into the JSON bodies (``metadata_body``); other
databases (SQLite) keep the worker thread (``MetadataStore.read_metadata_bodies``).

One batch is in flight at a time; misses arriving meanwhile queue for the
next batch, so the batch grows with the load (at most ``batch_topics_max``
topics per query, which also bounds how long one batch's rows hold the loop)
and the round trips do not.

Freshness: a miss joins only a batch that has not started, so its read starts
after the miss arrived and sees every change committed before it (the
connection autocommits: each query is its own snapshot).  Misses of the same
topic queued together share one read.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import asyncmy
import asyncmy.errors
from sqlalchemy.engine import URL

from metadata_service.notify import TopicKey
from metadata_service.runtime import Runtime
from metadata_service.store.repository import (
    MetadataBody,
    metadata_body,
    read_metadata_mysql,
)
from xinfra.errors import Unavailable

BATCH_TOPICS_MAX = 32
"""Topics per store query (the IN list of one round trip); its rows become bodies in one go on
the loop, ~20 us a topic."""

READ_TIMEOUT_S = 10.0
"""How long a batch may wait for MySQL (connecting included) before its reads are
``Unavailable``: the pool's wait for a connection on the threaded path."""

_LOST = (OSError, asyncmy.errors.OperationalError, asyncmy.errors.InterfaceError)
"""A connection or server that failed (not a query's error)."""

Fetch = Callable[[Sequence[TopicKey]], Awaitable[dict[TopicKey, MetadataBody | None]]]


class MysqlMetadataReads:
    """``read_metadata_mysql`` on one asyncmy connection, opened on first use and again after
    any failure (a broken or timed-out connection is closed, never reused).  Event-loop only;
    one query at a time (``MetadataReader`` runs one batch at a time)."""

    def __init__(self, url: URL, timeout_s: float = READ_TIMEOUT_S) -> None:
        self.options: dict[str, Any] = {
            "host": url.host or "localhost",
            "port": url.port or 3306,
            "user": url.username or "",
            "password": url.password or "",
            "database": url.database,
            "charset": str(url.query.get("charset", "utf8mb4")),
            "autocommit": True,
        }
        if "unix_socket" in url.query:
            self.options["unix_socket"] = str(url.query["unix_socket"])
        self.timeout_s = timeout_s
        self._connection: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @staticmethod
    def supports(url: URL) -> bool:
        """Whether ``url`` is a MySQL database this can reach as the store's engine does (TLS
        and other driver options are left to the threaded path)."""
        return url.get_backend_name() in ("mysql", "mariadb") and set(url.query) <= {
            "charset",
            "unix_socket",
        }

    async def __call__(self, keys: Sequence[TopicKey]) -> dict[TopicKey, MetadataBody | None]:
        statement = read_metadata_mysql(len(keys))
        arguments = [part for key in keys for part in key]
        try:
            async with asyncio.timeout(self.timeout_s):
                reused = self._connection is not None and self._loop is asyncio.get_running_loop()
                try:
                    found = await self._query(statement, arguments)
                except _LOST:
                    if not reused:
                        raise
                    # The server closed it while it was idle (wait_timeout, a restart): a read
                    # is safe to repeat, on a new connection.
                    self._drop()
                    found = await self._query(statement, arguments)
        except BaseException as error:
            self._drop()
            if isinstance(error, (*_LOST, TimeoutError)):
                raise Unavailable(f"the metadata database is unavailable: {error}") from None
            raise
        rows: dict[TopicKey, list[Any]] = {key: [] for key in keys}
        for row in found:
            rows[(row[0], row[1])].append(row)
        return {key: metadata_body(key, topic_rows) for key, topic_rows in rows.items()}

    async def _query(self, statement: str, arguments: list[str]) -> Sequence[Any]:
        loop = asyncio.get_running_loop()
        if self._connection is not None and self._loop is not loop:
            self._drop()  # made on another loop (a test's earlier one): unusable here
        if self._connection is None:
            self._connection = await asyncmy.connect(**self.options)
            self._loop = loop
        async with self._connection.cursor() as cursor:
            await cursor.execute(statement, arguments)
            rows: Sequence[Any] = await cursor.fetchall()
            return rows

    def _drop(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            with contextlib.suppress(Exception):  # its loop may be closed already
                connection.close()

    async def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None and self._loop is asyncio.get_running_loop():
            with contextlib.suppress(Exception):
                await connection.ensure_closed()
        elif connection is not None:
            with contextlib.suppress(Exception):
                connection.close()


class MetadataReader:
    """Reads topic-metadata bodies from the store in batches.  Event-loop only."""

    def __init__(self, runtime: Runtime, batch_topics_max: int = BATCH_TOPICS_MAX) -> None:
        self.rt = runtime
        self.batch_topics_max = batch_topics_max
        url = runtime.store.engine.url
        self._mysql = MysqlMetadataReads(url) if MysqlMetadataReads.supports(url) else None
        self.fetch: Fetch = self._mysql if self._mysql is not None else self._threaded
        """One batch's read: (version, body) of each key, None for a topic not visible."""
        self._queued: dict[TopicKey, asyncio.Future[MetadataBody | None]] = {}
        self._draining: asyncio.Task[None] | None = None

    async def _threaded(self, keys: Sequence[TopicKey]) -> dict[TopicKey, MetadataBody | None]:
        return await self.rt.db(self.rt.store.read_metadata_bodies, keys)

    async def read(self, key: TopicKey) -> MetadataBody | None:
        """The topic's version and client view, None when it is not visible; store errors
        are raised."""
        future = self._queued.get(key)
        if future is None:
            future = asyncio.get_running_loop().create_future()
            self._queued[key] = future
            if self._draining is None or self._draining.done():
                self._draining = asyncio.create_task(self._drain(), name="metadata-reader")
        # Shielded: one caller giving up must not cancel the read the others wait for.
        return await asyncio.shield(future)

    async def _drain(self) -> None:
        """Run batches until nothing is queued; every future gets its result or the error."""
        while self._queued:
            keys = list(itertools.islice(self._queued, self.batch_topics_max))
            batch = {key: self._queued.pop(key) for key in keys}
            try:
                found = await self.fetch(keys)
            except Exception as error:
                for future in batch.values():
                    future.set_exception(error)
                    future.exception()  # retrieved here: a caller that gave up leaves no warning
                continue
            for key, future in batch.items():
                future.set_result(found[key])

    async def close(self) -> None:
        """Close the MySQL connection, if one is open (the app's lifespan ends with this)."""
        if self._mysql is not None:
            await self._mysql.close()
