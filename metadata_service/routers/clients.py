"""The clients registry (/v1/vclusters/{vc}/clients) and version acknowledgements per topic."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Response

from metadata_service.deps import PrincipalDep, ServicesDep
from metadata_service.problems import problem_responses
from metadata_service.schemas import (
    CLIENT_ID_PATTERN,
    ClientList,
    ClientOut,
    ClientRegistration,
    Heartbeat,
    Unacknowledged,
)
from xinfra.names import NAME_PATTERN

ERRORS = problem_responses(400, 401, 403, 404, 409, 413, 422, 429, 503, 504)
NamePath = Annotated[str, Path(pattern=NAME_PATTERN, max_length=200)]
ClientPath = Annotated[str, Path(pattern=CLIENT_ID_PATTERN, max_length=200)]

router = APIRouter(prefix="/v1/vclusters/{vc}", tags=["clients"], responses=ERRORS)


@router.put("/clients/{client_id}", response_model=ClientOut)
async def register_client(
    vc: NamePath,
    client_id: ClientPath,
    request: ClientRegistration,
    services: ServicesDep,
    principal: PrincipalDep,
) -> ClientOut:
    """Register (or re-register) a producer or consumer with a lease of ``ttl_s``.

    The client id then belongs to this token until it expires or is unregistered (403 for others).
    """
    principal.require_read(vc)
    return await services.registry.register(vc, client_id, request, principal)


@router.post("/clients/{client_id}/heartbeat", response_model=ClientOut)
async def heartbeat(
    vc: NamePath,
    client_id: ClientPath,
    request: Heartbeat,
    services: ServicesDep,
    principal: PrincipalDep,
) -> ClientOut:
    """Extend the lease and report the metadata versions the client runs on (404: register again).

    Only the registering token (403); a version above the topic's is refused (400 version_ahead).
    """
    principal.require_read(vc)
    return await services.registry.heartbeat(vc, client_id, request, principal)


@router.get("/clients/{client_id}", response_model=ClientOut)
async def describe_client(
    vc: NamePath, client_id: ClientPath, services: ServicesDep, principal: PrincipalDep
) -> ClientOut:
    principal.require_read(vc)
    return await services.registry.get(vc, client_id)


@router.delete("/clients/{client_id}", status_code=204)
async def unregister_client(
    vc: NamePath, client_id: ClientPath, services: ServicesDep, principal: PrincipalDep
) -> Response:
    """By the registering token or an admin of the virtual cluster (403 for others)."""
    principal.require_read(vc)
    await services.registry.delete(vc, client_id, principal)
    return Response(status_code=204)


@router.get("/clients", response_model=ClientList)
async def list_clients(
    vc: NamePath,
    services: ServicesDep,
    principal: PrincipalDep,
    topic: Annotated[str | None, Query(max_length=200)] = None,
) -> ClientList:
    """Live (unexpired) clients, optionally those of one topic."""
    principal.require_read(vc)
    return ClientList(clients=await services.registry.list_clients(vc, topic))


@router.get("/topics/{topic}/unacknowledged", response_model=Unacknowledged)
async def unacknowledged(
    vc: NamePath, topic: NamePath, services: ServicesDep, principal: PrincipalDep
) -> Unacknowledged:
    """Live clients of the topic that have not reported its current version yet."""
    principal.require_read(vc)
    return await services.registry.unacknowledged(vc, topic)
