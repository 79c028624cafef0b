"""The Northguard shard producer: accumulate records per shard, encode each batch once, stream it.

Per shard, records accumulate into a batch, which is then encoded once
(``encode_batch``) and given the shard's next sequence number.  Batches go
out on the shard's produce stream while its window has room; Acks resolve
each ``send`` future with its offsets.

**The linger waits only behind a batch in flight.**  A shard with nothing
sent and unacknowledged seals what it was given when its connection next
writes: at the end of the turn, or when the write gap after a recent write
ends (``connection``), since its batch could not leave sooner; waiting longer
would batch nothing more at a low rate and only add ``linger_ms`` to every
record.  While a batch is in flight, records
accumulate until ``batch_bytes_max``, ``linger_ms`` or the Ack that leaves
the shard with nothing in flight, whichever comes first, so under load
batches grow with the round trip (as Nagle's algorithm does) and the linger
still bounds how long a record waits to be pipelined.

**Retries keep order.**  When a stream fails with a retriable error (the
connection dropped, the broker restarted, the range rolled its segment, its
leader changed: ``not_leader``), its unacknowledged batches go back to the
head of the shard's queue, in order, and are resent with the same sequence
numbers on a new stream, to the leader the refreshed topic metadata names
(each range's stream goes to its leader; one connection per broker): the
broker drops those it already has, so order holds and a resend is stored once.
Each batch carries the producer id, epoch and its per-range sequence number
in its header (the broker rebuilds its duplicate table from the stored
batches), so this holds across a broker restart too, within the broker's
duplicate window.  Reopens back
off exponentially with jitter (``xinfra.backoff``, reset by
the next Ack), so a broker that refuses every stream (a failed disk) is never
hammered.

**Every send has a deadline.**  A batch not acknowledged within
``request_timeout_s`` of being sealed fails, with every later batch of its
shard, even while its stream and connection look healthy (a hung broker
keeps its socket open): with ``Timeout``, or with the class and text of the
last retriable error seen (e.g. the broker's ``StorageError`` "No space left
on device").  The stream is closed but the connection is kept, so sends
succeed again once the broker answers.  A non-retriable error
(``TopicNotFound``, ``Sealed``, ``CorruptData``...) fails the shard's queued
batches at once.  After any failure the producer takes a fresh producer id,
so the broker never sees a gap in a producer's sequence numbers.  ``close``
therefore returns within ``request_timeout_s`` (plus one reconnect).

Bounds: ``buffer_bytes_max`` payload bytes unacknowledged (``send`` raises
``Backpressure`` past it), ``record_bytes_max`` per record, the broker's
window per stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import ssl
from collections import deque
from collections.abc import Awaitable, Callable, Sequence

from backends.northguard.batch import encode_batch, restamp_batch
from backends.northguard.client.admin import TopicView
from backends.northguard.client.connection import ClientConnection, CredentialSource
from backends.northguard.client.produce_stream import ProduceStream
from backends.northguard.runtime import Runtime
from xinfra.backend import ProducerOptions, ShardProducer
from xinfra.backoff import backoff_s
from xinfra.errors import (
    BackendTimeout,
    Backpressure,
    NotLeader,
    RecordTooLarge,
    Timeout,
    XinfraError,
)
from xinfra.model import Record

log = logging.getLogger(__name__)

PRODUCER_EPOCH = 0
"""Every producer id is fresh (random, 63 bits), so its first epoch is its only one; the field
is for ids that outlive a process (a transactional id), whose new incarnation fences the old."""

ACK_STALL_S_MIN = 1.0
"""A stream with batches in flight and no Ack for ``max(this, request_timeout_s / 4)`` is
reopened on the leader the refreshed metadata names (a stopped leader keeps its socket open
and answers nothing while the coordinator moves its range on); the batches keep their
deadlines and sequence numbers, so a resend is stored once."""
BATCH_RECORDS_MAX = 20_000
LINGER_EARLY_S = 0.001
"""How early a linger may end (see ``_on_linger``)."""


class _Call:
    """One ``send``: its future resolves when every batch holding its records is acknowledged.

    Its offsets list is made when the last of those batches is acknowledged, not held while
    they are in flight: a list of every record's slot per send in flight was most of what the
    garbage collector traversed in a producer writing to many ranges at once."""

    __slots__ = ("acked", "batches_left", "count", "future", "size_bytes")

    def __init__(self, future: asyncio.Future[list[int]], count: int, size_bytes: int) -> None:
        self.future = future
        self.count = count
        self.acked: list[tuple[int, int, int]] | None = None  # (start, base offset, count)
        self.batches_left = 0
        self.size_bytes = size_bytes

    def part_acknowledged(self, start: int, base_offset: int, count: int) -> list[int] | None:
        """Record one acknowledged part; the call's offsets once it was the last part."""
        self.batches_left -= 1
        if count == self.count:  # the whole call in one batch: nothing to assemble
            return list(range(base_offset, base_offset + count))
        acked = self.acked = self.acked or []
        acked.append((start, base_offset, count))
        if self.batches_left:
            return None
        offsets: list[int] = []
        for _, base, part in sorted(acked):
            offsets += range(base, base + part)
        return offsets


