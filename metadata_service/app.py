"""The FastAPI application factory.

``create_app(config)`` builds one independent service instance (its own
store engine, notifier, cache and metrics registry), so tests can run two in
one process.  The lifespan owns every background task and connection: it
applies migrations (when ``auto_upgrade``), connects ZooKeeper, bootstraps
the first admin token and the ``default`` virtual cluster, runs the client
purge loop, and closes it all on shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import sys
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from metadata_service.auth import TokenService
from metadata_service.clusters import ClusterService
from metadata_service.config import ServiceConfig
from metadata_service.deps import Services
from metadata_service.metrics import MetricsMiddleware, ServiceMetrics
from metadata_service.migrate import prepare_sqlite_path, upgrade_database
from metadata_service.notify import (
    ChangeHub,
    LocalNotifier,
    MetadataCache,
    Notifier,
    ZooKeeperNotifier,
)
from metadata_service.problems import PROBLEM_MEDIA_TYPE, install_problem_handlers
from metadata_service.reconcile import ReconcileService
from metadata_service.registry import RegistryService
from metadata_service.routers import admin, clients, clusters, health, topics
from metadata_service.runtime import Runtime
from metadata_service.schemas import Problem
from metadata_service.store.repository import MetadataStore, make_engine
from metadata_service.topics import TopicService
from xinfra import __version__
from xinfra.errors import XinfraError
from xinfra.model import NAME_PATTERN

log = logging.getLogger(__name__)


class BodyLimitMiddleware:
    """Refuse request bodies over ``limit`` bytes with a 413 problem, before any handler reads them.

    A declared Content-Length is checked up front; a chunked body is read
    into memory up to the limit (never past it) and replayed.
    """

    def __init__(self, app: Any, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def _reject(self, send: Any) -> None:
        body = (
            b'{"type":"https://xinfra.dev/problems/invalid_request","title":"Request too large",'
            b'"status":413,"detail":"the request body exceeds '
            + str(self.limit).encode()
            + b' bytes","code":"invalid_request"}'
        )
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", PROBLEM_MEDIA_TYPE.encode()),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None:
            if not declared.isdigit() or int(declared) > self.limit:
                await self._reject(send)
                return
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, receive, send)
                return
            size += len(message.get("body", b""))
            if size > self.limit:
                await self._reject(send)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


_METADATA_PATH = re.compile(r"^/v1/vclusters/([^/]+)/topics/([^/]+)/metadata$")
_METADATA_ROUTE = SimpleNamespace(path="/v1/vclusters/{vc}/topics/{topic}/metadata")
_NAME = re.compile(NAME_PATTERN)


class MetadataFastPath:
    """Serve cached topic metadata without FastAPI's routing, for the hot read path.

    Only a plain read (no query string) whose token is known and whose topic
    is in the cache is answered here; anything else (a miss, a long-poll, a
    bad name, an unknown token) falls through to the router, which produces
    the same body, or the proper problem, and fills the cache.  The cache is
    the one the change notifications invalidate, so what is served here is
    exactly what the router would serve.  Cuts the per-read CPU by about 3x.
    """

    def __init__(self, app: Any, services: Services) -> None:
        self.app = app
        self.services = services

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "GET" and not scope["query_string"]:
            match = _METADATA_PATH.match(scope["path"])
            if match is not None and await self._try(scope, send, match[1], match[2]):
                return
        await self.app(scope, receive, send)

    async def _try(self, scope: Any, send: Any, vc: str, topic: str) -> bool:
        runtime = self.services.runtime
        if not (_NAME.match(vc) and _NAME.match(topic)) or not runtime.notifier.cache_safe:
            return False
        authorization = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value.decode("latin-1")
                break
        try:
            principal = await self.services.tokens.authenticate(authorization)
        except XinfraError:
            return False
        if not principal.can_read(vc):
            return False
        entry = runtime.cache.get((vc, topic))
        if entry is None:
            return False
        runtime.metrics.cache.labels("hit").inc()
        version, body = entry
        scope["route"] = _METADATA_ROUTE
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"etag", f'"{version}"'.encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
        return True


def build_services(config: ServiceConfig) -> Services:
    metrics = ServiceMetrics()
    hub = ChangeHub(config.long_poll_waiters_max)
    notifier: Notifier
    if config.zookeeper:
        notifier = ZooKeeperNotifier(
            hub, config.zookeeper, config.zk_root, on_received=metrics.notifications.inc
        )
    else:
        notifier = LocalNotifier(hub)
    store = MetadataStore(make_engine(config.database_url, config.db_pool_size))
    runtime = Runtime(config, store, notifier, MetadataCache(hub, config.cache_topics_max), metrics)
    topic_service = TopicService(runtime)
    return Services(
        runtime=runtime,
        tokens=TokenService(runtime),
        clusters=ClusterService(runtime),
        topics=topic_service,
        registry=RegistryService(runtime),
        reconcile=ReconcileService(runtime, topic_service),
    )


def create_app(config: ServiceConfig | None = None) -> FastAPI:
    """One service instance; ``config`` defaults to ``ServiceConfig.from_settings()``."""
    config = config or ServiceConfig.from_settings()
    services = build_services(config)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        runtime = services.runtime
        prepare_sqlite_path(config.database_url)
        if config.auto_upgrade:
            await asyncio.to_thread(upgrade_database, config.database_url)
        await runtime.notifier.start()
        purge: asyncio.Task[None] | None = None
        try:
            token = await services.tokens.ensure_initial_admin()
            if token is not None:
                print(
                    f"xinfra metadata service: initial admin token {token} "
                    f"(saved to {config.run_dir / 'admin-token'})",
                    file=sys.stderr,
                    flush=True,
                )
            await services.clusters.ensure_default_vcluster()
            purge = asyncio.create_task(services.registry.purge_forever(), name="client-purge")
            yield
        finally:
            if purge is not None:
                purge.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await purge
            await runtime.notifier.stop()
            await runtime.backends.close()
            runtime.store.dispose()

    app = FastAPI(
        title="Xinfra metadata service",
        version=__version__,
        description=(
            "Virtual clusters and topics over Kafka and Northguard: epochs, shards, "
            "versioned topic metadata with long-polls, and the clients registry. "
            "Errors are RFC 9457 problem+json with a stable `code`."
        ),
        lifespan=lifespan,
    )
    app.state.services = services
    app.state.config = config
    install_problem_handlers(app)
    for router in (health.router, clusters.router, topics.router, clients.router, admin.router):
        app.include_router(router)
    app.add_middleware(BodyLimitMiddleware, limit=config.request_bytes_max)
    app.add_middleware(MetadataFastPath, services=services)
    app.add_middleware(MetricsMiddleware, metrics=services.runtime.metrics)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title,
                version=app.version,
                description=app.description,
                routes=app.routes,
            )
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components["Problem"] = Problem.model_json_schema()
            # FastAPI's default 422 body is replaced by problem+json everywhere.
            components.pop("HTTPValidationError", None)
            components.pop("ValidationError", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
