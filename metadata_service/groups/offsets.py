"""Offsets a group needs from the physical side: end offsets (commit checks, lag) and resets.

Topic metadata is kept per (virtual cluster, topic) and dropped by the change
notifications, so checking a commit costs no MySQL read; an active epoch's
end offsets are asked of the backend only when a commit goes past the last
known end (a log only grows), so a steady stream of commits costs no backend
call either.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from metadata_service.notify import TopicKey
from metadata_service.runtime import Runtime
from xinfra.backend import Backend
from xinfra.errors import InvalidRequest, OffsetOutOfRange, ShardOutOfRange
from xinfra.model import Epoch, EpochState, TopicMetadata


class Offsets:
    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime
        self._metadata: dict[TopicKey, TopicMetadata] = {}
        self._ends: dict[tuple[str, str, int], dict[int, int]] = {}
        self._asking: dict[tuple[str, str, int], asyncio.Future[dict[int, int]]] = {}
        runtime.hub.add_listener(self._changed)

    def _changed(self, key: TopicKey | None) -> None:
        if key is None:
            self._metadata.clear()
        else:
            self._metadata.pop(key, None)

    async def metadata(self, vc: str, topic: str) -> TopicMetadata:
        """The topic's metadata (``TopicNotFound`` if none), from the local copy when current."""
        cached = self._metadata.get((vc, topic))
        if cached is None:
            cached = await self.rt.db(self.rt.store.read_metadata, vc, topic)
            self._metadata[(vc, topic)] = cached
        return cached

    async def shard_count(self, vc: str, topic: str) -> int:
        """The largest shard count of the epochs still being read: every shard gets an owner."""
        metadata = await self.metadata(vc, topic)
        return max(len(e.shards) for e in metadata.epochs)

    async def _call(
        self, metadata: TopicMetadata, epoch: Epoch, what: str, *args: object
    ) -> object:
        cluster = metadata.clusters[epoch.cluster]

        async def run(backend: Backend) -> object:
            reader = backend.reader(epoch.physical_topic)
            try:
                return await getattr(reader, what)(*args)
            finally:
                await reader.close()

        return await self.rt.backends.call(cluster, run)

    async def end_offsets(self, vc: str, topic: str, epoch: Epoch) -> dict[int, int]:
        """One past the last record of every shard of ``epoch`` (sealed: as recorded)."""
        if epoch.state == EpochState.SEALED and epoch.end_offsets is not None:
            return dict(epoch.end_offsets)
        key = (vc, topic, epoch.number)
        asking = self._asking.get(key)
        if asking is not None:  # one backend call serves every request that waits for it
            return dict(await asyncio.shield(asking))
        future: asyncio.Future[dict[int, int]] = asyncio.get_running_loop().create_future()
        self._asking[key] = future
        try:
            metadata = await self.metadata(vc, topic)
            ends = await self._call(metadata, epoch, "end_offsets")
            assert isinstance(ends, dict)
            self._ends[key] = ends
            future.set_result(ends)
            return dict(ends)
        except BaseException as error:
            future.set_exception(error)
            future.exception()  # retrieved: the waiters re-raise it
            raise
        finally:
            del self._asking[key]

    async def start_offsets(self, vc: str, topic: str, epoch: Epoch) -> dict[int, int]:
        starts = await self._call(await self.metadata(vc, topic), epoch, "start_offsets")
        assert isinstance(starts, dict)
        return starts

    async def offset_for_timestamp(
        self, vc: str, topic: str, epoch: Epoch, shard: int, timestamp_ms: int
    ) -> int:
        metadata = await self.metadata(vc, topic)
        offset = await self._call(metadata, epoch, "offset_for_timestamp", shard, timestamp_ms)
        assert isinstance(offset, int)
        return offset

    def epoch(self, metadata: TopicMetadata, number: int) -> Epoch:
        for epoch in metadata.epochs:
            if epoch.number == number:
                return epoch
        raise InvalidRequest(
            f"epoch {number} is not an epoch of {metadata.topic.name!r} "
            f"(it has {[e.number for e in metadata.epochs]})"
        )

    def known_valid(self, vc: str, positions: Sequence[tuple[str, int, int, int]]) -> bool:
        """Whether ``check_positions`` passes on what is known here, without a store read or a
        backend call: every topic's metadata is held, each position names a shard of one of
        its epochs and is 0 or at most a known end.  False means ask ``check_positions``."""
        for topic, number, shard, offset in positions:
            metadata = self._metadata.get((vc, topic))
            if metadata is None:
                return False
            for epoch in metadata.epochs:
                if epoch.number == number:
                    break
            else:
                return False
            if shard >= len(epoch.shards):
                return False
            if offset != 0:
                ends = self._ends.get((vc, topic, number))
                if ends is None or offset > ends.get(shard, -1):
                    return False
        return True

    async def check_positions(
        self, vc: str, positions: Sequence[tuple[str, int, int, int]]
    ) -> None:
        """Each (topic, epoch, shard, offset) names a shard of an epoch and is at most its end."""
        for topic, number, shard, offset in positions:
            metadata = await self.metadata(vc, topic)
            epoch = self.epoch(metadata, number)
            if shard >= len(epoch.shards):
                raise ShardOutOfRange(
                    f"shard {shard} is out of range for epoch {number} of {topic!r} "
                    f"({len(epoch.shards)} shards)"
                )
            known = self._ends.get((vc, topic, number), {})
            if offset == 0 or offset <= known.get(shard, -1):
                continue  # a log only grows: below a known end is below the end
            end = (await self.end_offsets(vc, topic, epoch)).get(shard, 0)
            if offset > end:
                raise OffsetOutOfRange(
                    f"offset {offset} is past the end ({end}) of shard {shard} of epoch {number} "
                    f"of {topic!r}: commit the position after a record that was read"
                )
