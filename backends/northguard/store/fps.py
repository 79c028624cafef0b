"""The fps store: write-ahead log, one file per segment, a sparse RocksDB offset index, group commit.

Layout under ``data_dir``::

    wal/<sequence>.wal        frames of every flush, written and fsynced first
    segments/<id>.seg         the segment's frames, appended (O_DIRECT where granted)
    segments/<id>.meta        start offset, created_ms, state (see ``segment_meta``)
    index/                    RocksDB: sparse offset points and each segment's durable end

**Group commit.**  ``append`` validates and queues; a flush starts when
``group_commit_ms`` have passed since the first queued append, or the queue
holds ``group_commit_bytes_max`` bytes or ``group_commit_records_max``
records.  One flush runs at a time, in a worker thread: write the group's
frames to the WAL and fsync it; append each segment's frames to its file and
fsync every touched file; write the index points and ends; then resolve every
append of the group.  Appends that arrive during a flush form the next group.
The queue is bounded (``queue_bytes_max``): past it, ``append`` waits, in
call order, for the running flush to take a group.

**Back of the envelope** (one NVMe drive, fsync ~0.5-2 ms; 2 cores, CPython).
A flush costs one WAL fsync + one fsync per segment touched + CRC and copies
(~1 GB/s), so ~2-5 ms for a few MB.  With 100-record batches of 100-byte
records (10 KB per append), a flush carries what arrives in its window: at
200 MB/s that is 2 MB = 200 appends = 20k records (the record bound), ~100
flushes/s, ~2M records/s.  The ceiling is the event loop's per-append cost
(~30-50 us of asyncio work), i.e. ~20-30k appends/s, not the disk.  Latency
is the group window plus one flush: 10-15 ms at the median when not saturated.
Measured by ``bench/northguard_store.py --quick`` (2 vCPUs, ext4 on a virtual
disk, O_DIRECT granted, 8 segments x 32 appends in flight): 100-byte records,
18k appends/s, 1.8M records/s, 180 MB/s, 128 appends per flush, p50 12 ms;
1 KiB records, 3k appends/s, 300 MB/s, flushes cut by the 10 MB bound, p50
81 ms (queueing: 256 appends of 100 KB in flight).

**Failures.**  An ``OSError`` in a flush (fsync included) fails every append of
the group with ``StorageError`` and the store refuses every later write until
it is reopened: after a failed fsync the kernel may have dropped dirty pages,
so nothing written since the last good fsync can be trusted or acknowledged
(fail-stop).  An append that failed may still be found after reopening (its
frames may have reached the disk): "not acknowledged" is not "absent".

**Recovery** (``open``).  Each segment file is cut back to the durable end the
index recorded (torn and unindexed tails vanish), then the WAL is replayed in
order: frames already in the segment are skipped, frames at the segment's end
are re-applied, and a frame past the end (a gap) is reported as lost data.
Afterwards every segment is fsynced, the index synced, and the WAL starts a
fresh file.  Bytes before the recorded end are not rescanned: a flipped bit
there is found by the CRC check on read, logged, and raised as
``CorruptData``, never served.

Thread safety: every public method runs on the event loop; the only work off
it is a flush, a seal/delete/create step (all under ``_lock``, so one at a
time) and disk reads (which read only below the durable end).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path

from backends.northguard.runtime import Runtime
from backends.northguard.store.base import Entry, SegmentInfo, SegmentState, SegmentStore
from backends.northguard.store.framing import (
    SEGMENT_ID_BYTES_MAX,
    Frame,
    FrameStatus,
    decode_frame,
    encode_frame,
    frame_bytes_of,
)
from backends.northguard.store.offset_index import (
    IndexPoint,
    OffsetIndex,
    RocksOffsetIndex,
    SegmentEnd,
)
from backends.northguard.store.read_cache import ReadCache
from backends.northguard.store.segment_file import SegmentFile
from backends.northguard.store.segment_meta import (
    META_SUFFIX,
    SEGMENT_SUFFIX,
    SegmentMeta,
    check_segment_id,
    read_meta,
    write_meta,
)
from backends.northguard.store.wal import ReplayReport, WriteAheadLog, create_durably
from xinfra.errors import (
    Conflict,
    CorruptData,
    InvalidRequest,
    NotFound,
    OffsetOutOfRange,
    Sealed,
    StorageError,
    Unavailable,
)

log = logging.getLogger(__name__)

BATCH_BYTES_MAX = 64 * 1024 * 1024  # one entry; a producer batch is far smaller
READ_CHUNK_BYTES = 256 * 1024


@dataclass
class FpsStoreStats:
    """Counters since ``open``; cumulative, never reset."""

    flushes: int = 0
    flushed_appends: int = 0
    flushed_records: int = 0
    flushed_bytes: int = 0
    flush_s_total: float = 0.0
    flush_appends_max: int = 0
    recovered_frames: int = 0
    recovery_lost_entries: int = 0
    cache_hits: int = 0
    cache_misses: int = 0


@dataclass(eq=False)
class _Append:
    segment_id: str
    base_offset: int
    record_count: int
    batch: bytes
    future: asyncio.Future[Entry]


@dataclass(eq=False)
class _Segment:
    meta: SegmentMeta
    file: SegmentFile
    end_offset: int  # durable log end
    end_position: int  # durable logical file length
    next_offset: int  # log end including queued appends
    indexed_position: int = 0  # position of the last index point (0: the implicit one at the start)
    closing: str | None = None  # "sealed" or "deleted" in progress: refuse new appends
    reads_inflight: int = 0  # disk reads running in worker threads
    reads_idle: asyncio.Event = field(default_factory=asyncio.Event)

    def info(self) -> SegmentInfo:
        return SegmentInfo(
            segment_id=self.meta.segment_id,
            start_offset=self.meta.start_offset,
            end_offset=self.end_offset,
            size_bytes=self.end_position,
            state=self.meta.state,
            created_ms=self.meta.created_ms,
        )


@dataclass
class _FlushResult:
    positions: list[int] = field(default_factory=list)  # per append, where its frame starts
    ends: dict[str, SegmentEnd] = field(default_factory=dict)


class FpsStore(SegmentStore):
    """The primary ``SegmentStore``; see the module docstring for the promises and the figures."""

    def __init__(
        self,
        runtime: Runtime,
        data_dir: Path,
        *,
        group_commit_ms: float = 10.0,
        group_commit_bytes_max: int = 10 * 1024 * 1024,
        group_commit_records_max: int = 20_000,
        queue_bytes_max: int = 40 * 1024 * 1024,
        wal_file_bytes_max: int = 64 * 1024 * 1024,
        index_interval_bytes: int = 64 * 1024,
        read_cache_bytes_max: int = 64 * 1024 * 1024,
        direct_io: bool = True,
        index: OffsetIndex | None = None,
    ) -> None:
        assert group_commit_ms >= 0 and group_commit_bytes_max > 0 and group_commit_records_max > 0
        assert queue_bytes_max >= group_commit_bytes_max and index_interval_bytes > 0
        self._runtime = runtime
        self._disk = runtime.disk
        self.data_dir = data_dir
        self._segments_dir = data_dir / "segments"
        self._group_commit_s = group_commit_ms / 1000
        self._group_commit_bytes_max = group_commit_bytes_max
        self._group_commit_records_max = group_commit_records_max
        self._queue_bytes_max = queue_bytes_max
        self._index_interval_bytes = index_interval_bytes
        self._direct_io = direct_io
        self._index_given = index
        self._index: OffsetIndex | None = None
        self._wal = WriteAheadLog(self._disk, data_dir / "wal", file_bytes_max=wal_file_bytes_max)
        self._cache = ReadCache(read_cache_bytes_max)
        self.stats = FpsStoreStats()

        self._segments: dict[str, _Segment] = {}
        self._queue: deque[_Append] = deque()  # admitted, waiting for a flush
        self._queue_bytes = 0
        self._queue_records = 0
        self._waiting: deque[_Append] = deque()  # not admitted yet: the queue was full
        self._inflight: list[_Append] = []
        self._lock = asyncio.Lock()  # one disk mutation at a time: a flush, create, seal, delete
        self._wakeup = asyncio.Event()
        self._timer: asyncio.TimerHandle | None = None
        self._flusher: asyncio.Task[None] | None = None
        self._failure: StorageError | None = None
        self._state = "new"  # new -> open -> closed

    # -- lifecycle -------------------------------------------------------------------------------

    async def open(self) -> None:
        assert self._state == "new", "an FpsStore opens once; make a new one to reopen"
        await self._runtime.run_blocking(self._recover)
        self._state = "open"
        self._flusher = asyncio.get_running_loop().create_task(
            self._flush_loop(), name="fps-flusher"
        )

    async def close(self) -> None:
        if self._state != "open":
            self._state = "closed"
            return
        self._state = "closing"
        await self._drain()
        await self._stop_flusher()
        async with self._lock:
            await self._runtime.run_blocking(self._close_files)
        self._state = "closed"

    async def crash(self) -> None:
        """Stop as a killed process would: queued appends fail and are never written, nothing is synced.

        Waits for a running flush to end (a thread cannot be killed), then
        releases the files and the index lock so the same directory can be
        reopened in this process.  For tests and the simulator.
        """
        if self._state not in ("open", "closing"):
            return
        self._state = "closed"
        async with self._lock:
            self._fail_all(StorageError("the store crashed (simulated); reopen it"))
            await self._stop_flusher()
            self._close_files()

    async def _stop_flusher(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
            self._flusher = None

    def _close_files(self) -> None:
        for segment in self._segments.values():
            segment.file.close()
        self._wal.close()
        if self._index is not None:
            self._index.close()

    @property
    def flush_count(self) -> int:
        return self.stats.flushes

    @property
    def failed(self) -> bool:
        return self._failure is not None

    def direct_io(self, segment_id: str) -> bool:
        """Whether this segment's file is written with O_DIRECT."""
        return self._get(segment_id).file.direct

    def cache_bytes(self) -> int:
        return self._cache.bytes

    # -- segments --------------------------------------------------------------------------------

    def segment(self, segment_id: str) -> SegmentInfo:
        return self._get(segment_id).info()

    def segments(self) -> list[SegmentInfo]:
        return [segment.info() for segment in self._segments.values()]

    def _get(self, segment_id: str) -> _Segment:
        segment = self._segments.get(segment_id)
        if segment is None:
            raise NotFound(f"segment {segment_id!r} is not on this broker")
        return segment

    def _check_writable(self) -> None:
        if self._failure is not None:
            raise StorageError(
                f"the store refuses writes after a disk error ({self._failure.message}); reopen it"
            )
        if self._state != "open":
            raise Unavailable(f"the store is {self._state}, not open")

    async def create_segment(self, segment_id: str, start_offset: int) -> SegmentInfo:
        check_segment_id(segment_id)
        if start_offset < 0:
            raise InvalidRequest(f"start offset {start_offset} is negative")
        self._check_writable()
        async with self._lock:
            self._check_writable()
            existing = self._segments.get(segment_id)
            if existing is not None:
                if existing.meta.start_offset != start_offset:
                    raise Conflict(
                        f"segment {segment_id!r} exists with start offset {existing.meta.start_offset}, "
                        f"not {start_offset}"
                    )
                return existing.info()
            meta = SegmentMeta(
                segment_id, start_offset, SegmentState.ACTIVE, self._runtime.wall_ms()
            )
            try:
                segment = await self._runtime.run_blocking(self._create_blocking, meta)
            except OSError as error:
                raise self._fail(error, f"creating segment {segment_id!r}") from error
            self._segments[segment_id] = segment
            return segment.info()

    def _create_blocking(self, meta: SegmentMeta) -> _Segment:
        path = self._segments_dir / (meta.segment_id + SEGMENT_SUFFIX)
        create_durably(self._disk, path)  # the file first: a meta never names a missing file
        write_meta(self._disk, self._segments_dir, meta)
        file = SegmentFile(self._disk, path, direct=self._direct_io)
        return _Segment(meta, file, meta.start_offset, 0, meta.start_offset)

    async def seal(self, segment_id: str, end_offset: int | None = None) -> SegmentInfo:
        segment = self._get(segment_id)
        if segment.meta.state is SegmentState.SEALED:
            if end_offset is not None and end_offset != segment.end_offset:
                raise Sealed(
                    f"segment {segment_id!r} is already sealed at {segment.end_offset}, not {end_offset}"
                )
            return segment.info()
        self._check_writable()
        if segment.closing is not None:
            raise Conflict(f"segment {segment_id!r} is being {segment.closing}; retry")
        segment.closing = "sealed"
        try:
            await self._drain()
            async with self._lock:
                self._check_writable()
                target = segment.end_offset if end_offset is None else end_offset
                if not segment.meta.start_offset <= target <= segment.end_offset:
                    raise InvalidRequest(
                        f"cannot seal segment {segment_id!r} at {target}: its entries span "
                        f"[{segment.meta.start_offset}, {segment.end_offset})"
                    )
                position = await self._runtime.run_blocking(self._position_of, segment, target)
                meta = replace(
                    segment.meta,
                    state=SegmentState.SEALED,
                    sealed_end_offset=target,
                    sealed_end_position=position,
                )
                try:
                    await self._runtime.run_blocking(self._seal_blocking, segment, meta)
                except OSError as error:
                    raise self._fail(error, f"sealing segment {segment_id!r}") from error
                segment.meta = meta
                segment.end_offset = segment.next_offset = target
                segment.end_position = position
                self._cache.truncate(segment_id, target)
                return segment.info()
        finally:
            segment.closing = None

    def _seal_blocking(self, segment: _Segment, meta: SegmentMeta) -> None:
        assert meta.sealed_end_offset is not None and meta.sealed_end_position is not None
        write_meta(self._disk, self._segments_dir, meta)  # durable first: recovery finishes the cut
        if meta.sealed_end_position < segment.end_position:
            segment.file.truncate(meta.sealed_end_position)
            segment.file.fsync()
            self._require_index().truncate(
                meta.segment_id, SegmentEnd(meta.sealed_end_position, meta.sealed_end_offset)
            )

    def _position_of(self, segment: _Segment, offset: int) -> int:
        """Where the entry starting at ``offset`` begins; ``InvalidRequest`` if none starts there."""
        if offset == segment.end_offset:
            return segment.end_position
        sid = segment.meta.segment_id
        for position, frame in self._scan(segment, offset, segment.end_position, verify_body=False):
            if frame.base_offset == offset:
                return position
            if frame.base_offset > offset or frame.end_offset > offset:
                break
        raise InvalidRequest(f"offset {offset} is not at an entry boundary of segment {sid!r}")

    async def delete_segment(self, segment_id: str) -> None:
        segment = self._segments.get(segment_id)
        if segment is None:
            return
        self._check_writable()
        if segment.closing == "deleted":
            raise Conflict(f"segment {segment_id!r} is being deleted; retry")
        segment.closing = "deleted"
        await self._drain()
        if segment.reads_inflight:  # never close a file under a reader thread
            await segment.reads_idle.wait()
        async with self._lock:
            self._check_writable()
            try:
                await self._runtime.run_blocking(self._delete_blocking, segment)
            except OSError as error:
                raise self._fail(error, f"deleting segment {segment_id!r}") from error
            del self._segments[segment_id]
            self._cache.drop(segment_id)

    def _delete_blocking(self, segment: _Segment) -> None:
        sid = segment.meta.segment_id
        meta_path = self._segments_dir / (sid + META_SUFFIX)
        gone = meta_path.with_name(meta_path.name + ".deleted")
        self._disk.rename(meta_path, gone)  # durable: the segment will not come back after a crash
        segment.file.close()
        self._disk.remove(self._segments_dir / (sid + SEGMENT_SUFFIX))
        self._disk.remove(gone)
        index = self._require_index()
        index.delete_segment(sid)
        # The current WAL file may hold this segment's frames; a segment re-created with the same id
        # must never be given them by a replay, so retire the file now.
        self._wal.roll()
        index.sync()
        self._wal.remove_retired()

    # -- appends and group commit ----------------------------------------------------------------

    async def append(
        self, segment_id: str, base_offset: int, record_count: int, batch: bytes
    ) -> Entry:
        if record_count <= 0:
            raise InvalidRequest(f"an entry holds at least one record, not {record_count}")
        if not batch or len(batch) > BATCH_BYTES_MAX:
            raise InvalidRequest(f"a batch holds 1..{BATCH_BYTES_MAX} bytes, not {len(batch)}")
        request = _Append(
            segment_id, base_offset, record_count, batch, asyncio.get_running_loop().create_future()
        )
        if self._waiting or (
            self._queue and self._queue_bytes + len(batch) > self._queue_bytes_max
        ):
            self._check_writable()
            self._waiting.append(request)
        else:
            self._admit(request)
        # Shielded: a cancelled caller does not cancel the write, which may still become durable.
        return await asyncio.shield(request.future)

    def _admit(self, request: _Append) -> None:
        """Validate against the log end including queued appends, then queue; or fail the future."""
        try:
            self._check_writable()
            segment = self._get(request.segment_id)
            if segment.meta.state is SegmentState.SEALED or segment.closing == "sealed":
                raise Sealed(
                    f"segment {request.segment_id!r} is sealed; append to the range's new segment"
                )
            if segment.closing == "deleted":
                raise NotFound(f"segment {request.segment_id!r} is being deleted")
            if request.base_offset != segment.next_offset:
                raise InvalidRequest(
                    f"append to segment {request.segment_id!r} at offset {request.base_offset}, "
                    f"but its log end is {segment.next_offset}"
                )
        except Exception as error:
            request.future.set_exception(error)
            return
        segment.next_offset += request.record_count
        was_empty = not self._queue
        self._queue.append(request)
        self._queue_bytes += len(request.batch)
        self._queue_records += request.record_count
        if (
            self._queue_bytes >= self._group_commit_bytes_max
            or self._queue_records >= self._group_commit_records_max
        ):
            self._wakeup.set()
        elif was_empty and self._timer is None:
            self._timer = self._runtime.call_later(self._group_commit_s, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._wakeup.set()

    def _admit_waiting(self) -> None:
        while self._waiting:
            head = self._waiting[0]
            if self._queue and self._queue_bytes + len(head.batch) > self._queue_bytes_max:
                return
            self._waiting.popleft()
            self._admit(head)

    def _take_group(self) -> list[_Append]:
        group: list[_Append] = []
        group_bytes = group_records = 0
        while self._queue:
            head = self._queue[0]
            if group and (
                group_bytes + len(head.batch) > self._group_commit_bytes_max
                or group_records + head.record_count > self._group_commit_records_max
            ):
                break
            self._queue.popleft()
            group.append(head)
            group_bytes += len(head.batch)
            group_records += head.record_count
        self._queue_bytes -= group_bytes
        self._queue_records -= group_records
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        return group

    async def _flush_loop(self) -> None:
        """Owned by the store (started by ``open``, cancelled by ``close``): one flush at a time."""
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            if not self._queue:
                continue
            async with self._lock:
                if self._failure is None:
                    await self._flush_group()
                else:
                    self._fail_all(self._failure)
            if self._queue:  # left over from a full group: they have waited long enough
                self._wakeup.set()
            self._admit_waiting()

    async def _flush_group(self) -> None:
        group = self._take_group()
        self._inflight = group
        self._admit_waiting()  # the queue has room again: waiting appends form the next group
        started_s = self._runtime.monotonic_s()
        try:
            result = await self._runtime.run_blocking(self._flush_blocking, group)
            self._complete(group, result, self._runtime.monotonic_s() - started_s)
        except Exception as error:  # OSError, or a broken invariant: never acknowledge
            if not isinstance(error, OSError):
                log.exception("flush failed on a broken invariant")
            failure = self._fail(error, "flushing")
            for request in group:
                if not request.future.done():
                    request.future.set_exception(failure)
            self._fail_all(failure)
        finally:
            self._inflight = []

    def _flush_blocking(self, group: list[_Append]) -> _FlushResult:
        """Off the event loop, under ``_lock``: WAL + fsync, segments + fsync, index."""
        index = self._require_index()
        frames = [encode_frame(a.segment_id, a.base_offset, a.record_count, a.batch) for a in group]
        self._wal.append(b"".join(frames))
        by_segment: dict[str, list[int]] = {}
        for number, request in enumerate(group):
            by_segment.setdefault(request.segment_id, []).append(number)
        result = _FlushResult(positions=[0] * len(group))
        points: list[IndexPoint] = []
        for sid, numbers in by_segment.items():
            segment = self._segments[sid]
            position = segment.file.append(b"".join(frames[number] for number in numbers))
            for number in numbers:
                result.positions[number] = position
                if position - segment.indexed_position >= self._index_interval_bytes:
                    points.append(IndexPoint(sid, group[number].base_offset, position))
                    segment.indexed_position = position
                position += len(frames[number])
            last = group[numbers[-1]]
            result.ends[sid] = SegmentEnd(position, last.base_offset + last.record_count)
        for sid in by_segment:
            self._segments[sid].file.fsync()
        index.write(points, result.ends)
        if self._wal.has_retired():
            index.sync()
            self._wal.remove_retired()
        return result

    def _complete(self, group: list[_Append], result: _FlushResult, flush_s: float) -> None:
        for request in group:
            segment = self._segments[request.segment_id]
            assert request.base_offset == segment.end_offset, "offsets must stay contiguous"
            entry = Entry(request.base_offset, request.record_count, request.batch)
            segment.end_offset = entry.end_offset
            self._cache.add(request.segment_id, entry)
            if not request.future.done():
                request.future.set_result(entry)
            self.stats.flushed_records += request.record_count
            self.stats.flushed_bytes += len(request.batch)
        for sid, end in result.ends.items():
            segment = self._segments[sid]
            assert segment.end_offset == end.end_offset
            segment.end_position = end.position
        self.stats.flushes += 1
        self.stats.flushed_appends += len(group)
        self.stats.flush_appends_max = max(self.stats.flush_appends_max, len(group))
        self.stats.flush_s_total += flush_s

    def _fail(self, error: BaseException, doing: str) -> StorageError:
        """Enter fail-stop; the returned error is what every unacknowledged append gets."""
        failure = StorageError(
            f"disk error while {doing}: {error}; the broker must reopen the store"
        )
        if self._failure is None:
            log.error(
                "fps store %s: %s; refusing all writes until reopened", self.data_dir, failure
            )
            self._failure = failure
        return failure

    def _fail_all(self, failure: StorageError) -> None:
        for request in (*self._queue, *self._waiting):
            if not request.future.done():
                request.future.set_exception(failure)
        self._queue.clear()
        self._waiting.clear()
        self._queue_bytes = self._queue_records = 0

    async def _drain(self) -> None:
        """Wait until every append admitted or waiting right now has been resolved."""
        futures = [r.future for r in (*self._inflight, *self._queue, *self._waiting)]
        if futures:
            self._wakeup.set()
            await asyncio.wait(futures)

    # -- reads -----------------------------------------------------------------------------------

    async def read(self, segment_id: str, offset: int, bytes_max: int) -> list[Entry]:
        segment = self._get(segment_id)
        if not segment.meta.start_offset <= offset <= segment.end_offset:
            raise OffsetOutOfRange(
                f"offset {offset} is outside segment {segment_id!r} "
                f"[{segment.meta.start_offset}, {segment.end_offset}]"
            )
        if offset == segment.end_offset:
            return []
        cached = self._cache.read(segment_id, offset, bytes_max)
        if cached is not None:
            self.stats.cache_hits += 1
            return cached
        self.stats.cache_misses += 1
        if segment.closing == "deleted":
            raise NotFound(f"segment {segment_id!r} is being deleted")
        end_position = segment.end_position
        segment.reads_inflight += 1
        segment.reads_idle.clear()
        try:
            return await self._runtime.run_blocking(
                self._read_blocking, segment, offset, bytes_max, end_position
            )
        except CorruptData:
            if segment.end_position < end_position:  # a seal cut the file under this read
                return await self.read(segment_id, offset, bytes_max)
            raise
        except OSError as error:
            raise StorageError(
                f"reading segment {segment_id!r} at offset {offset}: {error}"
            ) from error
        finally:
            segment.reads_inflight -= 1
            if segment.reads_inflight == 0:
                segment.reads_idle.set()

    def _read_blocking(
        self, segment: _Segment, offset: int, bytes_max: int, end_position: int
    ) -> list[Entry]:
        entries: list[Entry] = []
        total = 0
        for position, frame in self._scan(segment, offset, end_position, verify_body=False):
            if frame.end_offset <= offset:
                continue  # before the wanted entry: its header was checked, its body need not be
            if entries and total + len(frame.batch) > bytes_max:
                break
            if not frame.body_ok():
                if entries:
                    break  # serve the good prefix; the next read from here raises
                message = (
                    f"segment {frame.segment_id!r}: CRC mismatch in the entry at offsets "
                    f"{frame.base_offset}..{frame.end_offset} (byte {position}); it is not served: "
                    "read it from another replica"
                )
                log.error(message)
                raise CorruptData(message)
            entries.append(Entry(frame.base_offset, frame.record_count, frame.batch))
            total += len(frame.batch)
        return entries

    def _scan(
        self, segment: _Segment, offset: int, end_position: int, *, verify_body: bool
    ) -> _FrameScan:
        """Frames from the index point at or before ``offset``: runs in a worker thread."""
        point = self._require_index().floor(segment.meta.segment_id, offset)
        return _FrameScan(segment, point, end_position, verify_body)

    def _require_index(self) -> OffsetIndex:
        assert self._index is not None, "store not open"
        return self._index

    # -- recovery --------------------------------------------------------------------------------

    def _recover(self) -> None:
        disk = self._disk
        disk.makedirs(self._segments_dir)
        disk.makedirs(self.data_dir / "wal")
        if self._index_given is not None:
            self._index = self._index_given
        else:
            disk.makedirs(self.data_dir / "index")
            self._index = RocksOffsetIndex(self.data_dir / "index")
        index = self._index
        names = disk.listdir(self._segments_dir)
        for name in names:
            if name.endswith((".tmp", ".deleted")):
                disk.remove(self._segments_dir / name)
        metas = [read_meta(disk, self._segments_dir / n) for n in names if n.endswith(META_SUFFIX)]
        known = {meta.segment_id for meta in metas}
        for name in names:  # orphans of a create or a delete cut by a crash
            if name.endswith(SEGMENT_SUFFIX) and name[: -len(SEGMENT_SUFFIX)] not in known:
                disk.remove(self._segments_dir / name)
        for sid in index.segment_ids():
            if sid not in known:
                index.delete_segment(sid)
        for meta in metas:
            self._segments[meta.segment_id] = self._recover_segment(meta)

        report = ReplayReport()
        wal_files = sorted(self._wal.existing())
        replayed: dict[str, list[bytes]] = {}  # per segment, frames to append, in order
        points: list[IndexPoint] = []
        for path in wal_files:
            for frame in self._wal.replay(path, report):
                segment = self._replay_frame(frame)
                if segment is None:
                    continue
                data = encode_frame(
                    frame.segment_id, frame.base_offset, frame.record_count, frame.batch
                )
                position = segment.end_position
                if position - segment.indexed_position >= self._index_interval_bytes:
                    points.append(IndexPoint(frame.segment_id, frame.base_offset, position))
                    segment.indexed_position = position
                replayed.setdefault(frame.segment_id, []).append(data)
                segment.end_position += len(data)
                segment.end_offset = segment.next_offset = frame.end_offset
                self.stats.recovered_frames += 1
        ends: dict[str, SegmentEnd] = {}
        for sid, frames in replayed.items():
            segment = self._segments[sid]
            segment.file.append(b"".join(frames))
            assert segment.file.length == segment.end_position
            segment.file.fsync()
            ends[sid] = SegmentEnd(segment.end_position, segment.end_offset)
        index.write(points, ends)
        for segment in self._segments.values():
            sealed_end = segment.meta.sealed_end_offset
            if sealed_end is not None and segment.end_offset != sealed_end:
                self.stats.recovery_lost_entries += 1
                log.error(
                    "segment %s was sealed at %d but only [%d, %d) survived: acknowledged data is lost",
                    segment.meta.segment_id, sealed_end, segment.meta.start_offset, segment.end_offset,
                )  # fmt: skip
        index.sync()  # from here on the WAL files are redundant
        for path in report.corrupt_files:
            disk.rename(path, path.with_name(path.name + ".corrupt"))  # kept for inspection
        self._wal.retire([path for path in wal_files if path not in report.corrupt_files])
        self._wal.start(self._wal.next_sequence())
        self._wal.remove_retired()
        log.info(
            "fps store %s open: %d segments, %d WAL frames read, %d re-applied, %d torn bytes dropped, "
            "%d corrupt WAL frames, %d entries lost",
            self.data_dir, len(self._segments), report.frames, self.stats.recovered_frames,
            report.torn_bytes, report.corrupt_frames, self.stats.recovery_lost_entries,
        )  # fmt: skip

    def _recover_segment(self, meta: SegmentMeta) -> _Segment:
        index = self._require_index()
        path = self._segments_dir / (meta.segment_id + SEGMENT_SUFFIX)
        file = SegmentFile(self._disk, path, direct=self._direct_io)
        end = index.end(meta.segment_id) or SegmentEnd(0, meta.start_offset)
        sealed_end = meta.sealed_end_offset
        sealed_position = meta.sealed_end_position
        if sealed_end is not None and sealed_position is not None and sealed_end < end.end_offset:
            end = SegmentEnd(sealed_position, sealed_end)  # a seal with truncation cut short
            index.truncate(meta.segment_id, end)
        size_before = file.recover(end.position)
        if size_before < end.position:
            log.error(
                "segment file %s holds %d bytes but %d were durable: the tail is lost and reads of it "
                "will raise CorruptData",
                path, size_before, end.position,
            )  # fmt: skip
        point = index.floor(meta.segment_id, max(end.end_offset - 1, meta.start_offset))
        return _Segment(
            meta,
            file,
            end_offset=end.end_offset,
            end_position=end.position,
            next_offset=end.end_offset,
            indexed_position=0 if point is None else point.position,
        )

    def _replay_frame(self, frame: Frame) -> _Segment | None:
        """The segment the WAL frame must be appended to, or ``None`` when it is not needed."""
        segment = self._segments.get(frame.segment_id)
        if segment is None:
            return None  # deleted
        if frame.end_offset <= segment.end_offset:
            return None  # already in the segment file
        sealed_end = segment.meta.sealed_end_offset
        if sealed_end is not None and frame.base_offset >= sealed_end:
            return None  # cut by the seal
        if frame.base_offset != segment.end_offset:
            self.stats.recovery_lost_entries += 1
            log.error(
                "segment %s: the WAL holds offsets %d..%d but the segment ends at %d: "
                "entries in between are lost (corrupt WAL); not re-applying",
                frame.segment_id, frame.base_offset, frame.end_offset, segment.end_offset,
            )  # fmt: skip
            return None
        return segment


class _FrameScan:
    """The frames of a segment file from the index point at or before ``offset`` to ``end_position``.

    Raises ``CorruptData`` (and logs it) on a frame that fails its CRC, names
    another segment or breaks offset contiguity: a reader never gets bad bytes.
    """

    def __init__(
        self, segment: _Segment, point: IndexPoint | None, end_position: int, verify_body: bool
    ) -> None:
        self._segment = segment
        self._position = 0 if point is None else point.position
        self._expected = segment.meta.start_offset if point is None else point.base_offset
        self._end_position = end_position
        self._verify_body = verify_body
        self._buffer = b""
        self._buffer_start = 0

    def __iter__(self) -> _FrameScan:
        return self

    def __next__(self) -> tuple[int, Frame]:
        if self._position >= self._end_position:
            raise StopIteration
        sid = self._segment.meta.segment_id
        while True:
            relative = self._position - self._buffer_start
            decoded = decode_frame(self._buffer, relative, verify_body=self._verify_body)
            readable = self._buffer_start + len(self._buffer)
            if decoded.status is FrameStatus.TRUNCATED and readable < self._end_position:
                self._fill(decoded.frame_bytes or frame_bytes_of(sid, 0) + SEGMENT_ID_BYTES_MAX)
                continue
            if decoded.status is FrameStatus.END and readable < self._end_position:
                self._fill(READ_CHUNK_BYTES)
                continue
            break
        frame = decoded.frame
        if (
            decoded.status is not FrameStatus.OK
            or frame is None
            or frame.segment_id != sid
            or frame.base_offset != self._expected
        ):
            detail = (
                decoded.status.value if decoded.status is not FrameStatus.OK else "unexpected frame"
            )
            message = (
                f"segment {sid!r}: {detail} at byte {self._position} (expected offset {self._expected}); "
                "this entry is corrupt on disk and is not served: read it from another replica"
            )
            log.error(message)
            raise CorruptData(message)
        position = self._position
        self._position += frame.frame_bytes
        self._expected = frame.end_offset
        return position, frame

    def _fill(self, bytes_min: int) -> None:
        size = min(max(bytes_min, READ_CHUNK_BYTES), self._end_position - self._position)
        self._buffer = self._segment.file.read(self._position, size)
        self._buffer_start = self._position
        if len(self._buffer) < size:  # the file is shorter than recorded: decode reports it below
            self._end_position = self._buffer_start + len(self._buffer)
