"""Virtual topics, their epochs and the long-polled metadata view (/v1/vclusters/{vc}/topics)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Response

from metadata_service.deps import IfMatchDep, PrincipalDep, ServicesDep
from metadata_service.problems import problem_responses
from metadata_service.schemas import (
    EpochCreate,
    EpochUpdate,
    TopicCreate,
    TopicPage,
    TopicSeal,
    TopicUpdate,
)
from metadata_service.topics import Written, pick_expected
from xinfra.model import TopicMetadata
from xinfra.names import NAME_PATTERN

ERRORS = problem_responses(400, 401, 403, 404, 409, 413, 422, 429, 503, 504)
NamePath = Annotated[str, Path(pattern=NAME_PATTERN, max_length=200)]
METADATA = {"model": TopicMetadata, "description": "The topic metadata; ETag is its version."}
PENDING = {
    "model": TopicMetadata,
    "description": "Sealed, but the sealed epochs' end offsets are still being settled (the "
    "service is shutting down or waits for producers): the metadata shows them as null. The "
    "settle is durable and finishes in the background or at the next start; repeat the seal "
    "to wait for it.",
}

router = APIRouter(prefix="/v1/vclusters/{vc}/topics", tags=["topics"], responses=ERRORS)


def metadata_response(version_body: tuple[int, bytes], status_code: int = 200) -> Response:
    version, body = version_body
    return Response(
        body,
        status_code=status_code,
        media_type="application/json",
        headers={"ETag": f'"{version}"'},
    )


def written_response(written: Written, status_code: int = 200) -> Response:
    """202 while a settle is pending (see ``metadata_service.settle``)."""
    version, body, pending = written
    return metadata_response((version, body), 202 if pending else status_code)


@router.post("", status_code=201, response_model=None, responses={201: METADATA})
async def create_topic(
    vc: NamePath, request: TopicCreate, services: ServicesDep, principal: PrincipalDep
) -> Response:
    """Create a topic with N shards on a physical cluster: epoch 0, version 1."""
    principal.require_admin(vc)
    return metadata_response(await services.topics.create(vc, request), 201)


@router.get("", response_model=TopicPage)
async def list_topics(
    vc: NamePath,
    services: ServicesDep,
    principal: PrincipalDep,
    after: Annotated[
        str | None, Query(max_length=200, description="List names after this one (paging).")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> TopicPage:
    principal.require_read(vc)
    topics, next_after = await services.topics.list_topics(vc, after, limit)
    return TopicPage(topics=topics, next_after=next_after)


@router.get("/{topic}", response_model=None, responses={200: METADATA})
async def describe_topic(
    vc: NamePath, topic: NamePath, services: ServicesDep, principal: PrincipalDep
) -> Response:
    principal.require_read(vc)
    return metadata_response(await services.topics.metadata_body(vc, topic))


@router.get("/{topic}/metadata", response_model=None, responses={200: METADATA})
async def topic_metadata(
    vc: NamePath,
    topic: NamePath,
    services: ServicesDep,
    principal: PrincipalDep,
    after_version: Annotated[
        int | None,
        Query(ge=0, le=2**63 - 1, description="Wait until the version is greater than this."),
    ] = None,
    timeout_s: Annotated[
        float, Query(ge=0, le=300, description="Longest wait; capped by the service maximum.")
    ] = 30.0,
) -> Response:
    """The metadata a client needs; with ``after_version``, a long-poll for a newer version.

    Returns the current metadata at the timeout (same version: nothing changed).
    """
    principal.require_read(vc)
    return metadata_response(
        await services.topics.wait_metadata(vc, topic, after_version, timeout_s)
    )


@router.patch("/{topic}", response_model=None, responses={200: METADATA})
async def update_topic(
    vc: NamePath,
    topic: NamePath,
    request: TopicUpdate,
    services: ServicesDep,
    principal: PrincipalDep,
    if_match: IfMatchDep,
) -> Response:
    """Replace the topic config (optimistic: If-Match or expected_version)."""
    principal.require_admin(vc)
    return metadata_response(await services.topics.update(vc, topic, request, if_match))


@router.post("/{topic}/seal", response_model=None, responses={200: METADATA, 202: PENDING})
async def seal_topic(
    vc: NamePath,
    topic: NamePath,
    request: TopicSeal,
    services: ServicesDep,
    principal: PrincipalDep,
    if_match: IfMatchDep,
) -> Response:
    """Seal the topic and every unsealed epoch (with end offsets); idempotent."""
    principal.require_admin(vc)
    return written_response(await services.topics.seal(vc, topic, request, if_match))


@router.delete("/{topic}", status_code=204)
async def delete_topic(
    vc: NamePath,
    topic: NamePath,
    services: ServicesDep,
    principal: PrincipalDep,
    if_match: IfMatchDep,
    expected_version: Annotated[int | None, Query(ge=0, le=2**63 - 1)] = None,
) -> Response:
    """Delete the topic and its physical topics.  Retry after a 503: it resumes."""
    principal.require_admin(vc)
    await services.topics.delete(vc, topic, pick_expected(expected_version, if_match))
    return Response(status_code=204)


@router.post(
    "/{topic}/epochs",
    status_code=201,
    response_model=None,
    responses={201: METADATA, 202: PENDING},
)
async def add_epoch(
    vc: NamePath,
    topic: NamePath,
    request: EpochCreate,
    services: ServicesDep,
    principal: PrincipalDep,
    if_match: IfMatchDep,
) -> Response:
    """Add an epoch on a physical cluster, sealing the current one with its end offsets."""
    principal.require_admin(vc)
    return written_response(await services.topics.add_epoch(vc, topic, request, if_match), 201)


@router.patch(
    "/{topic}/epochs/{number}", response_model=None, responses={200: METADATA, 202: PENDING}
)
async def update_epoch(
    vc: NamePath,
    topic: NamePath,
    number: Annotated[int, Path(ge=0, le=2**31 - 1)],
    request: EpochUpdate,
    services: ServicesDep,
    principal: PrincipalDep,
    if_match: IfMatchDep,
) -> Response:
    """Change an epoch's state (active, dual_write, sealed with end offsets)."""
    principal.require_admin(vc)
    return written_response(
        await services.topics.update_epoch(vc, topic, number, request, if_match)
    )