class _Batch:
    __slots__ = ("count", "data", "deadline", "parts", "seq")

    def __init__(
        self, data: bytes, count: int, parts: list[tuple[_Call, int, int]], deadline: float
    ):
        self.data = data
        self.count = count
        self.parts = parts  # (call, index of its first record in the call, records)
        self.deadline = deadline
        self.seq = -1


class _Shard:
    __slots__ = (
        "deadline_timer",
        "deadline_wake_s",
        "failures",
        "index",
        "last_error",
        "leader",
        "linger_at",
        "parts",
        "pending_bytes",
        "progress_s",
        "queue",
        "range_id",
        "records",
        "reopening",
        "sealing",
        "stale",
        "stream",
        "timer",
        "unacked",
    )

    def __init__(self, index: int, range_id: int, leader: str | None) -> None:
        self.index = index
        self.range_id = range_id
        self.leader = leader  # host:port of the broker leading the range (None: the bootstrap)
        self.stale = False  # a stream failed: ask the metadata for the leader before reopening
        self.progress_s = 0.0  # monotonic time of the last Ack, or of a send into an idle stream
        self.records: list[Record] = []
        self.parts: list[tuple[_Call, int, int]] = []
        self.pending_bytes = 0
        self.timer: asyncio.Handle | None = None  # seals the records at the end of the turn
        self.sealing = False  # its records are sealed at its connection's next write
        self.linger_at = 0.0  # loop time its linger seals the records (0: not lingering)
        self.queue: deque[_Batch] = deque()  # encoded, not sent on the current stream
        self.unacked: deque[_Batch] = deque()  # sent on the current stream
        self.stream: ProduceStream | None = None
        self.reopening: asyncio.Task[None] | None = None
        self.deadline_timer: asyncio.TimerHandle | None = None
        self.deadline_wake_s = 0.0  # when it fires (monotonic)
        self.failures = 0  # stream failures since the last Ack: the backoff's exponent
        self.last_error: XinfraError | None = None  # what a deadline reports, if not a Timeout


