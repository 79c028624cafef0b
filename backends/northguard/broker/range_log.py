"""One range's log on the data plane: assign offsets, append to the active segment, commit in order.

**Back of the envelope** (2 cores, CPython, the fps store's group commit).
An Append costs the broker one frame parse (~2 us), one CRC32C pass over the
batch (~1 GB/s: 10 us for 10 KB), an offset assignment and one store task
(~15-25 us of asyncio work), and its share of one Ack frame.  With the
client's 100-record batches of 100-byte values that is ~40 us per 100
records: ~25k appends/s, ~2.5M records/s, 250 MB/s on one core before the
store's own cost (its docstring: ~18k appends/s through one flush loop).
The client's record encoding (~1 us per record) is the real ceiling, so the
broker never looks inside a batch.  Latency is the store's flush in progress
(its group commit is self-clocking, flushes at least ``group_commit_ms`` apart)
plus one flush (one fsync) plus one round trip: ~3-8 ms at the median unloaded
(a 10 ms group-commit window added ~5).

**Commit rule.**  An append is committed when the store has made it durable
*and* every append before it in the range is committed; only then does its
future resolve, the committed offset move and tail readers wake.  Appends
are handed to the store in offset order without waiting for each other, so
one group commit carries many appends of many ranges.

**Leadership.**  The broker leading the range's active segment (the first of
its replica set, any broker) runs this; elsewhere the range's log refuses
appends and reads at its end with ``NotLeader`` (``led_by``), so clients
follow the topic metadata.  When the coordinator seals a segment led here
(``fence``, then ``sealed_at``), the same cut and resend apply as below.

**Replication.**  A segment with followers has a ``Replicator``
(``replication.py``): every issued append is also sent to the followers, and
an append commits only when the local store made it durable *and* every
follower acknowledged it durable (``acked_end``).  When a follower fails (its
stream breaks, or it does not acknowledge within the replica timeout) the
range is *fenced*: new appends wait, and once the local store appends in
flight have ended the roll seals the segment on the survivors at the smallest
log end among them (``Coordinator._roll``).  In-flight appends below that end
are then committed and acknowledged (every survivor has them durably);
those past it are cut from the survivors and issued again, first, on the new
segment, with the same futures: the producer's stream never sees the
failure and nothing is stored twice.

**Segments.**  The range appends to its active segment until it reaches the
size or age limit, then ``roll`` waits for the in-flight appends, seals the
segment at its durable end and asks the coordinator for a new one.  A log
built after a restart continues the segment the previous process left active,
from the end the store recovered (everything there is durable: the WAL was
fsynced before any of it was acknowledged), so a restart seals nothing.  Appends
that arrive meanwhile wait (bounded by the producers' windows and by
``WAITING_APPENDS_MAX``).  A failed append breaks the range's pipeline: every
later in-flight append fails too (their offsets depended on it), and the next
roll seals the segment at what the store holds and starts a fresh one.

**Duplicates.**  ``ProducerState`` remembers, per producer id, its epoch and
the futures of its last ``DEDUP_APPENDS_MAX`` appends by sequence number, so
a resend gets the original offsets instead of a second copy.  The identity
(producer id, epoch, sequence) travels in each batch's header and is stored
with the batch (WAL, segment file), so the table is *persisted with the
log*: a log built after a restart rebuilds it by reading the headers of its
last segment (``producers_loaded``; appends wait for it), and a batch
resent across a SIGKILL or a SIGTERM is still recognised.  Cost: one read of
the last segment per range at the first append after a restart, at most
``segment_bytes_max`` (~1 GB/s from the page cache, CRC included).  Bounds:
``PRODUCERS_MAX`` ids per range (least recently used dropped) and
``DEDUP_APPENDS_MAX`` appends per id; a resend older than that window, a
sequence gap and an older epoch are refused (``OutOfOrderSequence``,
``ProducerFenced``).  Not covered yet: a retry whose original sits in a
segment before the last one (a roll and a restart between send and resend).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from backends.northguard.batch import NO_PRODUCER, batch_producer
from backends.northguard.broker.log_limit import LogLimiter
from backends.northguard.broker.replication import Replicator
from backends.northguard.broker.state import RangeMeta, SegmentMeta, State
from backends.northguard.runtime import Runtime
from backends.northguard.store.base import (
    Entry,
    OnDone,
    SegmentStore,
    call_done,
    call_done_later,
)
from xinfra.errors import (
    BackendUnavailable,
    Backpressure,
    CorruptData,
    InvalidRequest,
    NotFound,
    NotLeader,
    OffsetOutOfRange,
    ProducerFenced,
    Sealed,
    TopicNotFound,
    XinfraError,
)

log = logging.getLogger(__name__)
_SEALED = State.SEALED  # the enum attribute costs a lookup per append
_limited = LogLimiter(log, interval_s=10.0)
"""A failed disk fails every range's appends and rolls: one line per kind per 10 s, not per range."""

