"""Topic migrations between clusters (/v1/vclusters/{vc}/topics/{topic}/migration).

One migration per topic at a time; each step answers the migration (state,
target epoch, pending step, late clients, history).  Steps are idempotent: a
repeated or resumed step finishes what an interrupted one left.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Request
from pydantic import BaseModel, Field

from metadata_service.deps import PrincipalDep
from metadata_service.problems import problem_responses
from migration.machine import State
from migration.service import MigrationService
from xinfra.names import NAME_PATTERN

ERRORS = problem_responses(400, 401, 403, 404, 409, 422, 503, 504)
NamePath = Annotated[str, Path(pattern=NAME_PATTERN, max_length=200)]

router = APIRouter(
    prefix="/v1/vclusters/{vc}/topics/{topic}/migration", tags=["migrations"], responses=ERRORS
)


class MigrationPlan(BaseModel):
    model_config = {"extra": "forbid"}
    target_cluster: str = Field(pattern=NAME_PATTERN, max_length=200)
    shards: int | None = Field(default=None, ge=1, description="Must equal the source's count.")


class MigrationStep(BaseModel):
    model_config = {"extra": "forbid"}
    expected_state: State | None = Field(
        default=None, description="The state this step leads to; refused when it is not next."
    )
    ack_timeout_s: float = Field(
        default=30.0, ge=0, le=600, description="Wait this long for clients, then pause."
    )


class RollbackStep(BaseModel):
    model_config = {"extra": "forbid"}
    ack_timeout_s: float = Field(default=30.0, ge=0, le=600)


def _service(request: Request) -> MigrationService:
    service: MigrationService = request.app.state.migrations
    return service


@router.post("", status_code=201)
async def plan_migration(
    vc: NamePath, topic: NamePath, body: MigrationPlan, request: Request, principal: PrincipalDep
) -> dict[str, Any]:
    """Plan moving the topic to another cluster (same shard count and key ranges)."""
    principal.require_admin(vc)
    migration = await _service(request).plan(vc, topic, body.target_cluster, body.shards)
    return migration.to_json()


@router.get("")
async def migration_status(
    vc: NamePath, topic: NamePath, request: Request, principal: PrincipalDep
) -> dict[str, Any]:
    """The migration, and the records orphaned past its sealed Kafka epochs' end offsets."""
    principal.require_read(vc)
    return await _service(request).status(vc, topic)


@router.post("/advance")
async def advance_migration(
    vc: NamePath, topic: NamePath, body: MigrationStep, request: Request, principal: PrincipalDep
) -> dict[str, Any]:
    """The next step (or the interrupted one); paused with the late clients named on timeout."""
    principal.require_admin(vc)
    migration = await _service(request).advance(vc, topic, body.expected_state, body.ack_timeout_s)
    return migration.to_json()


@router.post("/rollback")
async def rollback_migration(
    vc: NamePath, topic: NamePath, body: RollbackStep, request: Request, principal: PrincipalDep
) -> dict[str, Any]:
    """Back to the source alone (before dual writes stop)."""
    principal.require_admin(vc)
    return (await _service(request).rollback(vc, topic, body.ack_timeout_s)).to_json()
