"""Checkpoints of a consumer group: commit (acknowledged once durable) and read (cache first)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Request, Response

from metadata_service.deps import PrincipalDep
from metadata_service.groups.schemas import Checkpoints, CommitIn
from metadata_service.routers.groups import ERRORS, groups_of
from xinfra.names import NAME_PATTERN

NamePath = Annotated[str, Path(pattern=NAME_PATTERN, max_length=200)]

router = APIRouter(
    prefix="/v1/vclusters/{vc}/groups/{group}", tags=["checkpoints"], responses=ERRORS
)


@router.post("/commit", status_code=204)
async def commit(
    vc: NamePath, group: NamePath, body: CommitIn, request: Request, principal: PrincipalDep
) -> Response:
    """Commit positions (the next offset to read); 204 once they are in MySQL.

    409 ``fenced`` for a replaced member or a shard no longer assigned to it,
    404 ``unknown_member`` for a member the group does not have, 416
    ``offset_out_of_range`` past a shard's end.
    """
    principal.require_read(vc)
    await groups_of(request).coordinator.commit(
        vc,
        group,
        body.member_id,
        body.member_epoch,
        [(p.topic, p.epoch, p.shard, p.offset) for p in body.positions],
    )
    return Response(status_code=204)


@router.get("/checkpoints", response_model=Checkpoints)
async def checkpoints(
    vc: NamePath, group: NamePath, request: Request, principal: PrincipalDep
) -> Checkpoints:
    """Every committed position of the group, per (topic, epoch, shard)."""
    principal.require_read(vc)
    return await groups_of(request).views.committed(vc, group)
