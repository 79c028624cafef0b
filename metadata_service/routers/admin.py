"""API tokens (/v1/tokens) and reconcile (/v1/admin/reconcile): admin of all only."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Response

from metadata_service.deps import PrincipalDep, ServicesDep
from metadata_service.problems import problem_responses
from metadata_service.schemas import (
    ReconcileReport,
    TokenCreate,
    TokenCreated,
    TokenList,
    TokenOut,
)
from xinfra.names import NAME_PATTERN

ERRORS = problem_responses(400, 401, 403, 404, 409, 413, 422, 429, 503, 504)

router = APIRouter(prefix="/v1", tags=["admin"], responses=ERRORS)


@router.post("/tokens", status_code=201, response_model=TokenCreated)
async def create_token(
    request: TokenCreate, services: ServicesDep, principal: PrincipalDep
) -> TokenCreated:
    """Create an API token; the token itself is returned once and only its hash is kept."""
    principal.require_admin()
    token, created_ms = await services.tokens.create(
        request.name, request.role.value, request.scope
    )
    return TokenCreated(
        name=request.name,
        role=request.role,
        scope=request.scope,
        created_ms=created_ms,
        token=token,
    )


@router.get("/tokens", response_model=TokenList)
async def list_tokens(services: ServicesDep, principal: PrincipalDep) -> TokenList:
    principal.require_admin()
    rows = await services.runtime.db(services.runtime.store.list_tokens)
    return TokenList(
        tokens=[
            TokenOut(name=r.name, role=r.role, scope=r.scope, created_ms=r.created_ms)  # type: ignore[arg-type]
            for r in rows
        ]
    )


@router.delete("/tokens/{name}", status_code=204)
async def delete_token(
    name: Annotated[str, Path(pattern=NAME_PATTERN, max_length=200)],
    services: ServicesDep,
    principal: PrincipalDep,
) -> Response:
    principal.require_admin()
    await services.tokens.delete(name)
    return Response(status_code=204)


@router.post("/admin/reconcile", response_model=ReconcileReport)
async def reconcile(
    services: ServicesDep,
    principal: PrincipalDep,
    grace_s: Annotated[
        float | None,
        Query(
            ge=0,
            le=86400,
            description="Leave intents younger than this alone (default: service setting).",
        ),
    ] = None,
    delete_orphans: Annotated[
        bool, Query(description="Delete unreferenced xinfra.* physical topics.")
    ] = False,
) -> ReconcileReport:
    """Finish or undo operations left mid-way; report drift between the store and the clusters."""
    principal.require_admin()
    return await services.reconcile.run(grace_s, delete_orphans)
