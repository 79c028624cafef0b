"""The fps store: write-ahead log, one file per segment, a sparse RocksDB offset index, group commit.

Layout under ``data_dir``::

    wal/<sequence>.wal        frames of every flush, written and fsynced first
    segments/<id>.seg         the segment's frames, appended (O_DIRECT where granted)
    segments/<id>.meta        start offset, created_ms, state (see ``segment_meta``)
    index/                    RocksDB: sparse offset points and each segment's durable end

**Group commit.**  ``append`` validates and queues.  One flush runs at a
time, in a worker thread: write the group's frames to the WAL and fsync it
(the one fsync of a flush, whatever the number of segments it touches); then
resolve every append of the group (the segment files are written beside the
flushes, by a writer that waits until a segment has ``segment_write_bytes`` to
write, or the checkpoint, or a read, asks: see ``_write_loop``).  Appends that arrive during a flush form the next group.  The group
commit is *self-clocking*, bounded: the first append queued on an idle store
is flushed at once (with whatever the same turn of the event loop queued),
and appends queued during a flush are flushed when it ends, but two flushes
start at least ``group_commit_ms`` apart.  So an isolated append waits for no
timer, under load the group grows with the flush time, and the bound caps the
flush rate (each flush costs ~0.5 ms of CPU here, loop and threads: without
it a fast disk would let flushes of one append each eat the event loop).  The
default, 5 ms, is a trade measured at 10k records/s on 2 shared cores: 2 ms
gave the single broker its lowest latency (p50 ~7 ms) but ~4x the flushes of
10 ms and ~1.7x its broker CPU, which three replicas sharing the cores paid in
latency (p50 ~20-38 ms against ~17 at 10 ms); 5 ms: p50 ~8 ms single, ~1.3x
the CPU of 10 ms.  A
group is also cut at ``group_commit_bytes_max`` bytes or
``group_commit_records_max`` records, which start a flush at once.  (A fixed
window after the first queued append, the old rule, added up to its length to
every append of a store that had been idle: at 10k records/s, ~5 ms of the
median.)

**Segment writes.**  A write of acknowledged frames to a segment file waits
until the segment has ``segment_write_bytes`` of them (or ``unwritten_bytes_max``
wait in all, or a checkpoint, a seal or a read needs them: ``_write_loop``).
A write after every flush cost the broker as much CPU as the flushes
themselves (a pool hand-off and a small O_DIRECT write per segment, ~200 a
second at 10k records/s; ~60 us each, one per append at 512 ranges):
measured on three replicated brokers sharing 2 cores, fewer writes cut the
brokers' CPU per record by ~30% and the open-loop p99 with it.  What waits is
only the copy: every frame is durable in the WAL before it is acknowledged.

**Checkpoints.**  Segment files are synced in the background of the flushes:
every ``checkpoint_ms`` while some were written (and whenever the WAL rolls
to a new file), a checkpoint rolls the WAL, fsyncs every segment file written
since the last one (side by side: they share a journal commit; from
``SYNC_ALL_FILES_MIN`` files, one ``syncfs`` for all), records
their ends in the index, syncs it, and only then removes the WAL files it
covered.  A flush's cost therefore does not grow with the ranges it writes
(the sync of N segments is paid once a checkpoint, not once a flush), and an
acknowledged append is always in a synced WAL file or a synced segment file.
``checkpoint()`` runs one on demand (and says whether the WAL could go).
A checkpoint is due when its timer fires, whatever the clock says then
(uvloop may fire a timer a millisecond early; refusing it left an idle
store's WAL unreleased until the next write).

**Counted, not computed.**  Every fsync the store makes goes through a
``CountingDisk`` and is counted as it returns, by kind (``syncs``: WAL,
segment files, directories, index); ``stats.fsyncs`` is what flushes made
and ``stats.checkpoint_fsyncs`` what checkpoints made, each counted by the
step that made it (``SyncCount.tally``: its thread and the threads it fans
out to), never as the difference of the totals across it: a checkpoint
syncs its files and their directory while flushes run, and those syncs are
not the flushes'.  So "fsyncs per flush" is what the disk was asked for.
``close`` checkpoints, so a clean restart has nothing to replay.  A delete
checkpoints too, so the WAL never replays a deleted segment's frames into a
segment re-created with its id (``create_segment`` of such an id waits for a
checkpoint that releases the WAL, or asks the caller to retry).

**Closing is bounded.**  ``close`` and ``crash`` wait at most
``close_timeout_ms`` for the work in progress (queued appends, a seal, a
checkpoint, reads); past it they log, fail what still waits and return,
and the files are released when that work ends (never under a thread that
may be using them).  Nothing acknowledged is lost: it is in the synced WAL.

**Files.**  Segment metadata lives in the offset index (one batch to create
or seal thousands of segments, one scan to load them) and segment files are
opened on demand through a bounded ``FilePool``; a restart opens only the
files the WAL replay touches, so its time does not grow with the segments.
Creating a segment is that index batch alone: its file is made by its first
write (a writer pass, off the acknowledgement path), and the directory entry
is made durable by the checkpoint that records the file's end, before the WAL
that holds its entries can go (recovery does the same for the files it
re-creates from the WAL).  A meta whose file does not exist names an empty
segment.  Removing a file (a delete) is made durable before a segment is
created again, and so is the removal of WAL files after a delete, so no power
loss brings back a deleted segment's bytes under a new segment of its id.
The queue is bounded (``queue_bytes_max``): past it, ``append`` waits, in
call order, for the running flush to take a group.

**Back of the envelope** (one NVMe drive, fsync ~0.5-2 ms; 2 cores, CPython).
A flush costs one WAL fsync + CRC and copies (~1 GB/s), so ~2-5 ms for a
few MB; the segment files are written beside it, one write per segment per
``segment_write_bytes`` (side by side in a thread pool: an O_DIRECT write
waits for the device), and their fsyncs are paid by the checkpoint, once a
second for all of them (one shared journal commit on ext4).  A new segment's
file is made by its first write: on this ext4 an inode costs 0.1-0.9 ms of
kernel CPU (more where many files were deleted lately), a one-off per
segment that a first write to thousands of ranges pays at the checkpoint
(counted and timed in ``file_creations``).  With 100-record batches of 100-byte
records (10 KB per append), a flush carries what arrives in its window: at
200 MB/s that is 2 MB = 200 appends = 20k records (the record bound), ~100
flushes/s, ~2M records/s.  The ceiling is the event loop's per-append cost
(~30-50 us of asyncio work), i.e. ~20-30k appends/s, not the disk.  Latency
is at most ``group_commit_ms`` (or the flush in progress) plus one flush when not saturated.
Measured by ``bench/northguard_store.py --quick`` (2 vCPUs, ext4 on a virtual
disk, O_DIRECT granted, 8 segments x 32 appends in flight): 100-byte records,
18k appends/s, 1.8M records/s, 180 MB/s, 128 appends per flush, p50 12 ms;
1 KiB records, 3k appends/s, 300 MB/s, flushes cut by the 10 MB bound, p50
81 ms (queueing: 256 appends of 100 KB in flight).

**Failures.**  An ``OSError`` in a flush (fsync included) fails every append of
the group with ``StorageError`` (its text keeps the errno's, e.g. "No space
left on device") and the store refuses every later write until it is
reopened: after a failed fsync the kernel may have dropped dirty pages, so
nothing written since the last good fsync can be trusted or acknowledged
(fail-stop).  ``reopen`` releases every file and runs recovery again, in
this process (the broker retries it with backoff, so freeing space on a full
disk returns it to service without a restart).  An append that failed may
still be found after reopening (its frames may have reached the disk): "not
acknowledged" is not "absent".

**Recovery** (``open``).  The WAL is replayed in order against the durable
ends the index recorded at the last checkpoint (each segment it touches is
first cut back to that end: torn and unsynced tails vanish): frames already in the segment are skipped, frames at the segment's end
are re-applied, and a frame past the end (a gap) is reported as lost data.
Afterwards every replayed segment is fsynced, the index synced, and the WAL
starts a fresh file.  Segments the WAL does not touch are not opened.  Bytes before the recorded end are not rescanned: a flipped bit
there is found by the CRC check on read, logged, and raised as
``CorruptData``, never served.

Thread safety: every public method runs on the event loop; the only work off
it is a flush, a seal/delete/create step (all under ``_lock``, so one at a
time, each run ``to_completion``: a cancelled caller never releases the lock
while its thread still writes), a writer pass (``_write_lock``), a
checkpoint's fsyncs (``_checkpoint_lock``) and disk reads (which read only
below the written end).  Locks are taken in the order ``_checkpoint_lock``,
``_lock``, ``_write_lock``, and a writer pass (``_write_pending``, the first
step of a checkpoint) is never started with ``_write_lock`` held: asyncio
locks are not reentrant.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import contextvars
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from backends.northguard.runtime import Runtime, lower_thread_priority
from backends.northguard.shielded import to_completion
from backends.northguard.store.base import (
    Entry,
    OnDone,
    SegmentInfo,
    SegmentState,
    SegmentStore,
    call_done,
    call_done_later,
)
from backends.northguard.store.file_pool import FilePool, NoDescriptor, check_descriptors_max
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
from backends.northguard.store.segment_file import FileCreations, SegmentFile
from backends.northguard.store.segment_meta import (
    META_SUFFIX,
    SEGMENT_SUFFIX,
    SegmentMeta,
    check_segment_id,
    read_meta,
)
from backends.northguard.store.sync_count import CountingDisk, SyncCount
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
DIRECTORY_MARKER = "created.sync"
"""The empty file whose durable creation (a rename) syncs the segment directory."""

_SIDE_BY_SIDE = 8
_FSYNC_POOL = ThreadPoolExecutor(max_workers=_SIDE_BY_SIDE, thread_name_prefix="fps-fsync")
"""Where segment files are written and fsynced side by side: on ext4, fsyncs in flight together
share a journal commit, so syncing N segments costs about one fsync, not N (measured on a
shared 2-vCPU VM: 4 segment fsyncs 11.5 ms one after another, 1.2 ms together)."""
_BACKGROUND_POOL = ThreadPoolExecutor(
    max_workers=_SIDE_BY_SIDE,
    thread_name_prefix="fps-background",
    initializer=lower_thread_priority,
)
"""The same for work nothing waits on (``Runtime.run_background``): the writer's own passes and
timed checkpoints, on threads that run only on a CPU nothing else wants
(``lower_thread_priority``).  A seal, a delete, a close or a read that needs unwritten frames
waits for its pass or checkpoint, which then runs at the caller's priority (``_FSYNC_POOL``), and
so do a pass that the bound of unwritten bytes forces and a checkpoint that releases a full WAL
file: neither may fall behind."""

UNWRITTEN_BYTES_MAX = 192 * 1024 * 1024
"""The default bound of acknowledged bytes held for their segment files, and of a WAL file (see
``unwritten_bytes_max``).  At 64 MiB a producer writing 512 ranges at ~55 MB/s reached the
bound about twice a second, and each time every range's ~70 KB went to its file: ~6,000
O_DIRECT writes per 4M records, ~12 per range, each a pool hand-off, a device kick and a
completion.  At 192 MiB the bound is not reached between two timed checkpoints (one a second,
which write everything anyway): ~4,000, and the 512-range rate of ``bench/northguard_scale.py``
rose ~12% (median of 9 interleaved runs each, 0.48M -> 0.54M records/s on 2 shared cores;
the producer's run-queue wait, 0.9-1.4 s per run, fell to 0.5-1.0 s).  The price is memory
(up to that much more held under such a load: broker RSS after a 512-range run 640-660 MB ->
660-810 MB, same runs) and a crash's replay (up to one WAL file, ~0.2-0.5 s more at the disk's read
rate); a clean stop checkpoints and replays nothing.  Full runs of the bench the same hour did not
show the gain above their spread: there the base's rate was lower, and the timed checkpoints
alone set its writes (4,096 per run)."""

SYNC_ALL_FILES_MIN = 16
"""A checkpoint with this many dirty segment files syncs them in one call (``Disk.sync_all``,
Linux's ``syncfs``) instead of an fsync each: its cost then does not grow with the number of
ranges written (fewer files: their fsyncs, which sync nothing else)."""

_T = TypeVar("_T")
_R = TypeVar("_R")


def _side_by_side(
    function: Callable[[_T], _R], items: list[_T], pool: ThreadPoolExecutor
) -> list[_R | Exception]:
    """``function`` of every item, up to ``_SIDE_BY_SIDE`` at once; per item its result or error.

    One pool task per thread, each going through its share of the items, not
    one per item: with hundreds of segments a task each cost more than the
    writes (futures, locks and GIL hand-offs, all on the event loop's GIL).
    Each task runs in a copy of the caller's context, so the fsyncs it makes
    count in the caller's ``SyncCount.tally``.
    """

    def run(share: list[_T]) -> list[_R | Exception]:
        outcomes: list[_R | Exception] = []
        for item in share:
            try:
                outcomes.append(function(item))
            except Exception as error:
                outcomes.append(error)
        return outcomes

    if len(items) <= 1:
        return run(items)
    ways = min(_SIDE_BY_SIDE, len(items))
    futures = [
        pool.submit(contextvars.copy_context().run, run, items[start::ways])
        for start in range(ways)
    ]
    results: list[_R | Exception] = list(items)  # type: ignore[arg-type]  # each slot replaced
    for start, future in enumerate(futures):
        results[start::ways] = future.result()
    return results


def _fsync_all(files: list[SegmentFile], pool: ThreadPoolExecutor) -> list[SegmentFile]:
    """fsync every file, concurrently; return those no descriptor was left for, raise the first error.

    A file that could not be opened (``NoDescriptor``) is not synced: the
    caller keeps the WAL that covers it and tries again at the next checkpoint.
    """
    skipped: list[SegmentFile] = []
    for file, outcome in zip(files, _side_by_side(SegmentFile.fsync, files, pool), strict=True):
        if isinstance(outcome, NoDescriptor):
            skipped.append(file)
        elif isinstance(outcome, Exception):
            raise outcome
    return skipped


def _append_all(
    writes: dict[SegmentFile, list[tuple[int, int, bytes]]], pool: ThreadPoolExecutor
) -> dict[SegmentFile, int | NoDescriptor]:
    """Append each file's frames, side by side when several (an O_DIRECT write waits for the
    device): where each write starts, or ``NoDescriptor`` for a file that could not be opened;
    any other error is raised once all have finished.

    Each file's frames are copied by the thread that writes them, straight into its aligned
    buffer (or joined, buffered): joined all at once, a pass over 512 segments held a second
    copy of everything it wrote (up to ``unwritten_bytes_max``) until its last write."""
    items = list(writes.items())
    outcomes: dict[SegmentFile, int | NoDescriptor] = {}
    for (file, _), outcome in zip(items, _side_by_side(_append_one, items, pool), strict=True):
        if isinstance(outcome, NoDescriptor):
            outcomes[file] = outcome
        elif isinstance(outcome, Exception):
            raise outcome
        else:
            outcomes[file] = outcome
    return outcomes


def _pool(background: bool) -> ThreadPoolExecutor:
    return _BACKGROUND_POOL if background else _FSYNC_POOL


def _append_one(write: tuple[SegmentFile, list[tuple[int, int, bytes]]]) -> int:
    file, frames = write
    return file.append([frame for _, _, frame in frames])


FLUSH_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, float("inf"))


@dataclass
class FpsStoreStats:
    """Counters since ``open``; cumulative, never reset."""

    flushes: int = 0
    flushed_appends: int = 0
    flushed_records: int = 0
    flushed_bytes: int = 0
    flush_s_total: float = 0.0
    fsyncs: int = 0  # by flushes, counted as made: the WAL's (one, three when it rolls)
    flush_appends_max: int = 0
    flush_s_buckets: list[int] = field(default_factory=lambda: [0] * len(FLUSH_SECONDS_BUCKETS))
    checkpoints: int = 0
    checkpoint_fsyncs: int = 0  # counted as made: segment files, the index, the WAL roll
    checkpoint_s_total: float = 0.0
    segments_created: int = 0
    create_batches: int = 0
    descriptor_refusals: int = 0  # operations failed for want of a file descriptor
    segment_write_passes: int = 0  # passes of the writer (acknowledged frames to segment files)
    segment_writes: int = 0  # segment file appends by those passes
    recovered_frames: int = 0  # re-applied from the WAL
    adopted_frames: int = 0  # found whole in a segment file past its synced end
    recovery_lost_entries: int = 0
    cache_hits: int = 0
    cache_misses: int = 0


@dataclass(eq=False, slots=True)
class _Append:
    segment_id: str
    base_offset: int
    record_count: int
    batch: bytes
    future: asyncio.Future[Entry]
    on_done: OnDone[Entry] | None = None


def _refuse(request: _Append, error: BaseException) -> None:
    """Fail one append; its ``on_done`` runs at the next turn, as a done-callback's would."""
    if not request.future.done():
        request.future.set_exception(error)
        call_done_later(request.on_done, request.future)


@dataclass(eq=False, slots=True)
class _Segment:
    meta: SegmentMeta
    file: SegmentFile
    end_offset: int  # durable log end (acknowledged: in the WAL at least)
    end_position: int  # logical file length: what is written to the segment file
    next_offset: int  # log end including queued appends
    written_offset: int = -1  # the log end of what is in the file (-1: end_offset)
    pending: list[tuple[int, int, bytes]] = field(default_factory=list)  # acknowledged frames
    # (base, end, frame) not yet written to the file
    pending_bytes: int = 0  # bytes of ``pending``
    writing_bytes: int = 0  # frames taken by the writer pass in progress
    indexed_position: int = 0  # position of the last index point (-1: not looked up yet)
    closing: str | None = None  # "sealed" or "deleted" in progress: refuse new appends
    broken: str | None = None  # a write failed for want of a descriptor: refuse appends, seal it
    reads_inflight: int = 0  # disk reads running in worker threads
    reads_idle: asyncio.Event | None = None  # set when reads_inflight drops to 0 (made by a read)

    def __post_init__(self) -> None:
        if self.written_offset < 0:
            self.written_offset = self.end_offset

    async def reads_ended(self) -> None:
        """Wait until no reader thread uses the file (at once when none does)."""
        if self.reads_inflight and self.reads_idle is not None:
            await self.reads_idle.wait()

    def info(self) -> SegmentInfo:
        return SegmentInfo(
            segment_id=self.meta.segment_id,
            start_offset=self.meta.start_offset,
            end_offset=self.end_offset,
            size_bytes=self.end_position + self.writing_bytes + self.pending_bytes,
            state=self.meta.state,
            created_ms=self.meta.created_ms,
        )


@dataclass(eq=False)
class _Checkpoint:
    dirty: list[_Segment]
    ends: dict[str, SegmentEnd]  # what each segment's file held when the WAL rolled
    started_s: float
    unwritten: bool = False
    covered: list[Path] = field(default_factory=list)  # WAL files to remove once synced


@dataclass
class _FlushResult:
    frames: list[bytes] = field(default_factory=list)  # per append, its encoded frame
    fsyncs: int = 0


class FpsStore(SegmentStore):
    """The primary ``SegmentStore``; see the module docstring for the promises and the figures."""

    def __init__(
        self,
        runtime: Runtime,
        data_dir: Path,
        *,
        group_commit_ms: float = 5.0,
        group_commit_bytes_max: int = 10 * 1024 * 1024,
        group_commit_records_max: int = 20_000,
        queue_bytes_max: int = 40 * 1024 * 1024,
        wal_file_bytes_max: int = UNWRITTEN_BYTES_MAX,
        index_interval_bytes: int = 64 * 1024,
        read_cache_bytes_max: int = 64 * 1024 * 1024,
        direct_io: bool = True,
        index: OffsetIndex | None = None,
        descriptors_max: int | None = None,
        checkpoint_ms: float = 1000.0,
        close_timeout_ms: float = 30_000.0,
        segment_write_bytes: int = 256 * 1024,
        unwritten_bytes_max: int = UNWRITTEN_BYTES_MAX,
    ) -> None:
        """``descriptors_max``: the bound of the segment file pool (None: derived from
        ``RLIMIT_NOFILE``; a bound not well under it raises ``ValueError`` here, at start).
        ``close_timeout_ms``: how long ``close`` and ``crash`` wait for work in progress.
        ``segment_write_bytes``: a segment's acknowledged frames are written to its file once
        they reach this size (else by the checkpoint, or a read that needs them);
        ``unwritten_bytes_max``: past this many acknowledged bytes not in their files, all go
        (as much as a WAL file holds: at half of it, ranges too many to fill ``segment_write_bytes``
        each were written twice per WAL file, once for the bound and once by the checkpoint its
        roll brings; 1,000 O_DIRECT writes per 500,000 records at 512 ranges, ~50 us each)."""
        assert group_commit_ms >= 0 and group_commit_bytes_max > 0 and group_commit_records_max > 0
        assert queue_bytes_max >= group_commit_bytes_max and index_interval_bytes > 0
        self._runtime = runtime
        self.syncs = SyncCount()  # every fsync the store makes, by kind, counted as it returns
        self._disk = CountingDisk(runtime.disk, self.syncs)
        # Segment files made by their first open, and the time those opens took (an inode each).
        self.file_creations = FileCreations(runtime.monotonic_s)
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
        self._wal_file_bytes_max = wal_file_bytes_max
        self._wal = WriteAheadLog(
            self._disk, data_dir / "wal", file_bytes_max=wal_file_bytes_max, direct=direct_io
        )
        self._cache = ReadCache(read_cache_bytes_max)
        self.stats = FpsStoreStats()
        self.pool = FilePool(check_descriptors_max(descriptors_max))
        self._checkpoint_s = checkpoint_ms / 1000
        self._close_timeout_s = close_timeout_ms / 1000
        self._deleted_ids: set[str] = set()  # deleted; a WAL file may still hold their frames
        # Files were removed (a deleted segment's, or WAL files that held its frames) since the
        # directories were last synced: they are, before the next create makes a meta durable.
        self._removals_unsynced = False
        self._dirty: set[str] = set()  # segments written since the last checkpoint
        self._dirty_since_s = 0.0
        self._checkpoint_timer: asyncio.TimerHandle | None = None
        self._checkpoint_asked = False  # the timer fired: a checkpoint is due, whatever the clock
        self._create_queue: list[SegmentMeta] = []
        self._creating: dict[str, tuple[SegmentMeta, asyncio.Future[None]]] = {}
        self._creator: asyncio.Task[None] | None = None
        self._checkpointer: asyncio.Task[None] | None = None
        self._releaser: asyncio.Task[None] | None = None  # files left open by a bounded close
        self._unwritten: dict[str, None] = {}  # segments with pending frames, in order
        self._ripe: dict[str, None] = {}  # ... whose frames reach segment_write_bytes (or retried)
        self._unwritten_bytes = 0  # pending bytes, all segments
        self._write_all = False  # the next writer pass takes every segment, ripe or not
        self._write_urgent = False  # ... and must not wait for an idle CPU: a read, the bound
        self._segment_write_bytes = segment_write_bytes
        self._unwritten_bytes_max = unwritten_bytes_max
        self._write_lock = asyncio.Lock()  # one writer pass at a time; seals and deletes wait
        self._write_wakeup = asyncio.Event()
        self._written_event = asyncio.Event()  # set (and replaced) after each writer pass
        self._writer: asyncio.Task[None] | None = None
        self._checkpoint_lock = asyncio.Lock()  # one checkpoint at a time; deletes wait for it

        self._segments: dict[str, _Segment] = {}
        self._queue: deque[_Append] = deque()  # admitted, waiting for a flush
        self._queue_bytes = 0
        self._queue_records = 0
        self._waiting: deque[_Append] = deque()  # not admitted yet: the queue was full
        self._inflight: list[_Append] = []
        self._lock = asyncio.Lock()  # one disk mutation at a time: a flush, create, seal, delete
        self._wakeup = asyncio.Event()
        self._timer: asyncio.TimerHandle | None = None
        self._flush_started_s = float("-inf")  # when the latest flush took its group
        self._flusher: asyncio.Task[None] | None = None
        self._failure: StorageError | None = None
        self._released = False  # files released by a reopen that has not succeeded yet
        self._state = "new"  # new -> open -> closed

    # -- lifecycle -------------------------------------------------------------------------------

    async def open(self) -> None:
        assert self._state == "new", "an FpsStore opens once; make a new one to reopen"
        await self._runtime.run_blocking(self._recover)
        self._state = "open"
        self._flusher = asyncio.get_running_loop().create_task(
            self._flush_loop(), name="fps-flusher"
        )
        self._writer = asyncio.get_running_loop().create_task(self._write_loop(), name="fps-writer")

    async def close(self) -> None:
        """Resolve the queued appends, checkpoint (a clean restart replays nothing), release the files.

        Bounded: if the work in progress (queued appends, a flush, a seal, a
        checkpoint, its own included, or a read) has not ended within
        ``close_timeout_ms`` (a hung disk), it logs, fails what still waits
        and returns; the files are released once that work ends (never under
        a thread that may use them).  Nothing acknowledged is lost: it is in
        the synced WAL, and recovery replays it.
        """
        if self._state != "open":
            if self._state == "new":
                self._state = "closed"
            elif self._releaser is not None and not self._releaser.done():
                with contextlib.suppress(TimeoutError):  # an earlier close that gave up
                    async with asyncio.timeout(self._close_timeout_s):
                        await asyncio.shield(self._releaser)
            return  # closed, or a close or crash is already under way
        self._state = "closing"
        closed = Unavailable("the store is closed")
        deadline = asyncio.get_running_loop().time() + self._close_timeout_s
        try:
            async with asyncio.timeout_at(deadline):
                await self._drain()
        except TimeoutError:
            log.error(
                "fps store %s: queued appends still unresolved %.1f s into close; closing as "
                "after a crash (the WAL keeps every acknowledged append)",
                self.data_dir, self._close_timeout_s,
            )  # fmt: skip
            await self.crash()
            return
        await self._stop_flusher(deadline)
        locks = [self._checkpoint_lock, self._lock]
        held = await self._hold(locks, deadline, "close")
        if held is None:
            self._abandon(closed, locks)
            return
        try:
            if self._failure is None and (
                self._dirty or self._unwritten or self._wal.position or self._wal.has_retired()
            ):
                work = asyncio.get_running_loop().create_task(self._checkpoint_quietly())
                if not await self._ends_by(work, deadline, "close", "its checkpoint"):
                    self._abandon(closed, locks, held, work)
                    held = None
                    return
            self._state = "closed"  # no read starts from here
            if not await self._ends_by(self._reads_idle(), deadline, "close", "reads"):
                self._abandon(closed, locks, held)
                held = None
                return
            await self._runtime.run_blocking(self._close_files)
        finally:
            if held is not None:
                await held.aclose()
        self._written_event.set()  # a read waiting for a writer pass gives up

    async def crash(self) -> None:
        """Stop as a killed process would: queued appends fail and are never written, nothing is synced.

        Waits for a running flush, write or checkpoint to end (a thread cannot
        be killed), then releases the files and the index lock so the same
        directory can be reopened in this process.  Bounded like ``close``.
        For tests and the simulator.
        """
        if self._state not in ("open", "closing"):
            return
        self._state = "closed"
        crashed = StorageError("the store crashed (simulated); reopen it")
        deadline = asyncio.get_running_loop().time() + self._close_timeout_s
        self._fail_all(crashed)
        await self._stop_flusher(deadline)  # a flush in progress resolves its group first
        locks = [self._checkpoint_lock, self._lock, self._write_lock]
        held = await self._hold(locks, deadline, "crash")
        if held is None:
            self._abandon(crashed, locks)
            return
        try:
            if not await self._ends_by(self._reads_idle(), deadline, "crash", "reads"):
                self._abandon(crashed, locks, held)
                held = None
                return
            self._close_files()
        finally:
            if held is not None:
                await held.aclose()
        self._written_event.set()

    async def checkpoint(self) -> bool:
        """Write every acknowledged append to its segment file, fsync those files, record their ends
        and release the WAL files this covers (what the store does every ``checkpoint_ms``).

        Returns whether everything acknowledged is now in synced segment files;
        ``False`` when some segment could not be written or synced for want of a
        file descriptor (its WAL is kept, and a later checkpoint retries).  A disk
        error raises ``StorageError`` and is fail-stop, as in a flush.
        """
        return await self._checkpoint_beside_flushes(background=False)

    async def _checkpoint_beside_flushes(self, *, background: bool) -> bool:
        """``checkpoint``; ``background``: nobody waits for it (its timer's), so its work runs on
        threads that yield the CPU (``Runtime.run_background``)."""
        self._check_writable()
        async with self._checkpoint_lock:
            # What is acknowledged now goes to its files beside the flushes (a second of appends
            # to thousands of new segments takes seconds: under _lock every ack waited for it);
            # _checkpoint_begin writes, under _lock, only what the flushes added meanwhile.
            await self._write_pending(background=background)
            async with self._lock:
                self._check_writable()
                taken = await self._checkpoint_begin(background)
            skipped = await self._checkpoint_sync(taken, background)
            async with self._lock:
                return await self._checkpoint_end(taken, skipped, background)

    async def _hold(
        self, locks: list[asyncio.Lock], deadline: float, doing: str
    ) -> contextlib.AsyncExitStack | None:
        """Acquire ``locks`` in order by ``deadline``; ``None`` (none held, logged) if they were not."""
        stack = contextlib.AsyncExitStack()
        try:
            async with asyncio.timeout_at(deadline):
                for lock in locks:
                    await stack.enter_async_context(lock)
        except TimeoutError:
            await stack.aclose()
            self._log_gave_up(doing, "the store's work in progress")
            return None
        return stack

    async def _ends_by(
        self,
        work: Coroutine[Any, Any, None] | asyncio.Task[None],
        deadline: float,
        doing: str,
        what: str,
    ) -> bool:
        """Whether ``work`` ended by ``deadline``; if not, it goes on (as a task) and it is logged."""
        task = work if isinstance(work, asyncio.Task) else asyncio.ensure_future(work)
        timeout = max(0.0, deadline - asyncio.get_running_loop().time())
        done, _ = await asyncio.wait({task}, timeout=timeout)
        if not done:
            self._log_gave_up(doing, what)
            return False
        return True

    def _log_gave_up(self, doing: str, what: str) -> None:
        log.error(
            "fps store %s: %s gave up after %.1f s waiting for %s; its files stay open until "
            "that ends (never closed under a thread using them)",
            self.data_dir, doing, self._close_timeout_s, what,
        )  # fmt: skip

    async def _reads_idle(self) -> None:
        """Every reader thread has ended (no read starts once the store is not open)."""
        for segment in list(self._segments.values()):
            await segment.reads_ended()

    async def _checkpoint_quietly(self) -> None:
        with contextlib.suppress(StorageError):  # logged by _fail; the WAL stays for recovery
            await self._checkpoint()

    def _abandon(
        self,
        error: StorageError | Unavailable,
        locks: list[asyncio.Lock],
        held: contextlib.AsyncExitStack | None = None,
        work: asyncio.Task[None] | None = None,
    ) -> None:
        """Closed without releasing the files yet: fail what waits, wake readers waiting for a
        write; the files are released once ``work`` has ended under ``held`` (or ``locks`` are
        free), the flusher has stopped and the reads have ended."""
        self._state = "closed"
        self._fail_all(error)
        for request in self._inflight:
            _refuse(request, error)
        self._written_event.set()
        self._releaser = asyncio.get_running_loop().create_task(
            self._release_when_idle(locks, held, work), name="fps-release"
        )

    async def _release_when_idle(
        self,
        locks: list[asyncio.Lock],
        held: contextlib.AsyncExitStack | None,
        work: asyncio.Task[None] | None,
    ) -> None:
        async with contextlib.AsyncExitStack() as stack:
            if held is not None:
                await stack.enter_async_context(held)  # the locks are held already: released last
            else:
                for lock in locks:
                    await stack.enter_async_context(lock)
            pending = {task for task in (work, self._flusher, self._writer) if task is not None}
            if pending:  # a checkpoint, or a flush or writer pass that outlived ``_stop_flusher``
                await asyncio.wait(pending)
            await self._reads_idle()
            try:
                self._close_files()
            except Exception:
                log.exception("fps store %s: releasing its files", self.data_dir)
                return
        log.warning("fps store %s: files released once the work in progress ended", self.data_dir)

    async def _stop_flusher(self, deadline: float) -> None:
        """Cancel the flusher and the writer; a flush or a writer pass in progress finishes first.

        Waited for until ``deadline``: past it (a hung disk) the task goes on
        holding its lock, ``_hold`` gives up, and the release waits for it.
        """
        for timer in (self._timer, self._checkpoint_timer):
            if timer is not None:
                timer.cancel()
        self._timer = self._checkpoint_timer = None
        tasks = [task for task in (self._flusher, self._writer) if task is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            timeout = max(0.0, deadline - asyncio.get_running_loop().time())
            await asyncio.wait(tasks, timeout=timeout)
        if self._flusher is not None and self._flusher.done():
            self._flusher = None
        if self._writer is not None and self._writer.done():
            self._writer = None

    def _close_files(self) -> None:
        """Release every file and the index; after a disk error, closing errors are only logged."""
        closers = [self.pool.close_all, self._wal.close]
        if self._index is not None:
            closers.append(self._index.close)
        first: Exception | None = None
        for close in closers:
            try:
                close()
            except Exception as error:  # OSError, or RocksDB's flush on a full disk
                first = first or error
        if first is not None and self._failure is None:
            raise first
        if first is not None:
            log.warning("fps store %s: closing after a disk error: %s", self.data_dir, first)

    async def reopen(self) -> None:
        if self._failure is None or self._state != "open":
            return
        async with self._checkpoint_lock, self._lock, self._write_lock:  # nobody uses a file
            self._fail_all(self._failure)
            self._unwritten = {}  # recovery writes them from the WAL
            self._ripe = {}
            self._unwritten_bytes = 0
            self._released = True  # reads fail from here until recovery succeeds
            for segment in self._segments.values():
                await segment.reads_ended()  # never close a file under a reader thread
            await self._runtime.run_blocking(self._close_files)
            self._segments = {}
            self._dirty = set()
            self._index = None
            self._wal = WriteAheadLog(
                self._disk,
                self.data_dir / "wal",
                file_bytes_max=self._wal_file_bytes_max,
                direct=self._direct_io,
            )
            try:
                await self._runtime.run_blocking(self._recover)
            except Exception as error:  # still failing (no space yet): stay failed, closed
                with contextlib.suppress(Exception):
                    await self._runtime.run_blocking(self._close_files)
                self._segments = {}
                self._index = None
                raise StorageError(
                    f"reopening the store failed: {error}; writes stay refused"
                ) from error
            self._failure = None
            self._released = False
            self._deleted_ids.clear()  # recovery removed every WAL file
        log.info("fps store %s reopened after a disk error; writes accepted again", self.data_dir)

    @property
    def flush_count(self) -> int:
        return self.stats.flushes

    @property
    def failed(self) -> bool:
        return self._failure is not None

    @property
    def failure(self) -> StorageError | None:
        return self._failure

    def direct_io(self, segment_id: str) -> bool:
        """Whether this segment's file is written with O_DIRECT."""
        return self._get(segment_id).file.direct

    def direct_io_segments(self) -> tuple[int, int]:
        """``(open segment files written with O_DIRECT, segments)``: what the broker's metrics show."""
        segments = list(self._segments.values())
        return sum(1 for s in segments if s.file.is_open and s.file.direct), len(segments)

    def cache_bytes(self) -> int:
        return self._cache.bytes

    def unwritten_bytes(self) -> int:
        """Acknowledged frame bytes waiting in memory (and in the WAL) for a write to their
        segment files: memory the store holds, up to about ``unwritten_bytes_max``."""
        return self._unwritten_bytes

    def wal_bytes(self) -> int:
        """Acknowledged frame bytes the WAL holds until a checkpoint releases them (written to
        their segment files or not): 0 once everything acknowledged is in synced segment files."""
        return self._wal.held_bytes

    # -- segments --------------------------------------------------------------------------------

    def segment(self, segment_id: str) -> SegmentInfo:
        return self._get(segment_id).info()

    def segments(self) -> list[SegmentInfo]:
        return [segment.info() for segment in self._segments.values()]

    def segment_states(self) -> dict[str, SegmentState]:
        return {sid: segment.meta.state for sid, segment in self._segments.items()}

    def _get(self, segment_id: str) -> _Segment:
        segment = self._segments.get(segment_id)
        if segment is None:
            raise NotFound(f"segment {segment_id!r} is not on this broker")
        return segment

    def _check_writable(self) -> None:
        if self._failure is not None:
            raise StorageError(
                f"the store refuses writes after a disk error ({self._failure.message})"
            )
        if self._state != "open":
            raise Unavailable(f"the store is {self._state}, not open")

    async def create_segment(self, segment_id: str, start_offset: int) -> SegmentInfo:
        """Creations arriving together are made durable together: one batch, two syncs for all."""
        check_segment_id(segment_id)
        if start_offset < 0:
            raise InvalidRequest(f"start offset {start_offset} is negative")
        self._check_writable()
        if (
            segment_id in self._deleted_ids
            and segment_id not in self._segments
            and segment_id not in self._creating
            and not await self.checkpoint()
        ):
            raise Unavailable(
                f"segment {segment_id!r} was deleted and the WAL files that may hold its old "
                "entries cannot be released yet (a segment file could not be opened); retry"
            )
        existing = self._segments.get(segment_id)
        pending = self._creating.get(segment_id)
        known = existing.meta if existing is not None else pending[0] if pending else None
        if known is not None and known.start_offset != start_offset:
            raise Conflict(
                f"segment {segment_id!r} exists with start offset {known.start_offset}, "
                f"not {start_offset}"
            )
        if existing is not None:
            return existing.info()
        if pending is None:
            meta = SegmentMeta(
                segment_id, start_offset, SegmentState.ACTIVE, self._runtime.wall_ms()
            )
            pending = (meta, asyncio.get_running_loop().create_future())
            self._creating[segment_id] = pending
            self._create_queue.append(meta)
            if self._creator is None or self._creator.done():
                self._creator = asyncio.get_running_loop().create_task(
                    self._create_pending(), name="fps-creator"
                )
        await asyncio.shield(pending[1])
        return self._get(segment_id).info()

    async def _create_pending(self) -> None:
        while self._create_queue:
            metas, self._create_queue = self._create_queue, []
            error: Exception | None = None
            async with self._lock:
                started_s = self._runtime.monotonic_s()
                try:
                    self._check_writable()
                    await to_completion(self._runtime.run_blocking(self._create_blocking, metas))
                    log.debug(
                        "created %d segments in %.3f s",
                        len(metas),
                        self._runtime.monotonic_s() - started_s,
                    )
                except OSError as failure:
                    error = self._fail(failure, f"creating {len(metas)} segments")
                except Exception as failure:
                    error = failure
                if error is None:
                    for meta in metas:
                        self._segments[meta.segment_id] = _Segment(
                            meta,
                            self._segment_file(meta.segment_id, 0, on_disk=False),
                            meta.start_offset,
                            0,
                            meta.start_offset,
                        )
                    self.stats.segments_created += len(metas)
                    self.stats.create_batches += 1
            for meta in metas:
                _, future = self._creating.pop(meta.segment_id)
                if error is None:
                    future.set_result(None)
                else:
                    future.set_exception(error)
                    future.exception()  # retrieved: a cancelled creator must not warn

    def _segment_file(
        self, segment_id: str, length: int, *, on_disk: bool = True, exists: bool | None = None
    ) -> SegmentFile:
        where = (self._segments_dir, segment_id + SEGMENT_SUFFIX)
        return SegmentFile(
            self._disk,
            where,
            direct=self._direct_io,
            pool=self.pool,
            length=length,
            on_disk=on_disk,
            exists=exists,
            creations=self.file_creations,
        )

    def _create_blocking(self, metas: list[SegmentMeta]) -> None:
        """Every meta in one synced index batch, and no file: the segment's first write makes it.

        A meta whose file does not exist names an empty segment; a file no meta
        names is an orphan.  Removals that are not durable yet are made so first
        (one sync of each directory for any number of deletes): a deleted
        segment's file or WAL files that a power loss brought back would
        otherwise give its old entries to a new segment of the same id.
        """
        if self._removals_unsynced:
            self._removals_unsynced = False
            self._sync_segments_dir()
            self._wal.sync_directory()
        index = self._require_index()
        index.put_metas({meta.segment_id: meta.pack() for meta in metas})
        self._sync_index(index)

    def _sync_segments_dir(self) -> None:
        """Make the segment directory's entries durable as they are now: files made and removed."""
        create_durably(self._disk, self._segments_dir / DIRECTORY_MARKER)  # the rename syncs it

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
                await self._write_pending()  # its acknowledged frames into its file first
                if segment.pending:
                    raise Unavailable(f"sealing segment {segment_id!r}: {segment.broken}")
                target = segment.end_offset if end_offset is None else end_offset
                if not segment.meta.start_offset <= target <= segment.end_offset:
                    raise InvalidRequest(
                        f"cannot seal segment {segment_id!r} at {target}: its entries span "
                        f"[{segment.meta.start_offset}, {segment.end_offset})"
                    )
                try:
                    position = await self._runtime.run_blocking(self._position_of, segment, target)
                except NoDescriptor as error:
                    self.stats.descriptor_refusals += 1
                    raise Unavailable(f"sealing segment {segment_id!r}: {error}") from error
                meta = replace(
                    segment.meta,
                    state=SegmentState.SEALED,
                    sealed_end_offset=target,
                    sealed_end_position=position,
                )
                try:
                    await to_completion(
                        self._runtime.run_blocking(self._seal_blocking, [(segment, meta)])
                    )
                except OSError as error:
                    raise self._fail(error, f"sealing segment {segment_id!r}") from error
                self._sealed(segment, meta)
                return segment.info()
        finally:
            segment.closing = None

    async def seal_many(self, segment_ids: list[str]) -> dict[str, SegmentInfo]:
        """Seal each segment at its durable end in one synced index batch (a restart's recovery)."""
        segments = [self._segments[sid] for sid in segment_ids if sid in self._segments]
        todo = [s for s in segments if s.meta.state is SegmentState.ACTIVE and s.closing is None]
        if todo:
            self._check_writable()
        for segment in todo:
            segment.closing = "sealed"
        try:
            await self._drain()
            async with self._lock:
                self._check_writable()
                await self._write_pending()
                unwritten = [s.meta.segment_id for s in todo if s.pending]
                if unwritten:
                    raise Unavailable(f"segments {unwritten[:5]} cannot be written yet; retry")
                items = [
                    (
                        segment,
                        replace(
                            segment.meta,
                            state=SegmentState.SEALED,
                            sealed_end_offset=segment.end_offset,
                            sealed_end_position=segment.end_position,
                        ),
                    )
                    for segment in todo
                ]
                if items:
                    try:
                        await to_completion(self._runtime.run_blocking(self._seal_blocking, items))
                    except OSError as error:
                        raise self._fail(error, f"sealing {len(items)} segments") from error
                for segment, meta in items:
                    self._sealed(segment, meta)
        finally:
            for segment in todo:
                segment.closing = None
        return {s.meta.segment_id: s.info() for s in segments}

    def _sealed(self, segment: _Segment, meta: SegmentMeta) -> None:
        assert meta.sealed_end_offset is not None and meta.sealed_end_position is not None
        cut = meta.sealed_end_position < segment.end_position
        segment.meta = meta
        segment.end_offset = segment.next_offset = meta.sealed_end_offset
        segment.written_offset = meta.sealed_end_offset
        segment.end_position = meta.sealed_end_position
        self._cache.truncate(meta.segment_id, meta.sealed_end_offset)
        if cut:  # the next checkpoint records the cut end once the file is synced
            self._mark_dirty(meta.segment_id)

    def _seal_blocking(self, items: list[tuple[_Segment, SegmentMeta]]) -> None:
        index = self._require_index()
        index.put_metas({meta.segment_id: meta.pack() for _, meta in items})
        self._sync_index(
            index
        )  # durable first: recovery finishes a cut, ignores WAL frames past it
        for segment, meta in items:
            assert meta.sealed_end_position is not None
            if meta.sealed_end_position < segment.end_position:
                try:
                    segment.file.truncate(meta.sealed_end_position)
                except NoDescriptor:  # bytes past the logical end are never read: cut it later
                    segment.file.length = meta.sealed_end_position

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
        await segment.reads_ended()  # never close a file under a reader thread
        async with self._checkpoint_lock, self._lock:
            self._check_writable()
            async with self._write_lock:  # no writer pass uses its file
                self._dirty.discard(segment_id)
                self._unwritten.pop(segment_id, None)
                self._ripe.pop(segment_id, None)
                self._unwritten_bytes -= segment.pending_bytes
                segment.pending = []
                segment.pending_bytes = 0
                try:
                    await to_completion(self._runtime.run_blocking(self._delete_blocking, segment))
                except OSError as error:
                    raise self._fail(error, f"deleting segment {segment_id!r}") from error
                del self._segments[segment_id]
                self._cache.drop(segment_id)
                self._deleted_ids.add(segment_id)
            # A WAL file may hold this segment's frames; a segment re-created with the same id must
            # never be given them by a replay, so checkpoint (without ``_write_lock``: its first
            # step is a writer pass): the WAL files go.  ``create_segment`` checks it did.
            await self._checkpoint()

    def _delete_blocking(self, segment: _Segment) -> None:
        sid = segment.meta.segment_id
        index = self._require_index()
        index.delete_segment(sid)  # its meta with it: it will not come back
        self._sync_index(index)  # durable before the file goes: a meta never names a missing file
        self.pool.forget(segment.file)
        self._disk.remove(self._segments_dir / (sid + SEGMENT_SUFFIX))
        self._removals_unsynced = True  # synced before an id can be created again

    # -- appends and group commit ----------------------------------------------------------------

    async def append(
        self, segment_id: str, base_offset: int, record_count: int, batch: bytes
    ) -> Entry:
        # Shielded: a cancelled caller does not cancel the write, which may still become durable.
        return await asyncio.shield(self.submit(segment_id, base_offset, record_count, batch))

    def submit(
        self,
        segment_id: str,
        base_offset: int,
        record_count: int,
        batch: bytes,
        on_done: OnDone[Entry] | None = None,
    ) -> asyncio.Future[Entry]:
        """Queue the append now; its future resolves once it is durable (or fails with its error).

        ``on_done`` of a durable append is called by the flush that made it so, once the
        flush's bookkeeping is done, not as a done-callback: a handle scheduled per append was
        ~1 us of the event loop's each; a refused or failed append's runs at the next turn."""
        future: asyncio.Future[Entry] = asyncio.get_running_loop().create_future()
        request = _Append(segment_id, base_offset, record_count, batch, future, on_done)
        if record_count <= 0:
            _refuse(
                request, InvalidRequest(f"an entry holds at least one record, not {record_count}")
            )
        elif not batch or len(batch) > BATCH_BYTES_MAX:
            _refuse(
                request,
                InvalidRequest(f"a batch holds 1..{BATCH_BYTES_MAX} bytes, not {len(batch)}"),
            )
        elif self._waiting or (
            self._queue and self._queue_bytes + len(batch) > self._queue_bytes_max
        ):
            try:
                self._check_writable()
            except (StorageError, Unavailable) as error:
                _refuse(request, error)
            else:
                self._waiting.append(request)
        else:
            self._admit(request)
        return future

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
            if segment.broken is not None:
                raise StorageError(
                    f"segment {request.segment_id!r} cannot be written now ({segment.broken}); "
                    "its appends are refused until it can: retry"
                )
            if request.base_offset != segment.next_offset:
                raise InvalidRequest(
                    f"append to segment {request.segment_id!r} at offset {request.base_offset}, "
                    f"but its log end is {segment.next_offset}"
                )
        except Exception as error:
            _refuse(request, error)
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
            wait_s = self._flush_started_s + self._group_commit_s - self._runtime.monotonic_s()
            if wait_s <= 0:  # at once if idle, else as soon as the running flush ends
                self._wakeup.set()
            else:  # flushes start at most once per group_commit_ms
                self._timer = self._runtime.call_later(wait_s, self._on_timer)

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
        self._flush_started_s = self._runtime.monotonic_s()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        return group

    async def _flush_loop(self) -> None:
        """Owned by the store (started by ``open``, cancelled by ``close``): one flush at a time,
        and the checkpoints between them."""
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            if self._queue:
                async with self._lock:
                    if self._failure is None:
                        await self._flush_group()
                    else:
                        self._fail_all(self._failure)
                if self._queue and self._timer is None:  # left over from a full group
                    self._wakeup.set()
                self._admit_waiting()
            if self._checkpoint_due():
                self._start_checkpoint()

    async def _flush_group(self) -> None:
        group = self._take_group()
        self._inflight = group
        self._admit_waiting()  # the queue has room again: waiting appends form the next group
        # As one step: a cancelled flusher (close, crash) still resolves the group it took.
        await to_completion(self._flush_and_resolve(group))

    async def _flush_and_resolve(self, group: list[_Append]) -> None:
        started_s = self._runtime.monotonic_s()
        try:
            result = await self._runtime.run_blocking(self._flush_blocking, group)
            self._complete(group, result, self._runtime.monotonic_s() - started_s)
        except Exception as error:  # OSError, or a broken invariant: never acknowledge
            if not isinstance(error, OSError):
                log.exception("flush failed on a broken invariant")
            failure = self._fail(error, "flushing")
            for request in group:
                _refuse(request, failure)
            self._fail_all(failure)
        finally:
            self._inflight = []

    def _flush_blocking(self, group: list[_Append]) -> _FlushResult:
        """Off the event loop, under ``_lock``: the group's frames to the WAL, fsynced: that is all
        an acknowledgement waits for (the segment files are written by ``_write_pending``)."""
        frames = [encode_frame(a.segment_id, a.base_offset, a.record_count, a.batch) for a in group]
        with self.syncs.tally() as made:  # not a checkpoint's, syncing beside it
            self._wal.append(frames)  # may roll: the retired file waits for a checkpoint
        return _FlushResult(frames=frames, fsyncs=made.count)

    def _complete(self, group: list[_Append], result: _FlushResult, flush_s: float) -> None:
        idle = not self._unwritten and not self._dirty  # no checkpoint armed for them yet
        segments, unwritten, ripe = self._segments, self._unwritten, self._ripe
        write_bytes, cache_add = self._segment_write_bytes, self._cache.add
        records = batch_bytes = frame_bytes = 0
        done: list[tuple[OnDone[Entry], asyncio.Future[Entry]]] = []
        for request, frame in zip(group, result.frames, strict=True):
            sid = request.segment_id
            segment = segments[sid]
            base = request.base_offset
            assert base == segment.end_offset, "offsets must stay contiguous"
            entry = Entry(base, request.record_count, request.batch)
            end = segment.end_offset = base + request.record_count
            segment.pending.append((base, end, frame))
            segment.pending_bytes += len(frame)
            frame_bytes += len(frame)
            unwritten[sid] = None
            if segment.pending_bytes >= write_bytes:
                ripe[sid] = None
            cache_add(sid, entry)
            if not request.future.done():
                request.future.set_result(entry)
                if request.on_done is not None:
                    done.append((request.on_done, request.future))
            records += request.record_count
            batch_bytes += len(request.batch)
        self._unwritten_bytes += frame_bytes
        self.stats.flushed_records += records
        self.stats.flushed_bytes += batch_bytes
        if idle and self._unwritten:
            self._arm_checkpoint()
        if self._unwritten_bytes >= self._unwritten_bytes_max:
            self._write_all = True
            self._write_urgent = True  # memory held for the files: not behind every busy thread
        if self._ripe or self._write_all:
            self._write_wakeup.set()
        self.stats.flushes += 1
        self.stats.flushed_appends += len(group)
        self.stats.flush_appends_max = max(self.stats.flush_appends_max, len(group))
        self.stats.flush_s_total += flush_s
        self.stats.flush_s_buckets[bisect.bisect_left(FLUSH_SECONDS_BUCKETS, flush_s)] += 1
        self.stats.fsyncs += result.fsyncs
        for on_done, future in done:  # the store's state is whole again: callers may look at it
            call_done(on_done, future)

    # -- segment writes ----------------------------------------------------------------------------

    async def _write_loop(self) -> None:
        """Owned by the store: write acknowledged frames to their segment files, beside the flushes.

        A pass takes the segments whose acknowledged frames reach
        ``segment_write_bytes`` (all of them once ``unwritten_bytes_max`` is
        reached, or when a read waits for its frames); the others wait for the
        checkpoint, which writes everything first.  So each write carries many
        appends whatever the number of segments written at once: with 10 KB
        appends to 512 segments a pass per flush wrote each append on its own
        (measured: ~60 us of CPU per O_DIRECT write here, and 512 new files made
        while the appends went on).  The frames wait in memory and in the WAL,
        which keeps them durable.  A pass runs on the background threads
        (``lower_thread_priority``) unless a read waits for it or the bound
        forced it: memory held for the files must not wait for an idle CPU.
        """
        while True:
            await self._write_wakeup.wait()
            self._write_wakeup.clear()
            if self._failure is None:
                everything, self._write_all = self._write_all, False
                urgent, self._write_urgent = self._write_urgent, False
                with contextlib.suppress(StorageError):  # fail-stop, logged by _fail
                    await self._write_pending(everything, background=not urgent)

    async def _write_pending(self, everything: bool = True, *, background: bool = False) -> None:
        """Write the acknowledged frames not yet in their segment files (one pass,
        ``_write_lock``): every segment's, or only the ripe segments' (``everything`` False);
        ``background``: nobody waits for the pass, which runs on threads that yield the CPU.

        Raises the store's ``StorageError`` once it has failed (a pass that ran
        while this one waited may have failed it): a seal or checkpoint must
        not go on as if its frames were written."""
        async with self._write_lock:
            if self._failure is not None:
                raise self._failure
            taken: dict[str, tuple[_Segment, list[tuple[int, int, bytes]]]] = {}
            for sid in self._unwritten if everything else self._ripe:
                segment = self._segments.get(sid)
                if segment is not None and segment.pending:
                    taken[sid] = (segment, segment.pending)
                    segment.writing_bytes = segment.pending_bytes
                    self._unwritten_bytes -= segment.pending_bytes
                    segment.pending = []
                    segment.pending_bytes = 0
            if everything:
                self._unwritten = {}
            else:
                for sid in taken:
                    del self._unwritten[sid]
            self._ripe = {}
            if taken:
                # The pass and its bookkeeping as one step: a cancelled caller never leaves frames
                # written to a file but still counted as pending (a checkpoint would then drop
                # the WAL that is their only record in the index).
                await to_completion(self._write_pass(taken, background))

    def _runner(self, background: bool) -> Callable[..., Awaitable[Any]]:
        """Where a blocking step runs: on threads that yield the CPU when nobody waits for it."""
        return self._runtime.run_background if background else self._runtime.run_blocking

    async def _write_pass(
        self, taken: dict[str, tuple[_Segment, list[tuple[int, int, bytes]]]], background: bool
    ) -> None:
        try:
            outcomes = await self._runner(background)(self._write_blocking, taken, background)
        except OSError as error:
            for sid, (segment, frames) in taken.items():
                self._keep_pending(sid, segment, frames)
            self._written_event.set()
            raise self._fail(error, "writing segment files") from error
        for sid, (segment, frames) in taken.items():
            outcome = outcomes[sid]
            if isinstance(outcome, NoDescriptor):  # kept: written at the next pass
                self._keep_pending(sid, segment, frames)
                self._ripe[sid] = None
                if segment.broken is None:
                    self.stats.descriptor_refusals += 1
                    log.error(
                        "fps store %s: segment %r not written: %s; its appends are refused "
                        "until it is (its acknowledged entries are safe in the WAL)",
                        self.data_dir, sid, outcome,
                    )  # fmt: skip
                segment.broken = str(outcome)
                continue
            segment.writing_bytes = 0
            segment.broken = None
            segment.end_position = outcome
            segment.written_offset = frames[-1][1]
            self._mark_dirty(sid)
        self.stats.segment_write_passes += 1
        self.stats.segment_writes += len(taken)
        event, self._written_event = self._written_event, asyncio.Event()
        event.set()

    def _keep_pending(
        self, sid: str, segment: _Segment, frames: list[tuple[int, int, bytes]]
    ) -> None:
        """Frames a pass took but could not write go back in front of the segment's pending."""
        segment.pending = frames + segment.pending
        segment.pending_bytes += segment.writing_bytes
        self._unwritten_bytes += segment.writing_bytes
        segment.writing_bytes = 0
        self._unwritten[sid] = None

    def _write_blocking(
        self, taken: dict[str, tuple[_Segment, list[tuple[int, int, bytes]]]], background: bool
    ) -> dict[str, int | NoDescriptor]:
        """Append each segment's frames (side by side), then their index points; the new ends."""
        index = self._require_index()
        written = _append_all(
            {segment.file: frames for segment, frames in taken.values()}, _pool(background)
        )
        outcomes: dict[str, int | NoDescriptor] = {}
        points: list[IndexPoint] = []
        for sid, (segment, frames) in taken.items():
            outcome = written[segment.file]
            if isinstance(outcome, NoDescriptor):
                outcomes[sid] = outcome
                continue
            position = outcome
            if segment.indexed_position < 0:
                point = index.floor(sid, max(frames[0][0] - 1, segment.meta.start_offset))
                segment.indexed_position = 0 if point is None else point.position
            for base_offset, _end_offset, frame in frames:
                if position - segment.indexed_position >= self._index_interval_bytes:
                    points.append(IndexPoint(sid, base_offset, position))
                    segment.indexed_position = position
                position += len(frame)
            outcomes[sid] = position
        if points:
            index.write(points, {})  # ends are recorded by checkpoints, once the files are synced
        return outcomes

    # -- checkpoints -------------------------------------------------------------------------------

    def _mark_dirty(self, segment_id: str) -> None:
        if not self._dirty and not self._unwritten:
            self._arm_checkpoint()
        self._dirty.add(segment_id)

    def _arm_checkpoint(self) -> None:
        """Written or acknowledged frames wait for a checkpoint from now: one is due in
        ``checkpoint_ms`` (the unwritten ones are written by it)."""
        self._dirty_since_s = self._runtime.monotonic_s()
        if self._checkpoint_timer is None and self._state == "open":
            self._checkpoint_timer = self._runtime.call_later(
                self._checkpoint_s, self._on_checkpoint_timer
            )

    def _on_checkpoint_timer(self) -> None:
        # Due now, even if the clock says a hair less: uvloop runs a timer from the time cached
        # at its iteration's start, in whole ms, so it may fire early; a checkpoint refused then
        # was never asked for again while nothing more was written.
        self._checkpoint_timer = None
        self._checkpoint_asked = True
        self._wakeup.set()

    def _checkpoint_due(self) -> bool:
        if self._checkpointer is not None and not self._checkpointer.done():
            return False
        if self._wal.has_retired():
            return True
        return bool(self._dirty or self._unwritten) and (
            self._checkpoint_asked
            or self._runtime.monotonic_s() - self._dirty_since_s >= self._checkpoint_s
        )

    async def _checkpoint(self) -> bool:
        """With ``_checkpoint_lock`` and ``_lock`` held by the caller (delete, close), never
        ``_write_lock`` (it begins with a writer pass): every step of a checkpoint under them."""
        taken = await self._checkpoint_begin(background=False)
        skipped = await self._checkpoint_sync(taken, background=False)
        return await self._checkpoint_end(taken, skipped, background=False)

    def _start_checkpoint(self) -> None:
        if self._checkpointer is None or self._checkpointer.done():
            self._checkpointer = asyncio.get_running_loop().create_task(
                self._background_checkpoint(), name="fps-checkpoint"
            )

    async def _background_checkpoint(self) -> None:
        """Beside the flushes: ``_lock`` only to take the dirty set and to record the ends.

        The fsyncs run while flushes go on appending (an fsync covers at least
        what was written before it began, which is what the ends taken record).
        ``_checkpoint_lock`` keeps deletes and reopens, which close files, out.
        """
        if self._failure is not None or self._state != "open":
            return
        # A timed checkpoint waits for an idle CPU; one that releases a full WAL file does not:
        # on CPUs kept busy by other threads, WAL files would pile up on disk (and in a replay).
        background = not self._wal.has_retired()
        with contextlib.suppress(StorageError, Unavailable):  # fail-stop (logged by _fail); closing
            await self._checkpoint_beside_flushes(background=background)
        if self._checkpoint_asked:  # its timer fired while this one ran: the flusher looks again
            self._wakeup.set()

    async def _checkpoint_begin(self, background: bool) -> _Checkpoint:
        """Roll the WAL (every frame before it is in a segment file now) and take the dirty set."""
        if self._checkpoint_timer is not None:
            self._checkpoint_timer.cancel()
            self._checkpoint_timer = None
        self._checkpoint_asked = False
        # every frame the WAL holds now is then in a segment file
        await self._write_pending(background=background)
        dirty = [self._segments[sid] for sid in self._dirty if sid in self._segments]
        taken = _Checkpoint(
            dirty,
            {s.meta.segment_id: SegmentEnd(s.end_position, s.written_offset) for s in dirty},
            started_s=self._runtime.monotonic_s(),
            unwritten=bool(self._unwritten),  # no descriptor to write some: keep the WAL
        )
        self._dirty = set()
        if self._unwritten:  # acknowledged while the pass ran: the next checkpoint writes them
            self._arm_checkpoint()
        try:
            taken.covered = await to_completion(self._runner(background)(self._roll_wal))
        except OSError as error:
            self._redirty(taken.ends)
            raise self._fail(error, "rolling the WAL") from error
        return taken

    def _roll_wal(self) -> list[Path]:
        if self._wal.position:
            with self._checkpoint_syncs():
                self._wal.roll()
        return self._wal.take_retired()

    @contextlib.contextmanager
    def _checkpoint_syncs(self) -> Iterator[None]:
        """Count the fsyncs made in the block, by this thread and those it fans out to, as the
        checkpoint's (a failed step's too: they were made); not the flushes' beside it."""
        with self.syncs.tally() as made:
            try:
                yield
            finally:
                self.stats.checkpoint_fsyncs += made.count

    async def _checkpoint_sync(self, taken: _Checkpoint, background: bool) -> set[str]:
        """fsync the files, side by side; the segments no descriptor was left for are returned."""
        if not taken.dirty:
            return set()
        try:
            skipped = await to_completion(
                self._runner(background)(
                    self._sync_files, [s.file for s in taken.dirty], background
                )
            )
        except OSError as error:
            self._wal.retire(taken.covered)  # still needed: nothing is released
            self._redirty(taken.ends)
            raise self._fail(error, "syncing segment files") from error
        paths = {file.path for file in skipped}
        return {s.meta.segment_id for s in taken.dirty if s.file.path in paths}

    def _sync_files(self, files: list[SegmentFile], background: bool) -> list[SegmentFile]:
        """fsync ``files`` side by side (from ``SYNC_ALL_FILES_MIN`` files: one sync of them all,
        where the disk has one), then their directory if one of them was made since its last
        sync (a new segment's first write makes its file): an end is recorded only for a file
        whose bytes and directory entry are both durable.  Returns the files skipped."""
        with self._checkpoint_syncs():
            skipped = self._sync_segment_files(files, _pool(background))
            left_out = set(skipped)
            made = [file for file in files if not file.on_disk and file not in left_out]
            if made:
                self._sync_segments_dir()
            for file in made:
                file.on_disk = True
        return skipped

    def _sync_segment_files(
        self, files: list[SegmentFile], pool: ThreadPoolExecutor
    ) -> list[SegmentFile]:
        """Make ``files``' writes durable: from ``SYNC_ALL_FILES_MIN`` files in one sync of them
        all where the disk has one (a closed file's too: no descriptor needed), else an fsync
        each, side by side on ``pool``.  Returns the files no descriptor was left for."""
        if len(files) >= SYNC_ALL_FILES_MIN and self._disk.sync_all(self._segments_dir):
            return []
        return _fsync_all(files, pool)

    async def _checkpoint_end(
        self, taken: _Checkpoint, skipped: set[str], background: bool
    ) -> bool:
        """Record the synced ends, sync the index, then remove the WAL files the checkpoint covers;
        return whether it removed them all (nothing acknowledged is then only in the WAL)."""
        ends = {sid: end for sid, end in taken.ends.items() if sid not in skipped}
        keep = bool(skipped) or taken.unwritten
        try:
            await to_completion(
                self._runner(background)(self._record_ends, ends, taken.covered, keep)
            )
        except Exception as error:
            self._wal.retire(taken.covered)
            self._redirty(taken.ends)
            raise self._fail(error, "recording segment ends") from error
        self._redirty({sid: taken.ends[sid] for sid in skipped})
        self.stats.descriptor_refusals += len(skipped)
        self.stats.checkpoints += 1
        self.stats.checkpoint_s_total += self._runtime.monotonic_s() - taken.started_s
        if not keep:  # every WAL file from before this checkpoint is gone
            if self._deleted_ids:  # ... not durably yet: synced before the next create
                self._removals_unsynced = True
            self._deleted_ids.clear()
        return not keep

    def _record_ends(self, ends: dict[str, SegmentEnd], covered: list[Path], keep: bool) -> None:
        index = self._require_index()
        index.write([], ends)
        with self._checkpoint_syncs():
            self._sync_index(index)
        if keep:
            self._wal.retire(covered)  # still needed by the files not synced
        else:
            self._wal.remove(covered)

    def _sync_index(self, index: OffsetIndex) -> None:
        index.sync()
        self.syncs.add("index")

    def _redirty(self, ends: dict[str, SegmentEnd]) -> None:
        for sid in ends:
            if sid in self._segments:
                self._mark_dirty(sid)

    def _fail(self, error: BaseException, doing: str) -> StorageError:
        """Enter fail-stop; the returned error is what every unacknowledged append gets."""
        failure = StorageError(f"disk error while {doing}: {error}; the store must be reopened")
        if self._failure is None:
            log.error(
                "fps store %s: %s; refusing all writes until reopened", self.data_dir, failure
            )
            self._failure = failure
        return failure

    def _fail_all(self, failure: Exception) -> None:
        for request in (*self._queue, *self._waiting):
            _refuse(request, failure)
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
        self._check_readable()
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
        while offset >= segment.written_offset:  # acknowledged, not yet in the file: one pass away
            if segment.broken is not None or self._failure is not None:
                raise StorageError(
                    f"segment {segment_id!r} at offset {offset} is not readable now "
                    f"({segment.broken or self._failure}); retry"
                )
            written = self._written_event
            self._write_all = True
            self._write_urgent = True  # a reader waits for this pass: not in the background
            self._write_wakeup.set()
            await written.wait()
            self._check_readable()
            segment = self._get(segment_id)
        if segment.closing == "deleted":
            raise NotFound(f"segment {segment_id!r} is being deleted")
        self._check_readable()  # then counted: close, crash and reopen wait for it to end
        end_position = segment.end_position
        segment.reads_inflight += 1
        if segment.reads_idle is None:  # most segments are never read: a restart makes none
            segment.reads_idle = asyncio.Event()
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
                segment.reads_idle.set()  # made by this read

    def _check_readable(self) -> None:
        if self._released:
            raise StorageError(f"the store is reopening after a disk error ({self._failure})")
        if self._state == "closed":
            raise Unavailable("the store is closed")

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
        removed = False  # a file removed here: the directory is synced before anything is created
        present: set[str] = set()  # segments whose file is listed
        legacy: list[str] = []
        for name in disk.listdir(self._segments_dir):  # one pass: 20k+ names here
            if name.endswith(SEGMENT_SUFFIX):
                present.add(name[: -len(SEGMENT_SUFFIX)])
            elif name.endswith((".tmp", ".deleted")):
                disk.remove(self._segments_dir / name)
                removed = True
            elif name.endswith(META_SUFFIX):
                legacy.append(name)
        if legacy:  # a data directory of the file-per-meta layout: move the metas into the index
            metas_read = [read_meta(disk, self._segments_dir / n) for n in legacy]
            index.put_metas({meta.segment_id: meta.pack() for meta in metas_read})
            self._sync_index(index)
            for name in legacy:
                disk.remove(self._segments_dir / name)
        metas = {sid: SegmentMeta.unpack(sid, packed) for sid, packed in index.metas().items()}
        for sid in present.difference(metas):  # orphans of a delete cut by a crash
            disk.remove(self._segments_dir / (sid + SEGMENT_SUFFIX))
            present.discard(sid)
            removed = True
        ends = index.ends()
        for sid in ends:
            if sid not in metas:
                index.delete_segment(sid)
        for meta in metas.values():
            sid = meta.segment_id
            # Durable only if an end was recorded for it (after its directory was synced): a file
            # listed now may be one whose entry a power loss would still take.
            exists = sid in present
            on_disk = exists and sid in ends
            self._segments[sid] = self._recover_segment(meta, ends.get(sid), on_disk, exists)

        report = ReplayReport()
        wal_files = sorted(self._wal.existing())
        wal_frames = [frame for path in wal_files for frame in self._wal.replay(path, report)]
        adopted: list[str] = []
        for sid in dict.fromkeys(frame.segment_id for frame in wal_frames):
            segment = self._segments.get(sid)
            if segment is not None and sid in present and self._adopt_tail(segment):
                adopted.append(sid)
        replayed: dict[str, list[bytes]] = {}  # per segment, frames to append, in order
        points: list[IndexPoint] = []
        for frame in wal_frames:
            segment = self._replay_frame(frame)
            if segment is None:
                continue
            sid = frame.segment_id
            if sid not in replayed:  # cut back to the durable end before appending
                segment.file.recover(segment.end_position)
                if segment.indexed_position < 0:
                    point = index.floor(sid, max(segment.end_offset - 1, segment.meta.start_offset))
                    segment.indexed_position = 0 if point is None else point.position
            data = encode_frame(sid, frame.base_offset, frame.record_count, frame.batch)
            position = segment.end_position
            if position - segment.indexed_position >= self._index_interval_bytes:
                points.append(IndexPoint(sid, frame.base_offset, position))
                segment.indexed_position = position
            replayed.setdefault(sid, []).append(data)
            segment.end_position += len(data)
            segment.end_offset = segment.next_offset = frame.end_offset
            self.stats.recovered_frames += 1
        new_ends: dict[str, SegmentEnd] = {}
        for sid, frames in replayed.items():
            segment = self._segments[sid]
            segment.file.append(frames)
            assert segment.file.length == segment.end_position
            new_ends[sid] = SegmentEnd(segment.end_position, segment.end_offset)
        for sid in adopted:
            if sid not in new_ends:
                segment = self._segments[sid]
                new_ends[sid] = SegmentEnd(segment.end_position, segment.end_offset)
        files = [self._segments[sid].file for sid in new_ends]
        skipped = self._sync_segment_files(files, _FSYNC_POOL)  # a start: everything waits for it
        if skipped:
            raise NoDescriptor(0, f"recovery could not open {len(skipped)} segment files to sync")
        if files or removed:
            self._sync_segments_dir()  # their entries durable before the WAL that holds them goes
            for file in files:
                file.on_disk = True
        else:  # an earlier process's removals may not be durable: synced before the first create
            self._removals_unsynced = True
        index.write(points, new_ends)
        for segment in self._segments.values():
            sealed_end = segment.meta.sealed_end_offset
            if sealed_end is not None and segment.end_offset != sealed_end:
                self.stats.recovery_lost_entries += 1
                log.error(
                    "segment %s was sealed at %d but only [%d, %d) survived: acknowledged data is lost",
                    segment.meta.segment_id, sealed_end, segment.meta.start_offset, segment.end_offset,
                )  # fmt: skip
        for segment in self._segments.values():
            segment.written_offset = segment.end_offset  # recovery wrote everything to the files
        self._sync_index(index)  # from here on the WAL files are redundant
        for path in report.corrupt_files:
            disk.rename(path, path.with_name(path.name + ".corrupt"))  # kept for inspection
        sequence = self._wal.next_sequence()
        self._wal.retire([path for path in wal_files if path not in report.corrupt_files])
        self._wal.remove_retired()
        self._wal.start(sequence)  # its file's durable creation makes the removals durable too
        log.info(
            "fps store %s open: %d segments, %d WAL frames read, %d re-applied, %d torn bytes dropped, "
            "%d corrupt WAL frames, %d entries lost",
            self.data_dir, len(self._segments), report.frames, self.stats.recovered_frames,
            report.torn_bytes, report.corrupt_frames, self.stats.recovery_lost_entries,
        )  # fmt: skip

    def _adopt_tail(self, segment: _Segment) -> bool:
        """Keep the whole, CRC-checked frames a flush wrote past the synced end before a crash.

        After a killed process (not a power loss) the page cache still holds
        what flushes wrote since the last checkpoint: keeping it avoids
        rewriting it, and serves it when the WAL's copy is damaged.  A frame
        is kept only if its CRC holds, it names this segment and continues
        its offsets (and stays within its seal); the first that does not ends
        the tail, which recovery then cuts.  Returns whether any was kept.
        """
        file = segment.file
        sid = segment.meta.segment_id
        size = file.physical_size()
        if size <= segment.end_position:
            return False
        data = file.read(segment.end_position, size - segment.end_position)
        position = 0
        sealed_end = segment.meta.sealed_end_offset
        kept = 0
        while True:
            decoded = decode_frame(data, position, verify_body=True)
            frame = decoded.frame
            if (
                decoded.status is not FrameStatus.OK
                or frame is None
                or frame.segment_id != sid
                or frame.base_offset != segment.end_offset
                or (sealed_end is not None and frame.end_offset > sealed_end)
            ):
                break
            position += decoded.frame_bytes
            segment.end_offset = segment.next_offset = frame.end_offset
            kept += 1
        if not kept:
            return False
        segment.end_position += position
        file.recover(segment.end_position)  # drop what follows the last good frame
        segment.indexed_position = -1
        self.stats.adopted_frames += kept
        return True

    def _recover_segment(
        self, meta: SegmentMeta, end: SegmentEnd | None, on_disk: bool, exists: bool
    ) -> _Segment:
        """The segment as the index left it; its file is not opened (the pool opens it on demand)."""
        end = end or SegmentEnd(0, meta.start_offset)
        sealed_end = meta.sealed_end_offset
        sealed_position = meta.sealed_end_position
        if sealed_end is not None and sealed_position is not None and sealed_end < end.end_offset:
            end = SegmentEnd(sealed_position, sealed_end)  # a seal with truncation cut short
            self._require_index().truncate(meta.segment_id, end)
        return _Segment(
            meta,
            self._segment_file(meta.segment_id, end.position, on_disk=on_disk, exists=exists),
            end_offset=end.end_offset,
            end_position=end.position,
            next_offset=end.end_offset,
            indexed_position=-1,
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
