"""Checkpoints: commit through the coalescing buffer into MySQL and the cache; read cache first.

Durability: a commit returns after the MySQL upsert that holds it committed
(the cache write-through follows in the same flush, before the ack, so a
read after an ack sees it whichever copy answers).

The cache is never trusted blindly.  A group whose write-through failed is
*suspect* on this instance: its reads go to MySQL until a drop of its cache
entry succeeds.  A coordinator that takes a group over drops its entry too,
because the previous coordinator may have died with a failed write-through
it could not repair.  A cache that is down costs latency, never an answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from metadata_service.checkpoints.buffer import CoalescingBuffer
from metadata_service.checkpoints.cache import CheckpointCache, GroupKey
from metadata_service.checkpoints.store import CheckpointKey, CheckpointStore, GroupCheckpoints

log = logging.getLogger(__name__)
T = TypeVar("T")
Db = Callable[..., Awaitable[Any]]


class CheckpointService:
    def __init__(
        self,
        db: Db,
        store: CheckpointStore,
        cache: CheckpointCache,
        interval_s: float = 0.005,
        keys_max: int = 10_000,
    ) -> None:
        self.db = db
        self.store = store
        self.cache = cache
        self.buffer: CoalescingBuffer[CheckpointKey] = CoalescingBuffer(
            self._flush, interval_s, keys_max
        )
        self._suspect: set[GroupKey] = set()
        self.cache_hits = 0
        self.cache_misses = 0

    async def start(self) -> None:
        self.buffer.start()

    async def stop(self) -> None:
        await self.buffer.stop()
        await self.cache.close()
        self.store.close()

    async def commit(self, values: Mapping[CheckpointKey, int]) -> None:
        """Durable on return (MySQL); raises ``Unavailable`` when the flush failed."""
        await self.buffer.put(values)

    def offer(self, values: Mapping[CheckpointKey, int]) -> asyncio.Future[None] | None:
        """``commit`` without waiting: the future that resolves once the values are durable
        (or fails with the flush); None when the buffer is full or stopped (use ``commit``)."""
        return self.buffer.offer(values)

    async def _flush(self, batch: dict[CheckpointKey, int]) -> None:
        await self.db(self.store.upsert, batch)
        groups: dict[GroupKey, GroupCheckpoints] = {}
        for (vc, group, topic, epoch, shard), position in batch.items():
            groups.setdefault((vc, group), {})[(topic, epoch, shard)] = position
        try:
            await self.cache.put(groups)
        except Exception as error:  # MySQL has it; the cache must not answer for these groups
            log.warning("checkpoint cache write-through failed (%s): reads go to MySQL", error)
            self._suspect.update(groups)

    async def read_group(self, vc: str, group: str) -> GroupCheckpoints:
        """Every checkpoint of the group: (topic, epoch, shard) -> position."""
        key = (vc, group)
        if key in self._suspect and await self._drop(key):
            self._suspect.discard(key)
        if key not in self._suspect:
            try:
                cached = await self.cache.get_group(key)
            except Exception as error:
                log.warning("checkpoint cache read failed (%s): reading MySQL", error)
                cached = None
            if cached is not None:
                self.cache_hits += 1
                return cached
        self.cache_misses += 1
        values: GroupCheckpoints = await self.db(self.store.read_group, vc, group)
        if key not in self._suspect:
            try:
                await self.cache.fill_group(key, values)
            except Exception as error:
                log.warning("checkpoint cache fill failed: %s", error)
        return values

    async def invalidate(self, vc: str, group: str) -> None:
        """Forget the cached entry (a takeover, a reset, a delete); suspect until it is gone."""
        key = (vc, group)
        if not await self._drop(key):
            self._suspect.add(key)

    async def delete_group(self, vc: str, group: str) -> None:
        await self.db(self.store.delete_group, vc, group)
        await self.invalidate(vc, group)

    async def replace_group(
        self, vc: str, group: str, topic: str, values: Mapping[tuple[int, int], int]
    ) -> None:
        """Reset ``topic``'s checkpoints of the group to exactly ``values`` ((epoch, shard) -> position)."""
        await self.db(self.store.delete_group, vc, group, topic)
        await self.invalidate(vc, group)
        await self.commit({(vc, group, topic, e, s): p for (e, s), p in values.items()})

    async def drop_epoch(self, vc: str, group: str, topic: str, epoch: int) -> None:
        """Delete the group's checkpoints of one epoch of ``topic`` (a rolled-back migration's
        target: its rows would name an epoch that no longer exists)."""
        await self.db(self.store.delete_group, vc, group, topic, epoch)
        await self.invalidate(vc, group)

    async def list_groups(self, vc: str) -> list[str]:
        groups: list[str] = await self.db(self.store.list_groups, vc)
        return groups

    async def _drop(self, key: GroupKey) -> bool:
        try:
            await self.cache.drop_group(key)
            return True
        except Exception as error:
            log.warning("checkpoint cache drop failed: %s", error)
            return False
