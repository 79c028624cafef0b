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
from pydantic import ValidationError

from metadata_service.auth import TokenService
from metadata_service.clusters import ClusterService
from metadata_service.config import ServiceConfig
from metadata_service.deps import Services
from metadata_service.gate import RequestGate, peer_of
from metadata_service.groups import Groups, build_groups
from metadata_service.groups.schemas import CommitIn
from metadata_service.hot_routes import HotRoutes
from metadata_service.metrics import MetricsMiddleware, ServiceMetrics
from metadata_service.migrate import prepare_sqlite_path, upgrade_database
from metadata_service.notify import (
    ChangeHub,
    LocalNotifier,
    MetadataCache,
    Notifier,
    ZooKeeperNotifier,
)
from metadata_service.problems import (
    error_response,
    install_problem_handlers,
)
from metadata_service.reconcile import ReconcileService
from metadata_service.registry import RegistryService
from metadata_service.routers import admin, checkpoints, clients, clusters, groups, health, topics
from metadata_service.routers import migrations as migrations_router
from metadata_service.runtime import Runtime
from metadata_service.schemas import Problem
from metadata_service.settle import SettleService
from metadata_service.store.repository import MetadataStore, make_engine
from metadata_service.topics import TopicService
from migration.service import MigrationService
from xinfra import __version__
from xinfra.errors import NotCoordinator, XinfraError
from xinfra.names import NAME_PATTERN

log = logging.getLogger(__name__)


_METADATA_PATH = re.compile(r"^/v1/vclusters/([^/]+)/topics/([^/]+)/metadata$")
_METADATA_ROUTE = SimpleNamespace(path="/v1/vclusters/{vc}/topics/{topic}/metadata")
_NAME = re.compile(NAME_PATTERN)
_COMMIT_PATH = re.compile(r"^/v1/vclusters/([^/]+)/groups/([^/]+)/commit$")
_COMMIT_ROUTE = SimpleNamespace(path="/v1/vclusters/{vc}/groups/{group}/commit")


class MetadataFastPath:
    """Serve plain topic-metadata reads and checkpoint commits without FastAPI's routing.

    Under ``metadata_service.server``'s httptools protocol the hot routes
    (``metadata_service.hot_routes``) answer cache hits and commits before any
    ASGI layer; this middleware serves what they hand on (cache misses, a
    group to claim, a token to look up) and every request under h11.

    A GET of ``/v1/vclusters/{vc}/topics/{topic}/metadata`` without a query
    string, whose names are valid and whose token may read ``vc``, is answered
    here by ``TopicService.metadata_body`` (the cache, else one store query),
    its errors as the same problem+json the router's handler writes.  Anything
    else (a long-poll, a bad name, a missing, unknown or out-of-scope token)
    falls through to the router, which answers it.  FastAPI's dependency
    solving and validation cost more than a cache hit and a third of a miss.

    A POST of ``/v1/vclusters/{vc}/groups/{group}/commit`` (the hot write path:
    every consumer commits every few seconds) is validated with the router's
    ``CommitIn`` and committed here, 204 once durable; a body the model
    refuses, a missing or oversized Content-Length and a group coordinated
    elsewhere (the 307) go to the router, the body replayed to it.
    """

    def __init__(self, app: Any, services: Services, groups: Groups, body_max: int) -> None:
        self.app = app
        self.services = services
        self.groups = groups
        self.body_max = body_max

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and not scope["query_string"]:
            if scope["method"] == "GET":
                match = _METADATA_PATH.match(scope["path"])
                if match is not None and await self._try(scope, receive, send, match[1], match[2]):
                    return
            elif scope["method"] == "POST":
                match = _COMMIT_PATH.match(scope["path"])
                if match is not None and await self._commit(
                    scope, receive, send, match[1], match[2]
                ):
                    return
        await self.app(scope, receive, send)

    async def _reader(self, scope: Any, vc: str) -> bool:
        """Whether the request's bearer token may read ``vc`` (False: the router answers)."""
        authorization = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value.decode("latin-1")
                break
        try:
            principal = await self.services.tokens.authenticate(authorization, peer_of(scope))
        except XinfraError:
            return False
        return principal.can_read(vc)

    async def _commit(self, scope: Any, receive: Any, send: Any, vc: str, group: str) -> bool:
        if not (_NAME.match(vc) and _NAME.match(group)):
            return False
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), b"")
        if not declared.isdigit() or int(declared) > self.body_max:
            return False
        if not await self._reader(scope, vc):
            return False
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return True  # the client went away
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        data = b"".join(chunks)

        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": data, "more_body": False}

        scope["route"] = _COMMIT_ROUTE
        try:
            body = CommitIn.model_validate_json(data)
        except ValidationError:
            await self.app(scope, replay, send)
            return True
        try:
            await self.groups.coordinator.commit(
                vc,
                group,
                body.member_id,
                body.member_epoch,
                [(p.topic, p.epoch, p.shard, p.offset) for p in body.positions],
            )
        except NotCoordinator:
            await self.app(scope, replay, send)  # the router's handler writes the 307
            return True
        except XinfraError as error:
            await error_response(error, scope["path"])(scope, receive, send)
            return True
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        return True

    async def _try(self, scope: Any, receive: Any, send: Any, vc: str, topic: str) -> bool:
        if not (_NAME.match(vc) and _NAME.match(topic)):
            return False
        if not await self._reader(scope, vc):
            return False
        scope["route"] = _METADATA_ROUTE
        try:
            version, body = await self.services.topics.metadata_body(vc, topic)
        except XinfraError as error:
            await error_response(error, scope["path"])(scope, receive, send)
            return True
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
    settles = SettleService(runtime)
    topic_service = TopicService(runtime, settles)
    return Services(
        runtime=runtime,
        tokens=TokenService(runtime),
        clusters=ClusterService(runtime),
        topics=topic_service,
        settles=settles,
        registry=RegistryService(runtime),
        reconcile=ReconcileService(runtime, topic_service, settles),
    )


