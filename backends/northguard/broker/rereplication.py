"""Sealed segment replication (self-healing): copy a sealed segment from a survivor.

``DESIGN.md`` §3: an under-replicated sealed segment gets a new replica that
reads it from a surviving replica *with the consume protocol*.  The
coordinator (``Coordinator._heal``) picks the new broker under the topic's
policy, least loaded first, and sends it ``replica_copy``; that broker opens
a consume stream on the source (a live replica, the coordinator's first; the
open names the segment, so any broker holding it serves it, leader or not)
at the segment's start offset,
appends each pushed entry to its store (pipelined: up to ``COPY_INFLIGHT_MAX``
appends ride its group commit), stops at the segment's end and seals there.
The coordinator then compares the copy's checksum with the source's
before it records the new replica (``add_replica``): a copy that differs is
deleted, never counted.

Bounds: one consume window (``COPY_WINDOW_BYTES``) of entries buffered;
``progress_timeout_s`` without a pushed entry fails the copy (retried at a
later maintenance tick, from scratch).
"""

from __future__ import annotations

import asyncio
import contextlib

from backends.northguard.batch import check_batch
from backends.northguard.client.connection import ClientConnection
from backends.northguard.client.consume_stream import ConsumeStream
from backends.northguard.store.base import Entry, SegmentState, SegmentStore
from xinfra.errors import BackendTimeout, CorruptData, NotFound

COPY_WINDOW_BYTES = 8 << 20
COPY_INFLIGHT_MAX = 256


async def copy_segment(
    store: SegmentStore,
    source: ClientConnection,
    segment_id: str,
    topic: str,
    range_id: int,
    start_offset: int,
    end_offset: int,
    progress_timeout_s: float,
) -> None:
    """Make ``store`` hold ``segment_id`` = [start_offset, end_offset) of the range, sealed."""
    with contextlib.suppress(NotFound):
        info = store.segment(segment_id)
        if info.state is SegmentState.SEALED and info.end_offset == end_offset:
            return  # an earlier copy finished; the coordinator checks it
        await store.delete_segment(segment_id)  # a partial copy of an earlier attempt
    await store.create_segment(segment_id, start_offset)
    if end_offset > start_offset:
        data = asyncio.Event()
        stream = ConsumeStream(
            source, topic, range_id, start_offset, COPY_WINDOW_BYTES, data.set, segment_id
        )
        appends: list[asyncio.Task[Entry]] = []
        try:
            offset = start_offset
            while offset < end_offset:
                if not stream.entries:
                    if stream.failure is not None:
                        raise stream.failure
                    data.clear()
                    try:
                        await asyncio.wait_for(data.wait(), progress_timeout_s)
                    except TimeoutError:
                        raise BackendTimeout(
                            f"copying segment {segment_id}: nothing pushed in "
                            f"{progress_timeout_s:g} s at offset {offset}"
                        ) from None
                    continue
                base_offset, batch = stream.entries.popleft()
                stream.consumed(len(batch))
                count = check_batch(batch)[0]
                if base_offset != offset:
                    raise CorruptData(
                        f"copying segment {segment_id}: entry at {base_offset}, expected {offset}"
                    )
                if base_offset + count > end_offset:
                    raise CorruptData(
                        f"copying segment {segment_id}: entry [{base_offset}, "
                        f"{base_offset + count}) crosses the sealed end {end_offset}"
                    )
                appends.append(
                    asyncio.ensure_future(store.append(segment_id, base_offset, count, batch))
                )
                offset = base_offset + count
                if len(appends) >= COPY_INFLIGHT_MAX:
                    await appends.pop(0)
            for task in appends:
                await task
        finally:
            stream.close()
            for task in appends:
                if not task.done():
                    task.cancel()
    await store.seal(segment_id, end_offset)
