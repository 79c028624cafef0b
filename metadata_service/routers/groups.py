"""Consumer groups (/v1/vclusters/{vc}/groups): heartbeats, listings, descriptions, resets, deletes.

A request for a group that another instance coordinates is answered with a
307 redirect to that instance (``Location``) and a ``not_coordinator``
problem body; the SDK and the CLI follow it and keep talking to that
instance until it fails.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Request, Response
from fastapi.responses import JSONResponse

from metadata_service.deps import PrincipalDep
from metadata_service.groups import Groups
from metadata_service.groups.schemas import (
    Checkpoints,
    GroupDescription,
    GroupList,
    HeartbeatIn,
    HeartbeatOut,
    ResetIn,
)
from metadata_service.problems import problem, problem_responses
from xinfra.errors import NotCoordinator
from xinfra.names import NAME_PATTERN

ERRORS = problem_responses(400, 401, 403, 404, 409, 413, 422, 429, 503, 504)
ERRORS[307] = {"description": "Another instance coordinates the group: follow `Location`"}
NamePath = Annotated[str, Path(pattern=NAME_PATTERN, max_length=200)]

router = APIRouter(prefix="/v1/vclusters/{vc}/groups", tags=["groups"], responses=ERRORS)


def groups_of(request: Request) -> Groups:
    groups: Groups = request.app.state.groups
    return groups


def not_coordinator_response(request: Request, error: Exception) -> JSONResponse:
    """307 to the coordinating instance, same path and query (the method and body are kept)."""
    assert isinstance(error, NotCoordinator)
    headers = {}
    if error.url:
        location = error.url.rstrip("/") + request.url.path
        if request.url.query:
            location += "?" + request.url.query
        headers["Location"] = location
    return problem(307, error.code, "Not coordinator", error.message, request.url.path, headers)


@router.get("", response_model=GroupList)
async def list_groups(vc: NamePath, request: Request, principal: PrincipalDep) -> GroupList:
    """Every group with state or checkpoints in the virtual cluster (any instance answers)."""
    principal.require_read(vc)
    return GroupList(groups=await groups_of(request).views.list_groups(vc))


@router.get("/{group}", response_model=GroupDescription)
async def describe_group(
    vc: NamePath, group: NamePath, request: Request, principal: PrincipalDep
) -> GroupDescription:
    """Members, their shards, committed positions and lag per shard."""
    principal.require_read(vc)
    return await groups_of(request).views.describe(vc, group)


@router.post("/{group}/heartbeat", response_model=HeartbeatOut)
async def heartbeat(
    vc: NamePath, group: NamePath, body: HeartbeatIn, request: Request, principal: PrincipalDep
) -> HeartbeatOut:
    """Join (member_epoch 0), heartbeat and reconcile, or leave (member_epoch -1)."""
    principal.require_read(vc)
    return await groups_of(request).coordinator.heartbeat(vc, group, body)


@router.post("/{group}/reset", response_model=Checkpoints)
async def reset_offsets(
    vc: NamePath, group: NamePath, body: ResetIn, request: Request, principal: PrincipalDep
) -> Checkpoints:
    principal.require_admin(vc)
    return await groups_of(request).views.reset(vc, group, body)


@router.delete("/{group}", status_code=204)
async def delete_group(
    vc: NamePath,
    group: NamePath,
    request: Request,
    principal: PrincipalDep,
    force: Annotated[bool, Query()] = False,
) -> Response:
    """Delete the group's state and checkpoints; refused while it has members unless ``force``."""
    principal.require_admin(vc)
    await groups_of(request).coordinator.delete(vc, group, force)
    return Response(status_code=204)