WAITING_APPENDS_MAX = 100_000
"""Appends a range holds while it rolls its segment; past it, appends fail with Backpressure."""
DEDUP_APPENDS_MAX = 4096
"""Appends per producer remembered for duplicate detection (at least the largest window)."""
PRODUCERS_MAX = 1024
"""Producer ids per range remembered for duplicate detection (least recently used dropped)."""
PRODUCER_SCAN_CHUNK_BYTES = 1 << 20
"""Bytes per store read while rebuilding the producer table from the last segment."""

Roller = Callable[["RangeLog", bool], Awaitable[str | None]]
"""The coordinator's roll: seal the active segment (if any); open a new one when asked."""


@dataclass(slots=True)
class _Inflight:
    base_offset: int
    count: int
    future: asyncio.Future[int]
    on_done: OnDone[int] | None
    batch: bytes  # kept until committed: re-issued on the next segment if a fence cuts it
    outcome: BaseException | bool | None = None  # None: not stored yet; True: durable


@dataclass(slots=True)
class ProducerState:
    next_seq: int
    epoch: int = 0
    recent: OrderedDict[int, asyncio.Future[int]] = field(default_factory=OrderedDict)

    def remember(self, seq: int, future: asyncio.Future[int]) -> None:
        """Record an append of ``seq`` (the window keeps the last ``DEDUP_APPENDS_MAX``)."""
        self.recent[seq] = future
        self.recent.move_to_end(seq)
        if seq >= self.next_seq:
            self.next_seq = seq + 1
        while len(self.recent) > DEDUP_APPENDS_MAX:
            self.recent.popitem(last=False)


