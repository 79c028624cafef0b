"""A produce stream: Appends in, Acks out only for committed appends, M Acks for N Appends.

The stream's window bounds the bytes of Appends received and not yet
acknowledged; a client that sends past it broke the protocol and the stream
fails with ``Backpressure``.  Acks are coalesced: every append that commits
in one event-loop turn (one group commit) is acknowledged by one Ack frame
that lists their base offsets and repeats the window.

Sequence numbers are per (producer id, range) and consecutive.  A sequence
number already seen within ``DEDUP_APPENDS_MAX`` is a resend: it is answered
with the original append's offset, never appended again (unless the original
failed, in which case it is appended anew).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from backends.northguard import protocol
from backends.northguard.batch import check_batch
from backends.northguard.broker.metrics import BrokerMetrics
from backends.northguard.broker.range_log import DEDUP_APPENDS_MAX, RangeLog
from xinfra.errors import Backpressure, InvalidRequest, XinfraError

PRODUCE_WINDOW_BYTES_MAX = 32 << 20
"""The largest produce window a broker grants one stream (unacknowledged Append bytes)."""


class ProduceSession:
    def __init__(
        self,
        stream_id: int,
        range_log: RangeLog,
        producer_id: int,
        window_bytes: int,
        send: Callable[[bytes], None],
        on_error: Callable[[int, XinfraError], None],
        metrics: BrokerMetrics,
    ) -> None:
        self.stream_id = stream_id
        self.range_log = range_log
        self.producer_id = producer_id
        self.window_bytes = window_bytes
        self._send = send
        self._on_error = on_error
        self._metrics = metrics
        self._pending: deque[tuple[int, asyncio.Future[int], int]] = deque()
        self._inflight_bytes = 0
        self._flush_scheduled = False
        self._closed = False
        self._loop = asyncio.get_running_loop()

    def on_append(self, seq: int, batch: memoryview) -> None:
        """Handle one Append; raises an ``XinfraError`` that fails this stream only."""
        size = len(batch)
        if self._inflight_bytes + size > self.window_bytes and self._pending:
            raise Backpressure(
                f"append of {size} bytes exceeds the window of {self.window_bytes} bytes "
                f"({self._inflight_bytes} unacknowledged)"
            )
        count, _, _ = check_batch(batch)
        state = self.range_log.producer(self.producer_id, seq)
        if seq > state.next_seq:
            raise InvalidRequest(f"sequence number {seq} skips {state.next_seq} (appends lost?)")
        future = state.recent.get(seq) if seq < state.next_seq else None
        if seq < state.next_seq and future is None:
            raise InvalidRequest(
                f"sequence number {seq} is older than the duplicate window of {DEDUP_APPENDS_MAX}"
            )
        if future is None or (future.done() and future.exception() is not None):
            future = self.range_log.append(bytes(batch), count)
            state.recent[seq] = future
            if seq == state.next_seq:
                state.next_seq = seq + 1
            while len(state.recent) > DEDUP_APPENDS_MAX:
                state.recent.popitem(last=False)
            metrics = self._metrics
            metrics.appends.inc()
            metrics.append_bytes.inc(size)
            metrics.append_records.inc(count)
        self._inflight_bytes += size
        self._pending.append((seq, future, size))
        future.add_done_callback(self._on_done)

    def _on_done(self, future: asyncio.Future[int]) -> None:
        if self._closed:  # nobody will ack it: its failure is known, not an unseen error
            _retrieve(future)
            return
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush_acks)

    def _flush_acks(self) -> None:
        self._flush_scheduled = False
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
                self._send(
                    protocol.encode_ack(self.stream_id, first_seq, offsets, self.window_bytes)
                )
                first_seq, offsets = seq + 1, []
        if offsets:
            self._send(protocol.encode_ack(self.stream_id, first_seq, offsets, self.window_bytes))
            self._metrics.acks.inc()
        if failure is not None:
            error = failure if isinstance(failure, XinfraError) else XinfraError(repr(failure))
            self.close()
            self._on_error(self.stream_id, error)

    def close(self) -> None:
        self._closed = True
        for _, future, _ in self._pending:
            if future.done():
                _retrieve(future)
        self._pending.clear()


def _retrieve(future: asyncio.Future[int]) -> None:
    if not future.cancelled():
        future.exception()
