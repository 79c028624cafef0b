"""What every service shares: the store behind a bounded thread pool, the backends, the notifier.

The store is synchronous SQLAlchemy; ``Runtime.db`` runs a store call on a
worker thread under a capacity limiter (at most ``db_threads_max`` at once,
matching the connection pool) so the event loop never blocks on MySQL.  A
database that cannot be reached becomes ``Unavailable`` (503, retriable).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable
from typing import Any, ParamSpec, TypeVar

import anyio
import anyio.to_thread
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from metadata_service.cluster_secrets import resolve
from metadata_service.config import ServiceConfig
from metadata_service.metrics import ServiceMetrics
from metadata_service.notify import MetadataCache, Notifier, TopicKey
from metadata_service.store.repository import MetadataStore
from xinfra.backend import Backend
from xinfra.errors import BackendUnavailable, Timeout, Unavailable, XinfraError
from xinfra.model import PhysicalCluster

P = ParamSpec("P")
T = TypeVar("T")


class BackendPool:
    """One open ``Backend`` per registered cluster, reused across requests, closed at shutdown.

    Backend calls are bounded in time (``backend_timeout_s``) and every failure
    that is not already an ``XinfraError`` becomes ``BackendUnavailable``.
    """

    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self._backends: dict[tuple[str, str, str], Backend] = {}

    def get(self, cluster: PhysicalCluster) -> Backend:
        key = (cluster.name, cluster.kind.value, cluster.bootstrap)
        backend = self._backends.get(key)
        if backend is None:
            backend = self._open(cluster)
            self._backends[key] = backend
        return backend

    @property
    def open_count(self) -> int:
        return len(self._backends)

    def _open(self, cluster: PhysicalCluster) -> Backend:
        try:
            return self.config.backend_factory(resolve(cluster))
        except XinfraError:
            raise
        except Exception as error:
            raise BackendUnavailable(
                f"cannot open a {cluster.kind.value} backend for {cluster.name!r}: {error}"
            ) from error

    async def probe(self, cluster: PhysicalCluster) -> None:
        """Check a cluster through a backend of its own, closed after: a failed check (of a
        cluster not registered yet) leaves no client reconnecting inside the service."""
        backend = self._open(cluster)
        try:
            await self._bounded(cluster, backend.check())
        finally:
            with contextlib.suppress(Exception):  # closing a broken backend must not mask why
                await backend.close()

    async def call(
        self, cluster: PhysicalCluster, operation: Callable[[Backend], Awaitable[T]]
    ) -> T:
        backend = self.get(cluster)

        async def run() -> T:
            return await operation(backend)

        return await self._bounded(cluster, run())

    async def _bounded(self, cluster: PhysicalCluster, operation: Awaitable[T]) -> T:
        try:
            return await asyncio.wait_for(operation, self.config.backend_timeout_s)
        except XinfraError:
            raise
        except TimeoutError:
            raise Timeout(
                f"physical cluster {cluster.name!r} did not answer in {self.config.backend_timeout_s:.0f} s"
            ) from None
        except Exception as error:
            raise BackendUnavailable(
                f"physical cluster {cluster.name!r} ({cluster.bootstrap}) failed: {error}"
            ) from error

    async def forget(self, name: str) -> None:
        for key in [k for k in self._backends if k[0] == name]:
            backend = self._backends.pop(key)
            # Closing a broken backend must not fail the caller.
            with contextlib.suppress(Exception):
                await backend.close()

    async def close(self) -> None:
        for name in {k[0] for k in self._backends}:
            await self.forget(name)


class Runtime:
    def __init__(
        self,
        config: ServiceConfig,
        store: MetadataStore,
        notifier: Notifier,
        cache: MetadataCache,
        metrics: ServiceMetrics,
    ) -> None:
        self.config = config
        self.store = store
        self.notifier = notifier
        self.hub = notifier.hub
        self.cache = cache
        self.metrics = metrics
        self.backends = BackendPool(config)
        self._limiter = anyio.CapacityLimiter(config.db_threads_max)

    async def db(self, function: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run a store call on a worker thread; database outages become ``Unavailable``."""
        try:
            return await anyio.to_thread.run_sync(
                functools.partial(function, *args, **kwargs), limiter=self._limiter
            )
        except (OperationalError, PoolTimeout) as error:
            raise Unavailable(
                f"the metadata database is unavailable: {getattr(error, 'orig', None) or error}"
            ) from None
        except DBAPIError as error:
            if error.connection_invalidated:
                raise Unavailable(
                    f"the metadata database connection was lost: {error.orig}"
                ) from None
            raise

    async def publish(self, key: TopicKey | None, version: int) -> None:
        self.metrics.version_bumps.inc()
        await self.notifier.publish(key, version)


def first(items: list[Any]) -> Any:
    return items[0] if items else None