class RangeLog:
    """The data plane of one range on this broker (the leader of its active segment)."""

    def __init__(
        self,
        runtime: Runtime,
        store: SegmentStore,
        meta: RangeMeta,
        segments: dict[str, SegmentMeta],
        roller: Roller,
        *,
        segment_bytes_max: int,
        segment_age_ms_max: int,
    ) -> None:
        self._runtime = runtime
        self._store = store
        self.meta = meta
        self._segments = segments
        self._roller = roller
        self._segment_bytes_max = segment_bytes_max
        self._segment_age_ms_max = segment_age_ms_max
        self._loop = asyncio.get_running_loop()
        self.active: str | None = None
        self.active_created_ms = 0
        self._active_bytes = 0
        last = segments[meta.segments[-1]] if meta.segments else None
        if last is not None and last.state is State.ACTIVE:
            # Left active by the previous process: continue it from the end the store recovered
            # (what its WAL and file hold, all durable), with its age and size kept.
            self.active = last.segment_id
            self.active_created_ms = last.created_ms
            try:
                info = store.segment(last.segment_id)
                self._active_bytes, self.committed = info.size_bytes, info.end_offset
            except NotFound:  # led by another broker (the coordinator's view of the range)
                self._active_bytes, self.committed = 0, last.start_offset
            if len(last.replicas) > 1:
                # Replicated: what is committed is known only once the followers are fenced
                # (their ends); until then nothing of this segment is readable.
                self.committed = last.start_offset
        elif last is not None:
            assert last.end_offset is not None
            self.committed = last.end_offset
        else:
            self.committed = meta.start_offset
        self._next_offset = self.committed
        self._inflight: deque[_Inflight] = deque()
        self._waiting: deque[tuple[bytes, int, asyncio.Future[int], OnDone[int] | None]] = deque()
        self._broken: BaseException | None = None
        self.replicator: Replicator | None = None
        self.fenced: XinfraError | None = None  # a follower failed: seal on the survivors
        self.needs_fence = bool(
            last is not None and last.state is State.ACTIVE and len(last.replicas) > 1
        )
        self._roll_task: asyncio.Task[None] | None = None
        self._storing = 0  # local store appends in flight
        self._idle = asyncio.Event()  # set while no local store append is in flight
        self._idle.set()
        self._listeners: set[Callable[[], None]] = set()
        self.producers: OrderedDict[int, ProducerState] = OrderedDict()
        self.producers_loaded: asyncio.Future[None] = self._loop.create_future()
        self._load_task: asyncio.Task[None] | None = None
        if self.needs_fence:
            pass  # loaded from the sealed segment once the fence cut it (``_roll``)
        elif last is not None and self._store_has(last.segment_id):
            self._load_task = self._loop.create_task(self._load_producers(last.segment_id))
        else:
            self.producers_loaded.set_result(None)
        self.closing = False  # a split, merge or topic seal is sealing this range: no new segment
        self.remote_read: Callable[[SegmentMeta, int, int], Awaitable[list[Entry]]] | None = None
        """Reads a sealed segment this broker does not hold from one of its replicas (set in
        a cluster: a leader need not hold every segment of its range)."""
        self.led_by: str | None = None
        """The address of the broker leading the active segment when it is not this one
        (appends and reads are refused with ``NotLeader``: clients go there)."""

    # -- appends ---------------------------------------------------------------------------------

    def append(
        self, batch: bytes, count: int, on_done: OnDone[int] | None = None
    ) -> asyncio.Future[int]:
        """Queue a checked batch; the future resolves to its base offset once committed.

        ``on_done(future)`` runs once it is resolved, never inside this call: the commit calls
        it, in offset order, not as a done-callback (a handle scheduled per append); an append
        that failed, or was resolved by a seal, has it run at the next turn."""
        future: asyncio.Future[int] = self._loop.create_future()
        if self.meta.state is _SEALED or self.closing:
            future.set_exception(Sealed(f"range {self.meta.range_id} is sealed"))
            call_done_later(on_done, future)
        elif self.led_by is not None:
            future.set_exception(self.not_leader())
            call_done_later(on_done, future)
        elif self._roll_task is not None or self._needs_roll(len(batch)):
            if len(self._waiting) >= WAITING_APPENDS_MAX:
                future.set_exception(
                    Backpressure(f"range {self.meta.range_id} is rolling its segment; retry")
                )
                call_done_later(on_done, future)
            else:
                self._waiting.append((batch, count, future, on_done))
                self._start_roll(open_new=True)
        else:
            self._issue(batch, count, future, on_done)
        return future

    def _needs_roll(self, batch_bytes: int) -> bool:
        if (
            self.active is None
            or self._broken is not None
            or self.fenced is not None
            or self.needs_fence
        ):
            return True
        if self._active_bytes and self._active_bytes + batch_bytes > self._segment_bytes_max:
            return True
        return self._runtime.wall_ms() - self.active_created_ms >= self._segment_age_ms_max

    def _issue(
        self, batch: bytes, count: int, future: asyncio.Future[int], on_done: OnDone[int] | None
    ) -> None:
        assert self.active is not None
        item = _Inflight(self._next_offset, count, future, on_done, batch)
        self._next_offset += count
        self._active_bytes += len(batch)
        self._inflight.append(item)
        self._storing += 1
        self._idle.clear()
        self._store.submit(
            self.active, item.base_offset, count, batch, functools.partial(self._stored, item)
        )
        if self.replicator is not None:
            self.replicator.send(item.base_offset, count, batch, self.committed)

    def _stored(self, item: _Inflight, stored: asyncio.Future[Entry]) -> None:
        if stored.cancelled():
            # Not Sealed: the range takes appends again once the broker is back, and the
            # producer's resend (same producer id and sequence) is stored once.
            item.outcome = BackendUnavailable("append cancelled: the broker is stopping; retry")
        else:
            error = stored.exception()
            item.outcome = True if error is None else error
        self._storing -= 1
        self.advance()
        if not self._storing:
            self._idle.set()
            if self._broken is not None:
                self._start_roll(open_new=bool(self._waiting))
            elif self.fenced is not None and self._inflight:
                self._start_roll(open_new=True)

    def advance(self) -> None:
        """Commit, in offset order, the appends durable here and on every follower."""
        advanced = False
        # Outcome callbacks of the appends committed here, called once the pass is done.
        committed: list[tuple[OnDone[int], asyncio.Future[int]]] = []
        inflight = self._inflight
        replicated = self.replicator.acked_end() if self.replicator is not None else None
        while inflight and inflight[0].outcome is not None:
            head = inflight[0]
            if head.outcome is True and self._broken is None:
                end = head.base_offset + head.count
                if replicated is not None and (replicated < end or self.fenced is not None):
                    break  # the followers have not all made it durable yet (or a fence decides)
                inflight.popleft()
                assert head.base_offset == self.committed, "commits out of offset order"
                self.committed = end
                advanced = True
                if not head.future.done():
                    head.future.set_result(head.base_offset)
                    if head.on_done is not None:
                        committed.append((head.on_done, head.future))
            else:
                inflight.popleft()
                if self._broken is None:
                    assert isinstance(head.outcome, BaseException)
                    self._broken = head.outcome
                    _limited.warning(
                        self._runtime.monotonic_s(),
                        "append",
                        "range %s: append failed: %s",
                        self.meta.range_id,
                        head.outcome,
                    )
                if not head.future.done():
                    head.future.set_exception(_as_error(self._broken))
                    call_done_later(head.on_done, head.future)
        if advanced:
            if self.replicator is not None:
                self.replicator.send_committed(self.committed)
            for listener in list(self._listeners):
                listener()
        for on_done, future in committed:
            call_done(on_done, future)

    def replica_failed(self, broker_id: str, error: XinfraError) -> None:
        """A follower of the active segment failed: fence the range and seal on the survivors."""
        if self.replicator is None:
            return  # a replicator not installed yet: the roller that opens it decides
        if self.fenced is None:
            self.fenced = error
        if self.replicator is not None:
            self.replicator.close()
        if not self._storing:
            self._start_roll(open_new=bool(self._inflight or self._waiting))

    # -- segment rolls ---------------------------------------------------------------------------

    def _start_roll(self, *, open_new: bool) -> None:
        if self._roll_task is None:
            self._roll_task = self._loop.create_task(self._roll(open_new))

    async def _roll(self, open_new: bool) -> None:
        try:
            await self._idle.wait()
            previous = self.active
            segment_id = await self._roller(self, open_new or bool(self._waiting))
            self._broken = None
            if self.needs_fence:  # a restart's replicated segment is sealed: its batches are final
                self.needs_fence = False
                if previous is not None and not self.producers_loaded.done():
                    self._load_task = self._loop.create_task(self._load_producers(previous))
            self._start_segment(segment_id)
        except XinfraError as error:
            _limited.warning(
                self._runtime.monotonic_s(),
                "roll",
                "range %s: segment roll failed: %s",
                self.meta.range_id,
                error,
            )
            self._fail_waiting(error)
            return
        except asyncio.CancelledError:
            self._fail_waiting(BackendUnavailable("the broker is stopping; retry"))
            raise
        finally:
            self._roll_task = None
        self._issue_waiting()

    @property
    def roll_running(self) -> bool:
        return self._roll_task is not None

    def _start_segment(self, segment_id: str | None) -> None:
        self.active = segment_id
        self._next_offset = self.committed
        self._active_bytes = 0
        self.active_created_ms = self._runtime.wall_ms()

    def lead(self, segment_id: str) -> None:
        """Lead ``segment_id`` (placed on this broker by the coordinator, its replicator set)
        and issue the appends waiting for it; a roll in progress picks it up itself."""
        self.led_by = None
        if self._roll_task is None:
            self._start_segment(segment_id)
            self._issue_waiting()

    def lead_elsewhere(self, address: str) -> None:
        """Another broker (``address``) leads the range's new segment: appends are refused
        and readers at the committed end are woken to hear it (``read``)."""
        self.led_by = address
        for listener in list(self._listeners):
            listener()

    def not_leader(self) -> NotLeader:
        return NotLeader(
            f"range {self.meta.range_id} is led by broker {self.led_by or '(unknown)'}; "
            "refresh the topic metadata"
        )

    def _issue_waiting(self) -> None:
        if self.led_by is not None:
            self._fail_waiting(self.not_leader())
            return
        waiting, self._waiting = self._waiting, deque()
        for batch, count, future, on_done in waiting:
            if not future.done():
                if self.active is None or self._needs_roll(len(batch)):
                    self._waiting.append((batch, count, future, on_done))
                else:
                    self._issue(batch, count, future, on_done)
        if self._waiting:
            if self.meta.state is State.SEALED:
                self._fail_waiting(Sealed(f"range {self.meta.range_id} is sealed"))
            else:
                self._start_roll(open_new=True)

    def _fail_waiting(self, error: XinfraError) -> None:
        waiting, self._waiting = self._waiting, deque()
        for _, _, future, on_done in waiting:
            if not future.done():
                future.set_exception(error)
                call_done_later(on_done, future)

    def durable_end(self) -> int:
        """Where the active segment ends in the store (committed, plus durable but unacknowledged)."""
        if self.active is None:
            return self.committed
        try:
            return self._store.segment(self.active).end_offset
        except NotFound:
            return self.committed

    def sync_committed(self, end: int) -> None:
        """After a seal at ``end`` (>= committed): records up to there are durable on every
        surviving replica, so committed and visible; in-flight appends past it are cut from the
        replicas and go back, first and in order, to the appends waiting for the next segment."""
        assert end >= self.committed
        inflight, self._inflight = self._inflight, deque()
        cut: list[tuple[bytes, int, asyncio.Future[int], OnDone[int] | None]] = []
        for item in inflight:
            item_end = item.base_offset + item.count
            if item_end <= end and item.outcome is True and self._broken is None:
                assert item.base_offset >= self.committed
                if not item.future.done():
                    item.future.set_result(item.base_offset)
                    call_done_later(item.on_done, item.future)
            elif item.base_offset >= end:
                if not item.future.done():
                    cut.append((item.batch, item.count, item.future, item.on_done))
            else:
                assert item.outcome is not True, f"seal at {end} inside an entry"
                if not item.future.done():
                    item.future.set_exception(_as_error(item.outcome or Sealed("cut")))
                    call_done_later(item.on_done, item.future)
        self._waiting.extendleft(reversed(cut))
        if end > self.committed:
            self.committed = end
            for listener in list(self._listeners):
                listener()

    async def seal_active(self) -> None:
        """Seal the active segment (on demand or by age) without opening a new one."""
        while self._roll_task is not None:
            await asyncio.shield(self._roll_task)
        if self.active is not None or self._broken is not None:
            self._start_roll(open_new=False)
            task = self._roll_task
            if task is not None:
                await asyncio.shield(task)

    async def roll_segment(self, segment_id: str | None, open_new: bool) -> None:
        """Seal ``segment_id`` if it is still the active segment (None: the range has none) and
        open a new one when asked; a segment another roll already sealed is left alone."""
        while self._roll_task is not None:
            await asyncio.shield(self._roll_task)
        if self.active == segment_id and (segment_id is not None or open_new):
            self._start_roll(open_new=open_new)
            task = self._roll_task
            if task is not None:
                await asyncio.shield(task)

    async def fence(self) -> tuple[int, int]:
        """The coordinator fences the segment this broker leads (to seal it): nothing more is
        issued or committed; answers its durable end and committed offset once the store
        appends in flight have ended."""
        if self.fenced is None:
            self.fenced = Sealed(f"segment {self.active} is fenced by the coordinator")
        if self.replicator is not None:
            self.replicator.close()
        await self._idle.wait()
        return self.durable_end(), self.committed

    def sealed_at(self, end: int) -> None:
        """The coordinator sealed the led segment at ``end`` (see ``sync_committed``); appends
        past it wait for the next segment, which a roll asks for."""
        self.sync_committed(end)
        self.closed_segment()
        if self._waiting:
            self._start_roll(open_new=True)

    def closed_segment(self) -> None:
        """The roller sealed the active segment: appends need a new one."""
        self.active = None
        self.fenced = None
        if self.replicator is not None:
            self.replicator.close_streams()
            self.replicator = None

    async def stop(self) -> None:
        if self._load_task is not None and not self._load_task.done():
            self._load_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._load_task
        if not self.producers_loaded.done():
            self.producers_loaded.set_result(None)
        if self._roll_task is not None:
            self._roll_task.cancel()
        if self._storing:
            await self._idle.wait()
        if self.replicator is not None:
            self.replicator.close_streams()

    # -- duplicates ------------------------------------------------------------------------------

    def producer(self, producer_id: int, first_seq: int, epoch: int = 0) -> ProducerState:
        """The state of ``producer_id`` (new, starting at ``first_seq``, when unknown or when
        ``epoch`` is newer); ``ProducerFenced`` when ``epoch`` is older than the one seen."""
        state = self.producers.get(producer_id)
        if state is not None and epoch < state.epoch:
            raise ProducerFenced(
                f"producer {producer_id} epoch {epoch} is fenced by epoch {state.epoch} on range "
                f"{self.meta.range_id}: a newer incarnation took over; stop this producer"
            )
        if state is None or epoch > state.epoch:
            state = ProducerState(first_seq, epoch)
            self.producers[producer_id] = state
            if len(self.producers) > PRODUCERS_MAX:
                self.producers.popitem(last=False)
        self.producers.move_to_end(producer_id)
        return state

    def _store_has(self, segment_id: str) -> bool:
        try:
            self._store.segment(segment_id)
        except NotFound:
            return False
        return True

    async def _load_producers(self, segment_id: str) -> None:
        """Rebuild the producer table from the batch headers of the last segment (see the module
        docstring); resolves ``producers_loaded`` whatever happens, so appends never hang on it."""
        try:
            info = self._store.segment(segment_id)
            offset, end = info.start_offset, info.end_offset
            while offset < end:
                entries = await self._store.read(segment_id, offset, PRODUCER_SCAN_CHUNK_BYTES)
                if not entries:
                    break
                for entry in entries:
                    if entry.base_offset >= end:
                        break
                    producer_id, epoch, seq = batch_producer(entry.batch)
                    if producer_id != NO_PRODUCER:
                        self._remember_stored(producer_id, epoch, seq, entry.base_offset)
                offset = entries[-1].end_offset
        except (CorruptData, NotFound, OffsetOutOfRange) as error:
            log.error(
                "range %s: the producer table could not be rebuilt from segment %s (%s); "
                "a batch resent from before the restart may be stored twice",
                self.meta.range_id, segment_id, error,
            )  # fmt: skip
        finally:
            if not self.producers_loaded.done():
                self.producers_loaded.set_result(None)

    def _remember_stored(self, producer_id: int, epoch: int, seq: int, base_offset: int) -> None:
        state = self.producers.get(producer_id)
        if state is not None and epoch < state.epoch:
            return  # a fenced incarnation's batch: never resent by the producer that fenced it
        if state is None or epoch > state.epoch:
            state = ProducerState(seq, epoch)
            self.producers[producer_id] = state
            if len(self.producers) > PRODUCERS_MAX:
                self.producers.popitem(last=False)
        self.producers.move_to_end(producer_id)
        future: asyncio.Future[int] = self._loop.create_future()
        future.set_result(base_offset)
        state.remember(seq, future)

    # -- reads -----------------------------------------------------------------------------------

    def add_listener(self, listener: Callable[[], None]) -> None:
        self._listeners.add(listener)

    def remove_listener(self, listener: Callable[[], None]) -> None:
        self._listeners.discard(listener)

    async def read(self, offset: int, bytes_max: int) -> list[Entry]:
        """Committed entries from the one holding ``offset``; empty at the committed end."""
        meta = self.meta
        if offset < meta.start_offset:
            raise OffsetOutOfRange(
                f"offset {offset} of range {meta.range_id} was deleted by retention; "
                f"the first retained offset is {meta.start_offset}"
            )
        committed = self.committed
        if offset >= committed:
            if self.led_by is not None:  # what follows is appended on another broker
                raise self.not_leader()
            if offset > committed:
                raise OffsetOutOfRange(
                    f"offset {offset} is past the end {committed} of range {meta.range_id}"
                )
            return []
        segment_id = self._segment_of(offset)
        try:
            entries = await self._store.read(segment_id, offset, bytes_max)
        except NotFound as error:
            segment = self._segments.get(segment_id)
            if (
                self.remote_read is not None
                and segment is not None
                and segment.state is State.SEALED
                and self.meta.start_offset <= offset
            ):
                entries = await self.remote_read(segment, offset, bytes_max)
                return [entry for entry in entries if entry.base_offset < committed]
            raise OffsetOutOfRange(
                f"offset {offset} of range {meta.range_id} is no longer stored ({error.message})"
            ) from error
        return [entry for entry in entries if entry.base_offset < committed]

    def _segment_of(self, offset: int) -> str:
        for segment_id in reversed(self.meta.segments):
            segment = self._segments.get(segment_id)
            if segment is None:  # its topic was deleted under a reader
                raise TopicNotFound(
                    f"topic {self.meta.topic!r} was deleted (range {self.meta.range_id})"
                )
            if segment.start_offset <= offset:
                return segment_id
        raise InvalidRequest(f"no segment of range {self.meta.range_id} holds offset {offset}")


def _as_error(error: BaseException) -> XinfraError:
    if isinstance(error, XinfraError):
        return error
    return XinfraError(f"append failed: {error!r}")
