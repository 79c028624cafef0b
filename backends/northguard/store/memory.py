"""``MemoryStore``: the ``SegmentStore`` contract in a dict, for the broker's unit tests and the simulator.

Every append is "durable" as soon as it returns and nothing survives the
object.  It enforces the same rules as the fps store (contiguous offsets,
sealing, ranges, errors) so that a broker tested against it behaves the same
on disk; the shared contract suite in ``tests/northguard/store`` holds both
to it.  ``size_bytes`` counts batch bytes only (no framing).
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import Callable
from dataclasses import dataclass, field

from backends.northguard.store.base import Entry, SegmentInfo, SegmentState, SegmentStore
from backends.northguard.store.segment_meta import check_segment_id
from xinfra.errors import Conflict, InvalidRequest, NotFound, OffsetOutOfRange, Sealed, Unavailable


@dataclass
class _Segment:
    segment_id: str
    start_offset: int
    created_ms: int
    state: SegmentState = SegmentState.ACTIVE
    entries: list[Entry] = field(default_factory=list)
    bases: list[int] = field(default_factory=list)
    size_bytes: int = 0

    @property
    def end_offset(self) -> int:
        return self.entries[-1].end_offset if self.entries else self.start_offset

    def info(self) -> SegmentInfo:
        return SegmentInfo(
            self.segment_id,
            self.start_offset,
            self.end_offset,
            self.size_bytes,
            self.state,
            self.created_ms,
        )


class MemoryStore(SegmentStore):
    """In-memory, event-loop only; ``clock_ms`` (e.g. ``runtime.wall_ms``) stamps ``created_ms``, else 0."""

    def __init__(self, clock_ms: Callable[[], int] | None = None) -> None:
        self._clock_ms = clock_ms
        self._segments: dict[str, _Segment] = {}
        self._open = False
        self.appends = 0

    def _now_ms(self) -> int:
        return 0 if self._clock_ms is None else self._clock_ms()

    async def open(self) -> None:
        self._open = True

    async def close(self) -> None:
        self._open = False

    def _check_open(self) -> None:
        if not self._open:
            raise Unavailable("the store is not open")

    def _get(self, segment_id: str) -> _Segment:
        segment = self._segments.get(segment_id)
        if segment is None:
            raise NotFound(f"segment {segment_id!r} is not on this broker")
        return segment

    async def create_segment(self, segment_id: str, start_offset: int) -> SegmentInfo:
        check_segment_id(segment_id)
        if start_offset < 0:
            raise InvalidRequest(f"start offset {start_offset} is negative")
        self._check_open()
        existing = self._segments.get(segment_id)
        if existing is not None:
            if existing.start_offset != start_offset:
                raise Conflict(
                    f"segment {segment_id!r} exists with start offset {existing.start_offset}, not {start_offset}"
                )
            return existing.info()
        segment = self._segments[segment_id] = _Segment(segment_id, start_offset, self._now_ms())
        return segment.info()

    async def append(
        self, segment_id: str, base_offset: int, record_count: int, batch: bytes
    ) -> Entry:
        if record_count <= 0:
            raise InvalidRequest(f"an entry holds at least one record, not {record_count}")
        if not batch:
            raise InvalidRequest("a batch holds at least one byte")
        self._check_open()
        segment = self._get(segment_id)
        if segment.state is SegmentState.SEALED:
            raise Sealed(f"segment {segment_id!r} is sealed; append to the range's new segment")
        if base_offset != segment.end_offset:
            raise InvalidRequest(
                f"append to segment {segment_id!r} at offset {base_offset}, but its log end is {segment.end_offset}"
            )
        entry = Entry(base_offset, record_count, bytes(batch))
        segment.entries.append(entry)
        segment.bases.append(base_offset)
        segment.size_bytes += len(batch)
        self.appends += 1
        await asyncio.sleep(0)  # an append is a suspension point, as on disk
        return entry

    async def read(self, segment_id: str, offset: int, bytes_max: int) -> list[Entry]:
        segment = self._get(segment_id)
        if not segment.start_offset <= offset <= segment.end_offset:
            raise OffsetOutOfRange(
                f"offset {offset} is outside segment {segment_id!r} [{segment.start_offset}, {segment.end_offset}]"
            )
        if offset == segment.end_offset:
            return []
        at = bisect.bisect_right(segment.bases, offset) - 1
        result: list[Entry] = []
        total = 0
        for entry in segment.entries[max(at, 0) :]:
            if result and total + len(entry.batch) > bytes_max:
                break
            result.append(entry)
            total += len(entry.batch)
        return result

    async def seal(self, segment_id: str, end_offset: int | None = None) -> SegmentInfo:
        segment = self._get(segment_id)
        if segment.state is SegmentState.SEALED:
            if end_offset is not None and end_offset != segment.end_offset:
                raise Sealed(
                    f"segment {segment_id!r} is already sealed at {segment.end_offset}, not {end_offset}"
                )
            return segment.info()
        self._check_open()
        target = segment.end_offset if end_offset is None else end_offset
        if not segment.start_offset <= target <= segment.end_offset:
            raise InvalidRequest(
                f"cannot seal segment {segment_id!r} at {target}: its entries span "
                f"[{segment.start_offset}, {segment.end_offset})"
            )
        keep = bisect.bisect_left(segment.bases, target)
        if keep < len(segment.bases) and segment.bases[keep] != target:
            raise InvalidRequest(
                f"offset {target} is not at an entry boundary of segment {segment_id!r}"
            )
        if keep > 0 and keep == len(segment.bases) and segment.entries[-1].end_offset != target:
            raise InvalidRequest(
                f"offset {target} is not at an entry boundary of segment {segment_id!r}"
            )
        for entry in segment.entries[keep:]:
            segment.size_bytes -= len(entry.batch)
        del segment.entries[keep:], segment.bases[keep:]
        segment.state = SegmentState.SEALED
        return segment.info()

    async def delete_segment(self, segment_id: str) -> None:
        self._check_open()
        self._segments.pop(segment_id, None)

    def segment(self, segment_id: str) -> SegmentInfo:
        return self._get(segment_id).info()

    def segments(self) -> list[SegmentInfo]:
        return [segment.info() for segment in self._segments.values()]

    def segment_states(self) -> dict[str, SegmentState]:
        return {sid: segment.state for sid, segment in self._segments.items()}
