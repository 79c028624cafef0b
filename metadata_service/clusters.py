"""Physical and virtual clusters: registration checks connectivity; deletion refuses what is in use.

A physical cluster is shown to an admin of all with its secret attributes
redacted, and to anyone else with its public attributes only
(``metadata_service.cluster_secrets``); the store keeps them for the service.
"""

from __future__ import annotations

import contextlib

from metadata_service.auth import Principal
from metadata_service.cluster_checks import check_cluster
from metadata_service.cluster_secrets import public_attributes, redacted_attributes
from metadata_service.runtime import Runtime
from metadata_service.schemas import PhysicalClusterOut, VirtualClusterOut
from xinfra.errors import ClusterNotFound, Conflict
from xinfra.model import PhysicalCluster, VirtualCluster

DEFAULT_VIRTUAL_CLUSTER = "default"


def cluster_view(cluster: PhysicalCluster, version: int, viewer: Principal) -> PhysicalClusterOut:
    """What ``viewer`` may see of a cluster: secrets redacted for an admin of all, left out for
    everyone else (a client token, an admin scoped to one virtual cluster)."""
    admin_of_all = viewer.role == "admin" and viewer.scope == "*"
    attributes = (redacted_attributes if admin_of_all else public_attributes)(cluster.attributes)
    return PhysicalClusterOut(
        **cluster.model_dump(exclude={"attributes"}), attributes=attributes, version=version
    )


class ClusterService:
    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime

    async def register(
        self, cluster: PhysicalCluster, check: bool, viewer: Principal
    ) -> PhysicalClusterOut:
        """Validate, check that the cluster answers (unless told not to), then store it.

        Validation and the name's uniqueness come before any network check, so
        a malformed address is a 400 at once rather than a 503/504 after a
        timeout.  The check comes before the insert so that an unreachable
        cluster is never registered by mistake; ``check=false`` is for
        clusters being built.  The check's backend is closed after it.
        """
        check_cluster(cluster)
        if check:
            with contextlib.suppress(ClusterNotFound):
                await self.rt.db(self.rt.store.get_cluster, cluster.name)
                raise Conflict(
                    f"physical cluster {cluster.name!r} is already registered; "
                    "delete it first or pick another name"
                )
            await self.rt.backends.probe(cluster)
        version = await self.rt.db(self.rt.store.insert_cluster, cluster)
        return cluster_view(cluster, version, viewer)

    async def get(self, name: str, viewer: Principal) -> PhysicalClusterOut:
        cluster, version = await self.rt.db(self.rt.store.get_cluster, name)
        return cluster_view(cluster, version, viewer)

    async def list_clusters(self, viewer: Principal) -> list[PhysicalClusterOut]:
        rows = await self.rt.db(self.rt.store.list_clusters)
        return [cluster_view(c, v, viewer) for c, v in rows]

    async def delete(self, name: str, expected_version: int | None) -> None:
        await self.rt.db(self.rt.store.delete_cluster, name, expected_version)
        await self.rt.backends.forget(name)

    async def create_vcluster(self, vcluster: VirtualCluster) -> VirtualClusterOut:
        version = await self.rt.db(self.rt.store.insert_vcluster, vcluster)
        return VirtualClusterOut(**vcluster.model_dump(), version=version)

    async def ensure_default_vcluster(self) -> None:
        with contextlib.suppress(Conflict):
            await self.rt.db(
                self.rt.store.insert_vcluster,
                VirtualCluster(name=DEFAULT_VIRTUAL_CLUSTER, description="created on first start"),
            )

    async def get_vcluster(self, name: str) -> VirtualClusterOut:
        vcluster, version = await self.rt.db(self.rt.store.get_vcluster, name)
        return VirtualClusterOut(**vcluster.model_dump(), version=version)

    async def list_vclusters(self) -> list[VirtualClusterOut]:
        rows = await self.rt.db(self.rt.store.list_vclusters)
        return [VirtualClusterOut(**vc.model_dump(), version=v) for vc, v in rows]

    async def delete_vcluster(self, name: str) -> None:
        await self.rt.db(self.rt.store.delete_vcluster, name)