def create_app(config: ServiceConfig | None = None) -> FastAPI:
    """One service instance; ``config`` defaults to ``ServiceConfig.from_settings()``."""
    config = config or ServiceConfig.from_settings()
    services = build_services(config)
    group_service = build_groups(services.runtime)
    migrations = MigrationService(
        services.runtime, services.topics, services.registry, group_service
    )

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        runtime = services.runtime
        prepare_sqlite_path(config.database_url)
        if config.auto_upgrade:
            await asyncio.to_thread(upgrade_database, config.database_url)
        await runtime.notifier.start()
        purge: asyncio.Task[None] | None = None
        try:
            if await services.tokens.ensure_initial_admin() is not None:
                # Where the token is, never the token: stderr ends up in log files.
                print(
                    "xinfra metadata service: created the initial admin token in "
                    f"{config.run_dir / 'admin-token'} (mode 0600)",
                    file=sys.stderr,
                    flush=True,
                )
            await services.clusters.ensure_default_vcluster()
            await services.settles.start()
            await group_service.start()
            purge = asyncio.create_task(services.registry.purge_forever(), name="client-purge")
            await migrations.start()
            yield
        finally:
            await migrations.stop()
            if purge is not None:
                purge.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await purge
            await services.settles.stop()
            await group_service.stop()
            await runtime.notifier.stop()
            await runtime.backends.close()
            await services.topics.close()
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
        # The service's telemetry is its Prometheus /metrics.  FastAPI's OpenTelemetry hooks
        # look up three providers (environment reads) on every request even when none is
        # configured: a quarter of a cached metadata read.
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    app.state.services = services
    app.state.config = config
    app.state.groups = group_service
    app.state.hot_routes = HotRoutes(
        services.topics, services.tokens, group_service, services.runtime.metrics
    )
    app.state.migrations = migrations
    install_problem_handlers(app)
    app.add_exception_handler(NotCoordinator, groups.not_coordinator_response)
    for router in (health.router, clusters.router, topics.router, clients.router, admin.router):
        app.include_router(router)
    app.include_router(groups.router)
    app.include_router(checkpoints.router)
    app.include_router(migrations_router.router)
    app.add_middleware(RequestGate, tokens=services.tokens, limit=config.request_bytes_max)
    app.add_middleware(
        MetadataFastPath,
        services=services,
        groups=group_service,
        body_max=config.request_bytes_max,
    )
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
