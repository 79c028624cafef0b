"""Physical and virtual clusters: registration checks connectivity; deletion refuses what is in use."""

from __future__ import annotations

import contextlib

from metadata_service.runtime import Runtime
from metadata_service.schemas import PhysicalClusterOut, VirtualClusterOut
from xinfra.errors import Conflict
from xinfra.model import PhysicalCluster, VirtualCluster

DEFAULT_VIRTUAL_CLUSTER = "default"


class ClusterService:
    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime

    async def register(self, cluster: PhysicalCluster, check: bool) -> PhysicalClusterOut:
        """Check that the cluster answers (unless told not to), then store it.

        The check comes first so that an unreachable cluster is never
        registered by mistake; ``check=false`` is for clusters being built.
        """
        if check:
            await self.rt.backends.call(cluster, lambda backend: backend.check())
        version = await self.rt.db(self.rt.store.insert_cluster, cluster)
        return PhysicalClusterOut(**cluster.model_dump(), version=version)

    async def get(self, name: str) -> PhysicalClusterOut:
        cluster, version = await self.rt.db(self.rt.store.get_cluster, name)
        return PhysicalClusterOut(**cluster.model_dump(), version=version)

    async def list_clusters(self) -> list[PhysicalClusterOut]:
        rows = await self.rt.db(self.rt.store.list_clusters)
        return [PhysicalClusterOut(**c.model_dump(), version=v) for c, v in rows]

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
