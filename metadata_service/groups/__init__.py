"""Consumer groups through ZooKeeper (DESIGN.md §4): coordinator, assignor, durable state.

Public surface: ``Groups`` (what the app starts, stops and routes to) and
``build_groups``.  Modules: ``assignor`` (fair and sticky), ``state`` (the
durable document), ``directory`` (claims and versioned state in ZooKeeper or
memory), ``coordinator`` (the KIP-848-style protocol), ``offsets`` (end
offsets and metadata), ``views`` (listings, lag, resets).
"""

from __future__ import annotations

from dataclasses import dataclass

from metadata_service.checkpoints.cache import open_cache
from metadata_service.checkpoints.service import CheckpointService
from metadata_service.checkpoints.store import CheckpointStore
from metadata_service.groups.coordinator import GroupCoordinator
from metadata_service.groups.directory import Directory, MemoryDirectory, ZooKeeperDirectory
from metadata_service.groups.offsets import Offsets
from metadata_service.groups.views import GroupViews
from metadata_service.runtime import Runtime


@dataclass
class Groups:
    coordinator: GroupCoordinator
    views: GroupViews
    checkpoints: CheckpointService

    async def start(self) -> None:
        await self.checkpoints.start()
        await self.coordinator.start()

    async def stop(self) -> None:
        await self.coordinator.stop()
        await self.checkpoints.stop()


def build_groups(runtime: Runtime) -> Groups:
    config = runtime.config
    directory: Directory
    if config.zookeeper:
        directory = ZooKeeperDirectory(
            config.zookeeper,
            config.zk_root,
            config.instance_id,
            config.advertised_url,
            config.group_zk_session_s,
        )
    else:
        directory = MemoryDirectory()
    checkpoints = CheckpointService(
        runtime.db,
        CheckpointStore(runtime.store.engine),
        open_cache(config.checkpoint_cache),
        config.checkpoint_flush_s,
        config.checkpoint_buffer_keys_max,
    )
    offsets = Offsets(runtime)
    coordinator = GroupCoordinator(
        directory,
        checkpoints,
        offsets,
        config.instance_id,
        config.group_session_s,
        config.group_heartbeat_s,
    )
    return Groups(
        coordinator, GroupViews(coordinator, directory, checkpoints, offsets), checkpoints
    )


__all__ = ["Groups", "build_groups"]
