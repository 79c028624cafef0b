"""Physical clusters (/v1/clusters) and virtual clusters (/v1/vclusters)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Response

from metadata_service.deps import PrincipalDep, ServicesDep
from metadata_service.problems import problem_responses
from metadata_service.schemas import (
    PhysicalClusterList,
    PhysicalClusterOut,
    VirtualClusterList,
    VirtualClusterOut,
)
from xinfra.model import PhysicalCluster, VirtualCluster
from xinfra.names import NAME_PATTERN

ERRORS = problem_responses(400, 401, 403, 404, 409, 413, 422, 429, 503, 504)
NamePath = Annotated[str, Path(pattern=NAME_PATTERN, max_length=200)]

router = APIRouter(prefix="/v1", responses=ERRORS)


@router.post("/clusters", status_code=201, response_model=PhysicalClusterOut, tags=["clusters"])
async def register_cluster(
    cluster: PhysicalCluster,
    services: ServicesDep,
    principal: PrincipalDep,
    check: Annotated[bool, Query(description="Check connectivity before registering.")] = True,
) -> PhysicalClusterOut:
    """Register a Kafka or Northguard cluster (admin of all)."""
    principal.require_admin()
    return await services.clusters.register(cluster, check, principal)


@router.get("/clusters", response_model=PhysicalClusterList, tags=["clusters"])
async def list_clusters(services: ServicesDep, principal: PrincipalDep) -> PhysicalClusterList:
    """Every cluster; secret attributes redacted for an admin of all, left out for anyone else."""
    return PhysicalClusterList(clusters=await services.clusters.list_clusters(principal))


@router.get("/clusters/{name}", response_model=PhysicalClusterOut, tags=["clusters"])
async def describe_cluster(
    name: NamePath, services: ServicesDep, principal: PrincipalDep
) -> PhysicalClusterOut:
    """One cluster; secret attributes redacted for an admin of all, left out for anyone else."""
    return await services.clusters.get(name, principal)


@router.delete("/clusters/{name}", status_code=204, tags=["clusters"])
async def delete_cluster(
    name: NamePath,
    services: ServicesDep,
    principal: PrincipalDep,
    expected_version: Annotated[int | None, Query(ge=0, le=2**63 - 1)] = None,
) -> Response:
    """Unregister a cluster no epoch lives on (admin of all)."""
    principal.require_admin()
    await services.clusters.delete(name, expected_version)
    return Response(status_code=204)


@router.post(
    "/vclusters", status_code=201, response_model=VirtualClusterOut, tags=["virtual clusters"]
)
async def create_vcluster(
    vcluster: VirtualCluster, services: ServicesDep, principal: PrincipalDep
) -> VirtualClusterOut:
    principal.require_admin()
    return await services.clusters.create_vcluster(vcluster)


@router.get("/vclusters", response_model=VirtualClusterList, tags=["virtual clusters"])
async def list_vclusters(services: ServicesDep, principal: PrincipalDep) -> VirtualClusterList:
    vclusters = await services.clusters.list_vclusters()
    return VirtualClusterList(virtual_clusters=[v for v in vclusters if principal.can_read(v.name)])


@router.get("/vclusters/{vc}", response_model=VirtualClusterOut, tags=["virtual clusters"])
async def describe_vcluster(
    vc: NamePath, services: ServicesDep, principal: PrincipalDep
) -> VirtualClusterOut:
    principal.require_read(vc)
    return await services.clusters.get_vcluster(vc)


@router.delete("/vclusters/{vc}", status_code=204, tags=["virtual clusters"])
async def delete_vcluster(vc: NamePath, services: ServicesDep, principal: PrincipalDep) -> Response:
    """Delete an empty virtual cluster (admin of all)."""
    principal.require_admin()
    await services.clusters.delete_vcluster(vc)
    return Response(status_code=204)
