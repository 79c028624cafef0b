"""FastAPI dependencies: the services of this app instance and the caller's principal."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Header, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from metadata_service.auth import Principal, TokenService
from metadata_service.clusters import ClusterService
from metadata_service.gate import PRINCIPAL_SCOPE_KEY, peer_of
from metadata_service.reconcile import ReconcileService
from metadata_service.registry import RegistryService
from metadata_service.runtime import Runtime
from metadata_service.settle import SettleService
from metadata_service.topics import TopicService
from xinfra.errors import InvalidRequest


@dataclass
class Services:
    runtime: Runtime
    tokens: TokenService
    clusters: ClusterService
    topics: TopicService
    settles: SettleService
    registry: RegistryService
    reconcile: ReconcileService

    def begin_shutdown(self) -> None:
        """The instance stops (SIGTERM): what waits is answered now.  Safe from a signal handler."""
        self.settles.begin_shutdown()
        self.runtime.hub.begin_shutdown()


def get_services(request: Request) -> Services:
    services: Services = request.app.state.services
    return services


_bearer = HTTPBearer(auto_error=False, description="An API token: `Authorization: Bearer <token>`.")


async def get_principal(
    request: Request,
    _credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    principal = request.scope.get(PRINCIPAL_SCOPE_KEY)  # authenticated by the gate already
    if isinstance(principal, Principal):
        return principal
    services: Services = request.app.state.services
    return await services.tokens.authenticate(
        request.headers.get("authorization"), peer_of(request.scope)
    )


def parse_if_match(
    if_match: Annotated[
        str | None,
        Header(
            max_length=64,
            description="The topic version the change expects (an ETag from a read); 409 otherwise.",
        ),
    ] = None,
) -> int | None:
    if if_match is None:
        return None
    value = if_match.strip().removeprefix("W/").strip('"')
    if not value.isdigit() or len(value) > 19:
        raise InvalidRequest(f"If-Match must be a topic version (a number), got {if_match!r}")
    return int(value)


ServicesDep = Annotated[Services, Depends(get_services)]
PrincipalDep = Annotated[Principal, Depends(get_principal)]
IfMatchDep = Annotated[int | None, Depends(parse_if_match)]
