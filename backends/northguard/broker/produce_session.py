"""A produce stream: Appends in, Acks out only for committed appends, M Acks for N Appends.

The stream's window bounds the bytes of Appends received and not yet
acknowledged; a client that sends past it broke the protocol and the stream
fails with ``Backpressure``.  Acks are coalesced: every append that commits
in one event-loop turn (one group commit) is acknowledged by one Ack that
lists their base offsets and repeats the window.  A commit only marks the
session due (the range log calls ``_on_done`` itself, not as a
done-callback); the connection has every due session build its Ack when it
writes the turn's frames, and sends the Acks of all its streams in one
frame: a handle scheduled per append was ~1 us of the event loop's each,
and a commit is acknowledged in the turn it happened, as before.

Sequence numbers are per (producer id, range) and consecutive.  A batch
carries its producer id, epoch and sequence in its header (``batch``); the
Append's sequence number must equal the batch's, and a batch without an
identity (the old format) takes the stream's producer id and the Append's
number, deduplicated in memory only.  A sequence number already seen within
``DEDUP_APPENDS_MAX`` is a resend: it is answered with the original append's
offset, never appended again (unless the original failed, in which case it
is appended anew), also after a broker restart (the range log rebuilds the
table from the stored batches; Appends that arrive before it has are held,
inside the window, and admitted in order once it has).  A gap or a resend
older than the window is ``OutOfOrderSequence``; an older epoch,
``ProducerFenced``.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from backends.northguard import protocol
from backends.northguard.batch import NO_PRODUCER, batch_count, batch_producer, check_batch
from backends.northguard.broker.metrics import BrokerMetrics
from backends.northguard.broker.range_log import DEDUP_APPENDS_MAX, RangeLog
from xinfra.errors import Backpressure, InvalidRequest, OutOfOrderSequence, XinfraError

PRODUCE_WINDOW_BYTES_MAX = 32 << 20
"""The largest produce window a broker grants one stream (unacknowledged Append bytes)."""


class ProduceSession:
    def __init__(
        self,
        stream_id: int,
        range_log: RangeLog,
        producer_id: int,
        window_bytes: int,
        ack: Callable[[bytes], None],
        request_acks: Callable[[ProduceSession], None],
        on_error: Callable[[int, XinfraError], None],
        metrics: BrokerMetrics,
    ) -> None:
        self.stream_id = stream_id
        self.range_log = range_log
        self.producer_id = producer_id
        self.window_bytes = window_bytes
        self._ack = ack
        self._request_acks = request_acks
        self._acks_due = False
        self._on_error = on_error
        self._counts = metrics.counts
        self._pending: deque[tuple[int, asyncio.Future[int], int]] = deque()
        self._inflight_bytes = 0
        self._closed = False
        self._held: deque[tuple[int, bytes]] = deque()  # until the range's producer table loads
        self._held_bytes = 0

    def on_append(self, seq: int, batch: memoryview) -> None:
        """Handle one Append; raises an ``XinfraError`` that fails this stream only."""
        size = len(batch)
        unacked = self._inflight_bytes + self._held_bytes
        if unacked + size > self.window_bytes and (self._pending or self._held):
            raise Backpressure(
                f"append of {size} bytes exceeds the window of {self.window_bytes} bytes "
                f"({unacked} unacknowledged)"
            )
        count = check_batch(batch)[0]
        if self._held or not self.range_log.producers_loaded.done():
            if not self._held:
                self.range_log.producers_loaded.add_done_callback(self._admit_held)
            self._held.append((seq, bytes(batch)))
            self._held_bytes += size
            return
        self._admit(seq, batch, count)

    def _admit_held(self, _: asyncio.Future[None]) -> None:
        """The producer table is loaded: admit the held Appends in order (a refusal fails the stream)."""
        while self._held and not self._closed:
            seq, batch = self._held.popleft()
            self._held_bytes -= len(batch)
            try:
                self._admit(seq, memoryview(batch), batch_count(batch))
            except XinfraError as error:
                self.close()
                self._on_error(self.stream_id, error)
                return

    def _admit(self, seq: int, batch: memoryview, count: int) -> None:
        """Decide whether a checked batch of ``count`` records is new or a resend, and append or
        answer it."""
        size = len(batch)
        producer_id, epoch, batch_seq = batch_producer(batch)
        if producer_id == NO_PRODUCER:
            producer_id, epoch, batch_seq = self.producer_id, 0, seq
        elif batch_seq != seq:
            raise InvalidRequest(f"append sequence {seq} differs from its batch's {batch_seq}")
        state = self.range_log.producer(producer_id, seq, epoch)
        if seq > state.next_seq:
            raise OutOfOrderSequence(
                f"producer {producer_id} sequence {seq} skips {state.next_seq} on range "
                f"{self.range_log.meta.range_id} (batches lost in between); take a fresh producer id"
            )
        future = state.recent.get(seq) if seq < state.next_seq else None
        if seq < state.next_seq and future is None:
            raise OutOfOrderSequence(
                f"producer {producer_id} sequence {seq} is older than the duplicate window of "
                f"{DEDUP_APPENDS_MAX} appends (next is {state.next_seq})"
            )
        if future is None or (future.done() and future.exception() is not None):
            future = self.range_log.append(bytes(batch), count, self._on_done)
            state.remember(seq, future)
            counts = self._counts
            counts.appends += 1
            counts.append_bytes += size
            counts.append_records += count
        else:  # a resend of an append still remembered: answered with its outcome
            future.add_done_callback(self._on_done)
        self._inflight_bytes += size
        self._pending.append((seq, future, size))

    def _on_done(self, future: asyncio.Future[int]) -> None:
        if self._closed:  # nobody will ack it: its failure is known, not an unseen error
            _retrieve(future)
        elif not self._acks_due:
            self._acks_due = True
            self._request_acks(self)

    def acknowledge(self) -> None:
        """Ack what committed since the last Ack (``ack``), or fail the stream at the first append
        that failed; the connection calls it when it writes the turn's frames."""
        self._acks_due = False
        if self._closed:
            return
        pending = self._pending
        offsets: list[int] = []
        first_seq = pending[0][0] if pending else 0
        failure: BaseException | None = None
        while pending and pending[0][1].done():
            seq, future, size = pending[0]
            failure = future.exception()
            if failure is not None:
                break
            pending.popleft()
            offsets.append(future.result())
            self._inflight_bytes -= size
            if len(offsets) == 65535:
                self._ack(protocol.ack_entry(self.stream_id, first_seq, offsets, self.window_bytes))
                first_seq, offsets = seq + 1, []
        if offsets:
            self._ack(protocol.ack_entry(self.stream_id, first_seq, offsets, self.window_bytes))
            self._counts.acks += 1
        if failure is not None:
            error = failure if isinstance(failure, XinfraError) else XinfraError(repr(failure))
            self.close()
            self._on_error(self.stream_id, error)

    def close(self) -> None:
        self._closed = True
        self._held.clear()
        self._held_bytes = 0
        for _, future, _ in self._pending:
            if future.done():
                _retrieve(future)
        self._pending.clear()


def _retrieve(future: asyncio.Future[int]) -> None:
    if not future.cancelled():
        future.exception()
