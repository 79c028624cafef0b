"""A consume stream: the broker Pushes committed entries while the client's window allows.

The window is client-owned: it bounds the bytes pushed and not yet reported
consumed by a Read.  One push may overshoot by at most one entry (an entry
larger than the whole window is still delivered, alone).  At the committed
end the stream waits for the range's next commit (a long tail read: no
polling, woken by ``RangeLog``'s listeners).

Each entry's batch CRC is checked again after the store read and before it
is pushed: bytes damaged anywhere below are reported as ``CorruptData`` and
never served.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from backends.northguard import protocol
from backends.northguard.batch import check_batch
from backends.northguard.broker.metrics import BrokerMetrics
from backends.northguard.broker.range_log import RangeLog
from backends.northguard.protocol import CONSUME_WINDOW_BYTES_MAX
from backends.northguard.store.base import Entry, SegmentState, SegmentStore
from xinfra.errors import InvalidRequest, XinfraError

PUSH_BYTES_MAX = 4 << 20
"""Batch bytes in one Push frame (well under the frame limit)."""


class SealedSegment:
    """One sealed segment of this broker's store, read like a range log (re-replication reads a
    segment from any replica: a follower has no range log of its range)."""

    def __init__(self, store: SegmentStore, segment_id: str) -> None:
        info = store.segment(segment_id)  # NotFound: not held here
        if info.state is not SegmentState.SEALED:
            raise InvalidRequest(f"segment {segment_id} is not sealed here")
        self._store = store
        self.segment_id = segment_id
        self.start_offset = info.start_offset
        self.end_offset = info.end_offset

    async def read(self, offset: int, bytes_max: int) -> list[Entry]:
        if offset >= self.end_offset:
            return []
        entries = await self._store.read(self.segment_id, offset, bytes_max)
        return [entry for entry in entries if entry.base_offset < self.end_offset]

    def add_listener(self, listener: Callable[[], None]) -> None:
        """A sealed segment never grows: nothing to wake."""

    def remove_listener(self, listener: Callable[[], None]) -> None:
        """See ``add_listener``."""


class ConsumeSession:
    def __init__(
        self,
        stream_id: int,
        range_log: RangeLog | SealedSegment,
        offset: int,
        window_bytes: int,
        send: Callable[[bytes], Awaitable[None]],
        on_error: Callable[[int, XinfraError], None],
        metrics: BrokerMetrics,
    ) -> None:
        check_window(window_bytes)
        self.stream_id = stream_id
        self.range_log = range_log
        self.offset = offset
        self.window_bytes = window_bytes
        self._send = send
        self._on_error = on_error
        self._metrics = metrics
        self._pushed = 0
        self._consumed = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"consume-{self.stream_id}")

    def on_read(self, consumed_bytes: int, window_bytes: int) -> None:
        check_window(window_bytes)
        if not self._consumed <= consumed_bytes <= self._pushed:
            raise InvalidRequest(
                f"Read reports {consumed_bytes} bytes consumed; {self._pushed} were pushed"
            )
        self._consumed = consumed_bytes
        self.window_bytes = window_bytes
        self._wake.set()

    def _on_commit(self) -> None:
        self._wake.set()

    async def _run(self) -> None:
        range_log = self.range_log
        range_log.add_listener(self._on_commit)
        try:
            while True:
                room = self.window_bytes - (self._pushed - self._consumed)
                if room <= 0:
                    await self._wait()
                    continue
                entries = await range_log.read(self.offset, min(room, PUSH_BYTES_MAX))
                if not entries:
                    await self._wait()
                    continue
                batch_bytes = 0
                pushed: list[tuple[int, bytes]] = []
                for entry in entries:
                    check_batch(entry.batch)
                    pushed.append((entry.base_offset, entry.batch))
                    batch_bytes += len(entry.batch)
                self._pushed += batch_bytes
                self.offset = entries[-1].end_offset
                counts = self._metrics.counts
                counts.pushes += 1
                counts.push_bytes += batch_bytes
                await self._send(protocol.encode_push(self.stream_id, pushed))
        except XinfraError as error:
            self._on_error(self.stream_id, error)
        finally:
            range_log.remove_listener(self._on_commit)

    async def _wait(self) -> None:
        await self._wake.wait()
        self._wake.clear()

    def stop(self) -> None:
        """Cancel the push task now (``close`` then waits for it): never left pending unowned."""
        if self._task is not None:
            self._task.cancel()

    async def close(self) -> None:
        self.stop()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


def check_window(window_bytes: int) -> None:
    if not 0 < window_bytes <= CONSUME_WINDOW_BYTES_MAX:
        raise InvalidRequest(
            f"a consume window holds 1..{CONSUME_WINDOW_BYTES_MAX} bytes, not {window_bytes}"
        )
