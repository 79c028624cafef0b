"""Unauthenticated operational endpoints: liveness, readiness, Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from metadata_service.deps import ServicesDep
from metadata_service.problems import problem, problem_responses
from metadata_service.schemas import Health, Ready

router = APIRouter(tags=["operations"])


@router.get("/health", response_model=Health)
async def health() -> Health:
    """The process serves HTTP (liveness)."""
    return Health(status="ok")


@router.get("/ready", response_model=Ready, responses=problem_responses(503))
async def ready(services: ServicesDep) -> Ready | Response:
    """The database answers and notifications flow (readiness)."""
    runtime = services.runtime
    try:
        await runtime.db(runtime.store.ping)
    except Exception as error:
        return problem(503, "unavailable", "Unavailable", f"database: {error}")
    if not runtime.notifier.healthy():
        return problem(503, "unavailable", "Unavailable", "ZooKeeper session is not connected")
    return Ready(
        status="ok",
        database="ok",
        notifier=type(runtime.notifier).__name__,
        instance=runtime.config.instance_id,
    )


@router.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}}}
    },
)
async def metrics(services: ServicesDep) -> Response:
    """Prometheus text exposition."""
    runtime = services.runtime
    runtime.metrics.waiters.set(runtime.hub.waiter_count)
    return Response(generate_latest(runtime.metrics.registry), media_type=CONTENT_TYPE_LATEST)