class NorthguardProducer(ShardProducer):
    def __init__(
        self,
        runtime: Runtime,
        address: str,
        topic: TopicView,
        options: ProducerOptions,
        credential_source: CredentialSource | None = None,
        tls_context: ssl.SSLContext | None = None,
        metadata: Callable[[], Awaitable[TopicView]] | None = None,
    ) -> None:
        self._runtime = runtime
        self._metadata = metadata
        self._credential_source = credential_source
        self._tls_context = tls_context
        self._address = address
        self._topic = topic
        self._options = options
        self._linger_s = options.linger_ms / 1000
        self._stall_s = max(ACK_STALL_S_MIN, options.request_timeout_s / 4)
        self._loop = asyncio.get_running_loop()
        self._shards = [_Shard(i, r.range_id, r.leader) for i, r in enumerate(topic.ranges)]
        self._connections: dict[str, ClientConnection] = {}  # by address: one per leader
        self._connecting: dict[str, asyncio.Future[ClientConnection]] = {}
        self._producer_id = runtime.random.getrandbits(63)
        self._next_seq = 0  # per producer id, shared by shards (each range sees an increasing run)
        self._seqs: dict[int, int] = {}
        self._buffered_bytes = 0
        self._outstanding: set[asyncio.Future[list[int]]] = set()
        self._closed = False
        self._tasks: set[asyncio.Task[None]] = set()
        # By address: the task that opens, once connected, the streams of the shards listed.
        self._first_opens: dict[str, tuple[asyncio.Task[None], list[_Shard]]] = {}
        self._lingering: deque[tuple[float, _Shard]] = deque()  # see ``_linger``
        self._linger_timer: asyncio.TimerHandle | None = None
        self._at_write: dict[ClientConnection, list[_Shard]] = {}  # see ``_seal_at_write``

    # -- send ------------------------------------------------------------------------------------

    def send(self, shard: int, records: Sequence[Record]) -> asyncio.Future[list[int]]:
        if self._closed:
            raise XinfraError(f"producer to {self._topic.name!r} is closed")
        self._topic.range_of_shard(shard)
        limit = self._options.record_bytes_max
        size = 0
        for record in records:
            record_size = record.size_bytes()
            if record_size > limit:
                raise RecordTooLarge(
                    f"a record of {record_size} bytes exceeds record_bytes_max={limit}; it was not sent"
                )
            size += record_size
        if self._buffered_bytes and self._buffered_bytes + size > self._options.buffer_bytes_max:
            raise Backpressure(
                f"{self._buffered_bytes} bytes await acknowledgement (buffer_bytes_max="
                f"{self._options.buffer_bytes_max}); wait for earlier sends"
            )
        future: asyncio.Future[list[int]] = self._loop.create_future()
        if not records:
            future.set_result([])
            return future
        call = _Call(future, len(records), size)
        self._buffered_bytes += size
        self._outstanding.add(future)
        future.add_done_callback(self._outstanding.discard)
        state = self._shards[shard]
        batch_bytes_max = self._options.batch_bytes_max
        start = 0
        count = len(records)
        while start < count:
            room = batch_bytes_max - state.pending_bytes
            end = count
            if size > room or len(state.records) + count - start > BATCH_RECORDS_MAX:
                # Split the call where the batch fills (rare: a call larger than a batch).
                taken = 0
                end = start
                while end < count and (end == start or taken + records[end].size_bytes() <= room):
                    taken += records[end].size_bytes()
                    end += 1
                    if len(state.records) + end - start >= BATCH_RECORDS_MAX:
                        break
                part_bytes = taken
            else:
                part_bytes = size
            state.records.extend(records[start:end])
            state.parts.append((call, start, end - start))
            call.batches_left += 1
            state.pending_bytes += part_bytes
            size -= part_bytes
            start = end
            if state.pending_bytes >= batch_bytes_max or len(state.records) >= BATCH_RECORDS_MAX:
                self._seal(state)
        if state.records and not state.sealing and state.timer is None and not state.linger_at:
            if self._linger_s <= 0:
                self._seal(state)
            elif not state.unacked and not state.queue:  # the pipe is idle: go with the write
                self._seal_at_write(state)
            else:
                self._linger(state)
        return future

    def _seal_at_write(self, state: _Shard) -> None:
        """Seal an idle shard's records when its connection next writes (at the end of this turn,
        or when the write gap ends: they could not leave sooner), with whatever else that time
        sent to the shard; without an open stream, at the end of the turn."""
        stream = state.stream
        connection = stream.connection if stream is not None and stream.failure is None else None
        if connection is None or connection.closed:
            state.timer = self._loop.call_soon(self._seal_due, state)
            return
        waiting = self._at_write.get(connection)
        if waiting is None:
            waiting = self._at_write[connection] = []
            connection.before_write(functools.partial(self._on_write, connection))
        waiting.append(state)
        state.sealing = True

    def _on_write(self, connection: ClientConnection) -> None:
        for state in self._at_write.pop(connection, ()):
            if state.sealing:
                self._seal(state)

    def _seal_due(self, state: _Shard) -> None:
        """The shard's end-of-turn timer fired: nothing left to cancel."""
        state.timer = None
        self._seal(state)

    def _linger(self, state: _Shard) -> None:
        """Seal the shard's records ``linger_ms`` from now, unless something seals them sooner.

        One timer for the producer, not one per shard: every shard lingers as
        long, so they come due in the order they were armed, and a queue of
        (time, shard) replaces a timer each.  With hundreds of ranges written
        at once, a timer per shard kept that many handles in the event loop's
        heap, each arm and cancel paying for its depth (in Python comparisons,
        on asyncio's own loop).  A shard sealed sooner is skipped when its
        entry comes up (``linger_at`` no longer matches).
        """
        state.linger_at = when = self._loop.time() + self._linger_s
        self._lingering.append((when, state))
        if self._linger_timer is None:
            self._linger_timer = self._loop.call_at(when, self._on_linger)

    def _on_linger(self) -> None:
        self._linger_timer = None
        lingering = self._lingering
        # Up to a millisecond early: uvloop runs a timer from the time cached at its
        # iteration's start, in whole ms, so a timer may fire a hair before its time.
        now = self._loop.time() + LINGER_EARLY_S
        while lingering:
            when, state = lingering[0]
            if when > now:
                self._linger_timer = self._loop.call_at(when, self._on_linger)
                return
            lingering.popleft()
            if state.linger_at == when:  # not sealed since it was armed
                self._seal(state)

    def _seal(self, state: _Shard) -> None:
        """Encode the shard's accumulated records as one batch and queue it."""
        if state.timer is not None:
            state.timer.cancel()
            state.timer = None
        state.sealing = False  # its entry waiting for the write is skipped
        state.linger_at = 0.0  # its entry in the linger queue is skipped when it comes up
        if not state.records:
            return
        seq = self._take_seq(state.range_id)
        data = encode_batch(
            state.records,
            self._runtime.wall_ms(),
            producer_id=self._producer_id,
            producer_epoch=PRODUCER_EPOCH,
            sequence=seq,
        )
        batch = _Batch(
            data,
            len(state.records),
            state.parts,
            self._runtime.monotonic_s() + self._options.request_timeout_s,
        )
        state.records = []
        state.parts = []
        state.pending_bytes = 0
        batch.seq = seq
        state.queue.append(batch)
        self._pump(state)
        if state.deadline_timer is None:  # after the pump: armed once, for its stall if sent
            self._arm_deadline(state)

    def _take_seq(self, range_id: int) -> int:
        seq = self._seqs.get(range_id, 0)
        self._seqs[range_id] = seq + 1
        return seq

    # -- streaming -------------------------------------------------------------------------------

    def _pump(self, state: _Shard) -> None:
        stream = state.stream
        if stream is None or stream.failure is not None:
            self._reopen(state)
            return
        queue = state.queue
        try:
            idle = bool(queue) and not state.unacked
            if idle:
                state.progress_s = self._runtime.monotonic_s()
            while queue and stream.has_room(len(queue[0].data)):
                batch = queue.popleft()
                state.unacked.append(batch)
                stream.append(batch.seq, batch.data)
            if (
                idle
                and state.deadline_timer is not None
                and state.deadline_wake_s > state.progress_s + self._stall_s
            ):  # armed for the deadline: wake for a stall (an earlier wake just re-arms)
                state.deadline_timer.cancel()
                state.deadline_timer = None
                self._arm_deadline(state)
        except XinfraError as error:
            self._on_stream_failure(state, stream, error)

    def _reopen(self, state: _Shard) -> None:
        if state.reopening is None and not self._closed_for_good(state):
            if not state.failures and not state.stale:  # a first open: no backoff, no refresh
                address = state.leader or self._address
                connection = self._connections.get(address)
                if connection is not None and not connection.closed:
                    # At once on the open connection: 4,096 new ranges made a task each.
                    with contextlib.suppress(XinfraError):  # else the task below tries again
                        self._start_stream(state, connection)
                        return
                else:  # behind the connection's open, with every other shard's first stream
                    self._open_when_connected(address, state)
                    return
            task = self._loop.create_task(self._open_stream(state))
            state.reopening = task
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _open_when_connected(self, address: str, state: _Shard) -> None:
        """One task per address opens the first streams of every shard that waits for its
        connection (a task per shard, each waking on the connect, cost 4,096 of each)."""
        first = self._first_opens.get(address)
        if first is None:
            task = self._loop.create_task(self._first_streams(address))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            first = self._first_opens[address] = (task, [])
        first[1].append(state)
        state.reopening = first[0]

    async def _first_streams(self, address: str) -> None:
        error: XinfraError | None = None
        try:
            connection = await self._connect(address)
        except XinfraError as failure:
            error = failure
        finally:
            _, waiting = self._first_opens.pop(address)
            for state in waiting:
                state.reopening = None
        for state in waiting:
            if self._closed_for_good(state) or state.stream is not None:
                continue
            if error is None:
                try:
                    self._start_stream(state, connection)
                    continue
                except XinfraError as failure:
                    error = failure
            if self._open_failed(state, error):
                self._reopen(state)  # its own task now, with backoff and a metadata refresh

    def _open_failed(self, state: _Shard, error: XinfraError) -> bool:
        """A stream could not be opened: whether to try again (after a backoff, on the leader
        the refreshed metadata names), or the shard failed for good (non-retriable)."""
        if not error.retriable:
            self._fail_shard(state, error)
            return False
        state.last_error = error
        state.stale = True
        state.failures += 1
        return True

    def _closed_for_good(self, state: _Shard) -> bool:
        return not state.queue and not state.unacked

    async def _open_stream(self, state: _Shard) -> None:
        try:
            while state.queue:
                moved = state.failures == 1 and isinstance(state.last_error, NotLeader)
                if state.failures and not moved:  # a first not_leader: straight to the leader
                    await self._runtime.sleep(backoff_s(state.failures, self._runtime.random))
                    if not state.queue:  # failed by its deadline meanwhile
                        return
                try:
                    if state.stale:
                        await self._refresh_leaders(state)
                    connection = await self._connect(state.leader or self._address)
                    state.reopening = None
                    self._start_stream(state, connection)
                    return
                except XinfraError as error:
                    if not self._open_failed(state, error):
                        return
        finally:
            if state.reopening is asyncio.current_task():
                state.reopening = None

    def _start_stream(self, state: _Shard, connection: ClientConnection) -> None:
        """Open the shard's stream on ``connection`` and send what its window allows: the first
        batch goes behind the open, not after its answer."""
        stream = ProduceStream(
            connection,
            self._topic.name,
            state.range_id,
            self._producer_id,
            functools.partial(self._on_acks, state),
            functools.partial(self._on_failure_cb, state),
        )
        state.stream = stream
        stream.opened.add_done_callback(functools.partial(self._on_opened, state, stream))
        self._pump(state)

    def _on_opened(self, state: _Shard, stream: ProduceStream, _: asyncio.Future[None]) -> None:
        """The broker granted the window: what waited for it goes (a failed open is reported
        through ``on_failure`` instead)."""
        if state.stream is stream and stream.failure is None and state.queue:
            self._pump(state)

    def _arm_deadline(self, state: _Shard) -> None:
        """Wake up at the oldest unacknowledged batch's deadline, or sooner to look for a stalled
        stream (one timer per shard).  With nothing sent yet (its stream still opening), the
        stall wake counts from now: the send that follows then finds its stall covered and
        makes no second timer (a wake with nothing due re-arms)."""
        if state.deadline_timer is not None or self._closed_for_good(state):
            return
        now_s = self._runtime.monotonic_s()
        oldest = state.unacked[0] if state.unacked else state.queue[0]
        since_s = state.progress_s if state.unacked else now_s
        wake_s = min(oldest.deadline, since_s + self._stall_s)
        delay_s = max(0.0, wake_s - now_s)
        state.deadline_wake_s = wake_s
        state.deadline_timer = self._runtime.call_later(
            delay_s, functools.partial(self._on_deadline, state)
        )

    def _on_deadline(self, state: _Shard) -> None:
        state.deadline_timer = None
        if self._closed_for_good(state):
            return
        oldest = state.unacked[0] if state.unacked else state.queue[0]
        now_s = self._runtime.monotonic_s()
        if oldest.deadline > now_s:
            stream = state.stream
            if stream is not None and state.unacked and now_s - state.progress_s >= self._stall_s:
                state.progress_s = now_s  # one reopen per stall period
                self._on_stream_failure(
                    state,
                    stream,
                    BackendTimeout(
                        f"no acknowledgement in {self._stall_s:g} s from Northguard broker "
                        f"{state.leader or self._address}; reopening on the current leader"
                    ),
                )
            self._arm_deadline(state)
            return
        waited = f"not acknowledged in {self._options.request_timeout_s:g} s by Northguard broker {state.leader or self._address}"
        last = state.last_error
        if last is None or isinstance(last, Timeout):
            self._fail_shard(state, BackendTimeout(waited))
        else:
            self._fail_shard(state, type(last)(f"{waited}: {last.message}"))

    async def _refresh_leaders(self, state: _Shard) -> None:
        """After a stream failure: the leaders the metadata names now (a leader died or its
        range moved on to a segment led elsewhere); kept as they were if it does not answer."""
        state.stale = False
        if self._metadata is None:
            return
        view = await self._metadata()
        leaders = {r.range_id: r.leader for r in view.ranges}
        for shard in self._shards:
            if shard.range_id in leaders:
                shard.leader = leaders[shard.range_id]

    async def _connect(self, address: str) -> ClientConnection:
        connection = self._connections.get(address)
        if connection is not None and not connection.closed:
            return connection
        connecting = self._connecting.get(address)
        if connecting is None:
            connecting = self._connecting[address] = asyncio.ensure_future(
                ClientConnection.open(
                    self._runtime,
                    address,
                    self._options.request_timeout_s,
                    credential_source=self._credential_source,
                    tls_context=self._tls_context,
                )
            )
        try:
            connection = self._connections[address] = await asyncio.shield(connecting)
        finally:
            if connecting.done() and self._connecting.get(address) is connecting:
                del self._connecting[address]
        return connection

    def _on_acks(self, state: _Shard, first_seq: int, offsets: tuple[int, ...]) -> None:
        unacked = state.unacked
        state.progress_s = self._runtime.monotonic_s()
        state.failures = 0
        state.last_error = None
        for position, base_offset in enumerate(offsets):
            seq = first_seq + position
            if not unacked or unacked[0].seq != seq:
                log.warning(
                    "shard %d: ack for sequence %d does not match the oldest send", state.index, seq
                )
                continue
            batch = unacked.popleft()
            index = base_offset
            for call, start, count in batch.parts:
                offsets_of_call = call.part_acknowledged(start, index, count)
                index += count
                if offsets_of_call is not None:
                    self._buffered_bytes -= call.size_bytes
                    if not call.future.done():
                        call.future.set_result(offsets_of_call)
        if state.records and not unacked and not state.queue:
            self._seal(state)  # the pipe went idle: what lingered behind it goes now
        elif state.queue:
            self._pump(state)

    def _on_failure_cb(self, state: _Shard, error: XinfraError) -> None:
        stream = state.stream
        if stream is not None:
            self._on_stream_failure(state, stream, error)

    def _on_stream_failure(self, state: _Shard, stream: ProduceStream, error: XinfraError) -> None:
        if state.stream is not stream:
            return
        state.stream = None
        stream.close()
        if error.retriable:
            state.stale = True
            state.queue.extendleft(reversed(state.unacked))
            state.unacked.clear()
            state.failures += 1
            state.last_error = error
            if state.queue:
                log.info(
                    "shard %d: stream failed (%s); resending on a new stream", state.index, error
                )
                self._reopen(state)
        else:
            self._fail_shard(state, error)

    def _fail_shard(self, state: _Shard, error: XinfraError) -> None:
        batches = [*state.unacked, *state.queue]
        state.unacked.clear()
        state.queue.clear()
        if state.stream is not None:
            state.stream.close()
            state.stream = None
        for batch in batches:
            for call, _, _ in batch.parts:
                if not call.future.done():
                    self._buffered_bytes -= call.size_bytes
                    call.future.set_exception(error)
        # A fresh identity: the broker must never see a gap in a producer's sequence numbers.
        self._producer_id = self._runtime.random.getrandbits(63)
        self._seqs.clear()
        for other in self._shards:
            for batch in (*other.unacked, *other.queue):
                batch.seq = self._take_seq(other.range_id)
                batch.data = restamp_batch(batch.data, self._producer_id, PRODUCER_EPOCH, batch.seq)
            if other.stream is not None and other is not state:
                other.stream.close()
                other.stream = None
                other.queue.extendleft(reversed(other.unacked))
                other.unacked.clear()
                if other.queue:
                    self._reopen(other)

    # -- flush and close -------------------------------------------------------------------------

    async def flush(self) -> None:
        for state in self._shards:
            self._seal(state)
        pending = list(self._outstanding)
        if pending:
            await asyncio.wait(pending)

    async def close(self) -> None:
        if self._closed:
            return
        with contextlib.suppress(Exception):
            await self.flush()
        self._closed = True
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        self._lingering.clear()
        for state in self._shards:
            if state.stream is not None:
                with contextlib.suppress(Exception):
                    state.stream.close()
                state.stream = None
            if state.deadline_timer is not None:
                state.deadline_timer.cancel()
                state.deadline_timer = None
        for task in list(self._tasks):
            task.cancel()
        for connection in self._connections.values():
            await connection.close()
        self._connections.clear()
