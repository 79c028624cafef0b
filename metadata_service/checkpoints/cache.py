"""The read cache in front of the checkpoint table: one entry per group, never the only copy.

An entry maps (topic, epoch, shard) to a position and is *complete* only
after a fill from MySQL marked it so.  Flushes write through into whatever
entry exists (creating a partial one if none does); a read answers from the
cache only for a complete entry, and a fill never overwrites a field a flush
wrote (set-if-absent), so a fill that raced a flush cannot bring an older
position back.  Losing the cache loses nothing: the next read refills it.

Adapters: ``MemoryCache`` (the embedded default, bounded LRU), ``RedisCache``
and ``CouchbaseCache`` (``checkpoints.couchbase_cache``, the production
choice).  Each is checked by the same contract suite.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Protocol

from metadata_service.checkpoints.store import GroupCheckpoints

GroupKey = tuple[str, str]
COMPLETE = "_complete"


def field_name(topic: str, epoch: int, shard: int) -> str:
    return f"{topic}/{epoch}/{shard}"


def parse_fields(fields: Mapping[str, Any]) -> GroupCheckpoints:
    out: GroupCheckpoints = {}
    for name, value in fields.items():
        if name == COMPLETE:
            continue
        topic, epoch, shard = name.rsplit("/", 2)
        out[(topic, int(epoch), int(shard))] = int(value)
    return out


class CheckpointCache(Protocol):
    name: str

    async def get_group(self, key: GroupKey) -> GroupCheckpoints | None:
        """The group's checkpoints when the entry is complete; None on a miss."""
        ...

    async def fill_group(self, key: GroupKey, values: GroupCheckpoints) -> None:
        """Add the fields that are absent and mark the entry complete."""
        ...

    async def put(self, values: Mapping[GroupKey, GroupCheckpoints]) -> None:
        """Write flushed positions through (overwriting)."""
        ...

    async def drop_group(self, key: GroupKey) -> None: ...

    async def close(self) -> None: ...


class MemoryCache:
    """In-process, bounded: at most ``groups_max`` groups, least recently used evicted."""

    name = "memory"

    def __init__(self, groups_max: int = 100_000) -> None:
        self.groups_max = groups_max
        self._entries: OrderedDict[GroupKey, tuple[bool, GroupCheckpoints]] = OrderedDict()

    async def get_group(self, key: GroupKey) -> GroupCheckpoints | None:
        entry = self._entries.get(key)
        if entry is None or not entry[0]:
            return None
        self._entries.move_to_end(key)
        return dict(entry[1])

    async def fill_group(self, key: GroupKey, values: GroupCheckpoints) -> None:
        _complete, current = self._entries.get(key, (False, {}))
        self._store(key, True, {**values, **current})

    async def put(self, values: Mapping[GroupKey, GroupCheckpoints]) -> None:
        for key, positions in values.items():
            complete, current = self._entries.get(key, (False, {}))
            self._store(key, complete, {**current, **positions})

    def _store(self, key: GroupKey, complete: bool, values: GroupCheckpoints) -> None:
        self._entries[key] = (complete, values)
        self._entries.move_to_end(key)
        while len(self._entries) > self.groups_max:
            self._entries.popitem(last=False)

    async def drop_group(self, key: GroupKey) -> None:
        self._entries.pop(key, None)

    async def close(self) -> None:
        self._entries.clear()


class RedisCache:
    """One Redis hash per group; entries expire after ``ttl_s`` untouched."""

    name = "redis"

    def __init__(self, url: str, ttl_s: int = 3600, prefix: str = "xinfra:checkpoints") -> None:
        import redis.asyncio as redis

        self.ttl_s = ttl_s
        self.prefix = prefix
        self._redis: Any = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)

    def _key(self, key: GroupKey) -> str:
        return f"{self.prefix}:{key[0]}:{key[1]}"

    async def get_group(self, key: GroupKey) -> GroupCheckpoints | None:
        fields = await self._redis.hgetall(self._key(key))
        decoded = {k.decode(): v.decode() for k, v in fields.items()}
        if COMPLETE not in decoded:
            return None
        return parse_fields(decoded)

    async def fill_group(self, key: GroupKey, values: GroupCheckpoints) -> None:
        name = self._key(key)
        async with self._redis.pipeline(transaction=True) as pipe:
            for (topic, epoch, shard), position in values.items():
                pipe.hsetnx(name, field_name(topic, epoch, shard), position)
            pipe.hset(name, COMPLETE, 1)
            pipe.expire(name, self.ttl_s)
            await pipe.execute()

    async def put(self, values: Mapping[GroupKey, GroupCheckpoints]) -> None:
        async with self._redis.pipeline(transaction=False) as pipe:
            for key, positions in values.items():
                name = self._key(key)
                pipe.hset(
                    name, mapping={field_name(t, e, s): p for (t, e, s), p in positions.items()}
                )
                pipe.expire(name, self.ttl_s)
            await pipe.execute()

    async def drop_group(self, key: GroupKey) -> None:
        await self._redis.delete(self._key(key))

    async def close(self) -> None:
        await self._redis.aclose()


def open_cache(url: str | None) -> CheckpointCache:
    """``memory://`` (or None), ``redis://...``, ``couchbase://host/bucket?username=..&password=..``."""
    if url is None or url in ("memory", "memory://"):
        return MemoryCache()
    if url.startswith(("redis://", "rediss://", "unix://")):
        return RedisCache(url)
    if url.startswith(("couchbase://", "couchbases://")):
        from metadata_service.checkpoints.couchbase_cache import CouchbaseCache

        return CouchbaseCache.from_url(url)
    raise ValueError(f"checkpoint cache {url!r}: use memory, redis://... or couchbase://...")
