"""The Northguard shard reader: one consume stream per assigned shard, records decoded at poll time.

Each assigned shard has a consume stream whose window is a share of
``fetch_bytes_max``; pushed batches wait, still encoded, until ``poll``
takes them.  ``poll`` decodes only what it returns (leftovers of a batch stay
decoded for the next poll), checks each batch's CRC first (end to end: a
damaged batch is ``CorruptData``, never records), and does all of its taking
after its last ``await``: a cancelled poll has taken nothing, so it loses
nothing.

A stream that fails with a retriable error (the connection dropped, the
broker restarted, its leader changed) is reopened at the shard's position by
the next poll, on the leader the refreshed topic metadata names: at once after
a first failure (a leader change), then after ``xinfra.backoff``'s growing
delay for each further failure in a row, until the shard returns records; so
metadata naming a broker that refuses the range costs a few opens a second,
not thousands.  A non-retriable one (``TopicNotFound``, ``OffsetOutOfRange``,
``CorruptData``) is raised by that poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import ssl
from collections.abc import Mapping, Sequence
from itertools import repeat
from typing import Any

from backends.northguard.batch import check_batch, decode_batch
from backends.northguard.client.admin import AdminClient, TopicView
from backends.northguard.client.connection import CredentialSource
from backends.northguard.client.consume_stream import ConsumeStream
from backends.northguard.protocol import CONSUME_WINDOW_BYTES_MAX
from backends.northguard.runtime import Runtime
from xinfra.backend import ReaderOptions, ShardReader
from xinfra.backoff import backoff_s
from xinfra.errors import XinfraError
from xinfra.model import ConsumedRecord, prefixed

WINDOW_BYTES_MIN = 256 << 10


class NorthguardReader(ShardReader):
    def __init__(
        self,
        runtime: Runtime,
        address: str,
        topic: str,
        options: ReaderOptions,
        timeout_s: float,
        credential_source: CredentialSource | None = None,
        tls_context: ssl.SSLContext | None = None,
    ) -> None:
        self._runtime = runtime
        self._topic_name = topic
        self._options = options
        self._admin = AdminClient(runtime, address, timeout_s, credential_source, tls_context)
        self._view: TopicView | None = None
        self._positions: dict[int, int] = {}
        self._streams: dict[int, ConsumeStream] = {}
        self._leftover: dict[int, list[ConsumedRecord]] = {}
        """Decoded records of a shard that did not fit the last poll, oldest first."""
        self._failures: dict[int, int] = {}
        """Retriable stream failures in a row of a shard, until it returns records."""
        self._retry_at_s: dict[int, float] = {}
        """When a shard whose stream failed may be reopened (absent: at once)."""
        self._stale = False
        """A stream failed retriably: refresh the metadata before the next open."""
        self._data = asyncio.Event()
        self._next_shard = 0
        self._closed = False

    async def _topic(self, refresh: bool = False) -> TopicView:
        if self._view is None or refresh:
            self._view = await self._admin.topic(self._topic_name)
        return self._view

    def assign(self, positions: Mapping[int, int]) -> None:
        new = dict(positions)
        for shard, stream in list(self._streams.items()):
            if new.get(shard) != self._positions.get(shard) or stream.failure is not None:
                stream.close()
                del self._streams[shard]
                self._leftover.pop(shard, None)
        for shard in list(self._leftover):
            if shard not in new:
                del self._leftover[shard]
        for shard in list(self._failures):
            if shard not in new:
                del self._failures[shard]
                self._retry_at_s.pop(shard, None)
        self._positions = new

    async def _ensure_streams(self) -> None:
        if not self._positions:
            return
        view = await self._topic()
        for shard in self._positions:
            if not 0 <= shard < len(view.ranges):
                view = await self._topic(refresh=True)
                break
        for shard in self._positions:
            view.range_of_shard(shard)
        window = max(
            WINDOW_BYTES_MIN,
            min(CONSUME_WINDOW_BYTES_MAX, self._options.fetch_bytes_max // len(self._positions)),
        )
        for shard, position in self._positions.items():
            stream = self._streams.get(shard)
            if stream is not None and stream.failure is not None and not stream.entries:
                failure = stream.failure
                stream.close()
                del self._streams[shard]
                if not failure.retriable:
                    raise failure
                stream = None
                failures = self._failures[shard] = self._failures.get(shard, 0) + 1
                if failures > 1:
                    delay_s = backoff_s(failures - 1, self._runtime.random)
                    self._retry_at_s[shard] = self._runtime.monotonic_s() + delay_s
                self._stale = True  # its leader may have changed
            if stream is None:
                if self._retry_at_s.get(shard, 0.0) > self._runtime.monotonic_s():
                    continue
                self._retry_at_s.pop(shard, None)
                if self._stale:
                    self._stale = False
                    view = await self._topic(refresh=True)
                connection = await self._admin.connection_to(view.ranges[shard].leader)
                if shard in self._streams or self._positions.get(shard) != position:
                    continue  # the assignment changed while connecting
                self._streams[shard] = ConsumeStream(
                    connection,
                    self._topic_name,
                    view.ranges[shard].range_id,
                    position,
                    window,
                    self._data.set,
                )

    async def poll(self, max_records: int = 1000, timeout_s: float = 1.0) -> list[ConsumedRecord]:
        if self._closed:
            raise XinfraError(f"reader of {self._topic_name!r} is closed")
        deadline = self._runtime.monotonic_s() + timeout_s
        while True:
            await self._ensure_streams()
            if self._ready():
                return self._take(max_records)
            now_s = self._runtime.monotonic_s()
            remaining = deadline - now_s
            if remaining <= 0:
                return []
            if self._retry_at_s:  # wake for the first reopen that is due
                remaining = min(remaining, max(0.0, min(self._retry_at_s.values()) - now_s))
            self._data.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._data.wait(), remaining)

    def _ready(self) -> bool:
        for shard in self._positions:
            if self._leftover.get(shard):
                return True
            stream = self._streams.get(shard)
            if stream is not None and stream.entries:
                return True
        return False

    def _take(self, max_records: int) -> list[ConsumedRecord]:
        """Synchronous: decode and return up to ``max_records``, advancing positions."""
        out: list[ConsumedRecord] = []
        shards = list(self._positions)
        if not shards:
            return out
        start = self._next_shard % len(shards)
        self._next_shard += 1
        for shard in shards[start:] + shards[:start]:
            if len(out) >= max_records:
                break
            leftover = self._leftover.get(shard)
            if leftover:
                taken = leftover[: max_records - len(out)]
                del leftover[: len(taken)]
                out.extend(taken)
                self._positions[shard] = taken[-1].offset + 1
                if leftover:
                    continue
            stream = self._streams.get(shard)
            if stream is None:
                continue
            position = self._positions[shard]
            entries = stream.entries
            if entries:
                self._failures.pop(shard, None)  # it reads again: the run of failures ends
            while entries and len(out) < max_records:
                base_offset, batch = entries.popleft()
                stream.consumed(len(batch))
                count = check_batch(batch)[0]
                if base_offset + count <= position:
                    continue
                skip = max(0, position - base_offset)
                # (*record_prefix, shard, offset) + (ts, key, value, headers)
                records: list[Any] = list(
                    prefixed(
                        self._options.record_type,
                        zip(
                            *map(repeat, self._options.record_prefix),
                            repeat(shard),
                            itertools.count(base_offset + skip),
                        ),
                        decode_batch(batch, skip),
                    )
                )
                room = max_records - len(out)
                out.extend(records[:room])
                if len(records) > room:
                    self._leftover[shard] = records[room:]
                position = base_offset + count if len(records) <= room else out[-1].offset + 1
                self._positions[shard] = position
        return out

    async def start_offsets(self, shards: Sequence[int] | None = None) -> dict[int, int]:
        view = await self._topic(refresh=True)
        chosen = range(len(view.ranges)) if shards is None else shards
        return {shard: view.range_of_shard(shard).start_offset for shard in chosen}

    async def end_offsets(self, shards: Sequence[int] | None = None) -> dict[int, int]:
        view = await self._topic(refresh=True)
        chosen = range(len(view.ranges)) if shards is None else shards
        return {shard: view.range_of_shard(shard).end_offset for shard in chosen}

    async def offset_for_timestamp(self, shard: int, timestamp_ms: int) -> int:
        view = await self._topic()
        range_id = view.range_of_shard(shard).range_id
        return await self._admin.offset_for_timestamp(self._topic_name, range_id, timestamp_ms)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for stream in self._streams.values():
            with contextlib.suppress(Exception):
                stream.close()
        self._streams.clear()
        await self._admin.close()
