"""Active segment replication: the leader's ``Replicator`` and the follower's ``ReplicaHost``.

**Leader.**  For each active segment with followers, the range log's
``Replicator`` holds one replica stream per follower (a ``ReplicaStream``
over the peer connection, ``peers.py``).  Every append the range log issues
to its own store is also sent, in offset order and pipelined, as a
ReplicaAppend carrying the same opaque batch bytes and the committed offset;
a follower answers ReplicaAcks with its *durable* end (after its store's
fsync, i.e. its group commit).  ``acked_end`` is the smallest of those ends:
the range log commits an append only when its own store made it durable and
``acked_end`` covers it (``DESIGN.md`` §3 "Commit rule").  When the commit
point moves and no append carries it within ``COMMITTED_NOTICE_S``, a
zero-record ReplicaAppend tells the followers the new committed offset.
(One such frame per event-loop turn, the old rule, woke every follower once
more per commit: ~15% of the frames a follower read at 10k records/s.)

**Failure detection.**  A replica stream fails when its connection does, when
the follower answers STREAM_ERROR, or when a ReplicaAppend is not acknowledged
within ``replica_timeout_s`` (a hung or stopped follower keeps its socket
open).  The first failure is reported once to the range log, which seals the
segment on the survivors at the smallest log end among them and moves on to a
new segment (``Coordinator._roll``); the replicator sends nothing more.

**Follower.**  ``ReplicaHost`` keeps one ``ReplicaSession`` per replicated
segment: it hands each ReplicaAppend to the store at once (``submit``:
appends to one segment take effect in call order, so many ride one group
commit) and acks the contiguous durable end from the store's own callback,
once per group commit (the store resolves a group's appends together, so the
first callback sees them all): no task per append and no extra event-loop
turn before the ack, each of which, on three brokers sharing two cores, is a
wake-up the leader's commit waits for.  ``fence`` stops
the session (later ReplicaAppends fail the stream with ``Sealed``), waits for
its store appends in flight and answers the store's durable end; ``seal``
then truncates the replica to the end the leader chose and seals it.

Bounds: the leader sends at most what its producers' windows admit (the
range log's in-flight appends); ``SENT_MAX`` outstanding ReplicaAppends per
segment; a follower holds at most ``FOLLOWER_PENDING_MAX`` appends in
flight per session before it fails the stream with ``Backpressure``.

Cost per append and follower: one frame (header + the batch bytes, no copy
of the records), one store append on the follower (its share of a group
commit), one ReplicaAck shared by every append of a group commit.  Latency: the
follower's group-commit window plus one fsync plus one round trip, in
parallel with the leader's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import struct
from collections import deque
from collections.abc import Callable
from typing import Any

from backends.northguard import protocol
from backends.northguard.client.connection import ClientConnection, error_of
from backends.northguard.protocol import MsgType
from backends.northguard.runtime import Runtime
from backends.northguard.store.base import Entry, SegmentStore
from xinfra.errors import (
    BackendTimeout,
    Backpressure,
    NotFound,
    ProtocolError,
    Sealed,
    XinfraError,
)

log = logging.getLogger(__name__)

REPLICA_TIMEOUT_S = 5.0
"""A follower that has not acknowledged a ReplicaAppend this long after it was sent has failed."""
SENT_MAX = 1_000_000
"""ReplicaAppends a leader tracks per segment (bounded in practice by the produce windows)."""
COMMITTED_NOTICE_S = 0.05
"""How late a follower may learn a commit point no append carried (a frame of its own then)."""
FOLLOWER_PENDING_MAX = 100_000
"""Store appends a follower keeps in flight per session."""
CHECKSUM_READ_BYTES = 4 << 20


class ReplicaStream:
    """The leader's end of one follower's replica stream (a ``StreamHandler``)."""

    def __init__(
        self,
        connection: ClientConnection,
        broker_id: str,
        segment_id: str,
        start_offset: int,
        on_ack: Callable[[], None],
        on_failure: Callable[[str, XinfraError], None],
    ) -> None:
        self.connection = connection
        self.broker_id = broker_id
        self.segment_id = segment_id
        self.acked_end = start_offset
        self._on_ack = on_ack
        self._on_failure = on_failure
        self.failure: XinfraError | None = None
        self.opened: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.stream_id = connection.open_stream(self)
        connection.send(
            protocol.encode_json(
                MsgType.REPLICA_OPEN,
                self.stream_id,
                {"segment_id": segment_id, "start_offset": start_offset},
            )
        )

    def append(self, base_offset: int, count: int, committed: int, batch: bytes) -> None:
        if self.failure is None:
            try:
                self.connection.send(
                    protocol.encode_replica_append(
                        self.stream_id, base_offset, count, committed, batch
                    )
                )
            except XinfraError as error:
                self.on_failure(error)

    def on_ack(self, first_seq: int, offsets: tuple[int, ...], window_bytes: int) -> None:
        self.on_failure(ProtocolError("unexpected ACK on a replica stream"))

    def on_frame(self, kind: MsgType, body: bytes) -> None:
        if kind is MsgType.REPLICA_ACK:
            _, durable_end = protocol.decode_replica_ack(body)
            if durable_end > self.acked_end:
                self.acked_end = durable_end
                self._on_ack()
        elif kind is MsgType.REPLICA_OPENED:
            _, payload = protocol.decode_json(body)
            if not self.opened.done():
                self.opened.set_result(int(payload["end_offset"]))
        elif kind is MsgType.STREAM_ERROR:
            _, payload = protocol.decode_json(body)
            self.connection.forget_stream(self.stream_id)
            self.on_failure(error_of(payload))
        else:
            self.on_failure(ProtocolError(f"unexpected {kind.name} on a replica stream"))

    def on_failure(self, error: XinfraError) -> None:
        if self.failure is not None:
            return
        self.failure = error
        if not self.opened.done():
            self.opened.set_exception(error)
            self.opened.exception()  # retrieved: the owner learns through on_failure
        self._on_failure(self.broker_id, error)

    def close(self) -> None:
        if self.failure is None and not self.connection.closed:
            self.connection.send(protocol.encode_stream_close(self.stream_id))
        self.connection.forget_stream(self.stream_id)
        self.failure = self.failure or XinfraError("replica stream closed")


class Replicator:
    """The followers of one active segment, as the leader's range log sees them."""

    def __init__(
        self,
        runtime: Runtime,
        segment_id: str,
        start_offset: int,
        timeout_s: float,
        on_progress: Callable[[], None],
        on_failure: Callable[[str, XinfraError], None],
    ) -> None:
        self._runtime = runtime
        self.segment_id = segment_id
        self.timeout_s = timeout_s
        self.streams: dict[str, ReplicaStream] = {}
        self._on_progress = on_progress
        self._on_failure = on_failure
        self.failed: dict[str, XinfraError] = {}
        self._sent: deque[tuple[int, float]] = deque()  # (end offset, monotonic send time)
        self._timer: asyncio.TimerHandle | None = None
        self._committed_sent = start_offset
        self._committed_wanted = start_offset
        self._commit_timer: asyncio.TimerHandle | None = None
        self._end = start_offset
        self.closed = False

    @property
    def followers(self) -> list[str]:
        return list(self.streams)

    def add(self, stream: ReplicaStream) -> None:
        self.streams[stream.broker_id] = stream

    def acked_end(self) -> int:
        """The smallest durable end among the followers: what every replica has on disk."""
        return min(stream.acked_end for stream in self.streams.values())

    def send(self, base_offset: int, count: int, batch: bytes, committed: int) -> None:
        if self.closed:
            return
        assert base_offset == self._end, f"replicated offsets not contiguous: {base_offset}"
        self._end = base_offset + count
        for stream in self.streams.values():
            stream.append(base_offset, count, committed, batch)
        self._committed_sent = committed
        if len(self._sent) >= SENT_MAX:
            self.fail_all(Backpressure(f"more than {SENT_MAX} ReplicaAppends unacknowledged"))
            return
        self._sent.append((self._end, self._runtime.monotonic_s()))
        if self._timer is None:
            self._arm(self.timeout_s)

    def send_committed(self, committed: int) -> None:
        """Tell the followers the commit point within ``COMMITTED_NOTICE_S``, unless an append
        carries it first (under load one always does: no frame of its own)."""
        if self.closed or committed <= self._committed_sent:
            return
        self._committed_wanted = committed
        if self._commit_timer is None:
            self._commit_timer = self._runtime.call_later(COMMITTED_NOTICE_S, self._flush_committed)

    def _flush_committed(self) -> None:
        self._commit_timer = None
        committed = self._committed_wanted
        if self.closed or committed <= self._committed_sent:
            return
        self._committed_sent = committed
        for stream in self.streams.values():
            stream.append(self._end, 0, committed, b"")

    def on_ack(self) -> None:
        acked = self.acked_end()
        sent = self._sent
        while sent and sent[0][0] <= acked:
            sent.popleft()
        self._on_progress()

    def _arm(self, delay_s: float) -> None:
        self._timer = self._runtime.call_later(max(0.0, delay_s), self._check_lag)

    def _check_lag(self) -> None:
        self._timer = None
        if self.closed or not self._sent:
            return
        end, sent_s = self._sent[0]
        waited_s = self._runtime.monotonic_s() - sent_s
        if waited_s < self.timeout_s:
            self._arm(self.timeout_s - waited_s)
            return
        for broker_id, stream in list(self.streams.items()):
            if stream.acked_end < end:
                error = BackendTimeout(
                    f"follower {broker_id} did not acknowledge offset {end - 1} of segment "
                    f"{self.segment_id} within {self.timeout_s:g} s"
                )
                stream.on_failure(error)
                self.stream_failed(broker_id, stream.failure or error)  # once per follower

    def stream_failed(self, broker_id: str, error: XinfraError) -> None:
        if self.closed or broker_id in self.failed:
            return
        self.failed[broker_id] = error
        log.warning(
            "segment %s: follower %s failed (%s); sealing the segment on the survivors",
            self.segment_id,
            broker_id,
            error,
        )
        self._on_failure(broker_id, error)

    def fail_all(self, error: XinfraError) -> None:
        for stream in list(self.streams.values()):
            stream.on_failure(error)

    def close(self) -> None:
        """Send nothing more (the segment is being sealed); the streams stay for the fence."""
        self.closed = True
        for timer in (self._timer, self._commit_timer):
            if timer is not None:
                timer.cancel()
        self._timer = self._commit_timer = None

    def close_streams(self) -> None:
        self.close()
        for stream in self.streams.values():
            stream.close()


class ReplicaSession:
    """The follower's end of one replica stream: store appends in order, acks of the durable end."""

    def __init__(
        self,
        stream_id: int,
        segment_id: str,
        store: SegmentStore,
        end_offset: int,
        send: Callable[[bytes], None],
        on_error: Callable[[int, XinfraError], None],
        host: ReplicaHost | None = None,
    ) -> None:
        self.stream_id = stream_id
        self.segment_id = segment_id
        self._host = host
        self._store = store
        self._send = send
        self._on_error = on_error
        self.next_offset = end_offset
        self.durable_end = end_offset
        self.committed = 0
        self._pending: deque[tuple[int, asyncio.Future[Entry]]] = deque()
        self._idle = asyncio.Event()
        self._idle.set()
        self._acked = end_offset
        self.fenced = False
        self.failure: XinfraError | None = None

    def on_append(self, base_offset: int, count: int, committed: int, batch: bytes) -> None:
        """One ReplicaAppend; raises an ``XinfraError`` that fails this stream."""
        if self.fenced:
            raise Sealed(f"replica of segment {self.segment_id} is fenced")
        if self.failure is not None:
            raise self.failure
        self.committed = max(self.committed, committed)
        if count == 0:
            return
        if base_offset != self.next_offset:
            raise ProtocolError(
                f"ReplicaAppend at {base_offset} of segment {self.segment_id} "
                f"where {self.next_offset} was expected"
            )
        if len(self._pending) >= FOLLOWER_PENDING_MAX:
            raise Backpressure(f"more than {FOLLOWER_PENDING_MAX} replica appends in flight")
        self.next_offset = base_offset + count
        if self._host is not None:
            self._host.appends_received += 1
            self._host.bytes_received += len(batch)
        stored = self._store.submit(self.segment_id, base_offset, count, batch)
        self._pending.append((base_offset + count, stored))
        self._idle.clear()
        stored.add_done_callback(self._stored)

    def _stored(self, _: asyncio.Future[Entry]) -> None:
        pending = self._pending
        while pending and pending[0][1].done():
            end, stored = pending.popleft()
            error = None if stored.cancelled() else stored.exception()
            if stored.cancelled() or error is not None:
                if self.failure is None:
                    self.failure = (
                        error
                        if isinstance(error, XinfraError)
                        else XinfraError(f"replica append failed: {error!r}")
                    )
                    self._on_error(self.stream_id, self.failure)
                continue
            if self.failure is None:
                self.durable_end = end
        if not pending:
            self._idle.set()
        if self.durable_end > self._acked and self.failure is None and not self.fenced:
            self._acked = self.durable_end
            self._send(protocol.encode_replica_ack(self.stream_id, self.durable_end))

    async def fence(self) -> None:
        """Refuse further ReplicaAppends and wait for the store appends in flight."""
        self.fenced = True
        await self._idle.wait()


class ReplicaHost:
    """The replicas this broker follows: sessions by segment id, and the fence and seal steps."""

    def __init__(self, store: SegmentStore) -> None:
        self._store = store
        self.sessions: dict[str, ReplicaSession] = {}
        self.appends_received = 0
        self.bytes_received = 0

    def open(
        self,
        stream_id: int,
        payload: dict[str, Any],
        send: Callable[[bytes], None],
        on_error: Callable[[int, XinfraError], None],
    ) -> tuple[ReplicaSession, int]:
        segment_id = str(payload["segment_id"])
        info = self._store.segment(segment_id)  # NotFound: replica_create never reached us
        if int(payload["start_offset"]) != info.start_offset:
            raise ProtocolError(
                f"segment {segment_id} starts at {info.start_offset}, not {payload['start_offset']}"
            )
        old = self.sessions.get(segment_id)
        if old is not None:
            old.fenced = True
        session = ReplicaSession(
            stream_id, segment_id, self._store, info.end_offset, send, on_error, self
        )
        self.sessions[segment_id] = session
        return session, info.end_offset

    async def create(self, segment_id: str, start_offset: int) -> None:
        await self._store.create_segment(segment_id, start_offset)

    async def fence(self, segment_id: str) -> int:
        """Stop taking appends to ``segment_id``; its durable end once the appends in flight end."""
        session = self.sessions.get(segment_id)
        if session is not None:
            await session.fence()
        return self._store.segment(segment_id).end_offset

    async def seal(self, segment_id: str, end_offset: int) -> int:
        session = self.sessions.pop(segment_id, None)
        if session is not None:
            await session.fence()
        info = await self._store.seal(segment_id, end_offset)
        return info.end_offset

    async def checksum(self, segment_id: str) -> dict[str, Any]:
        """SHA-256 over this replica's entries (base offset, count, batch bytes), in order: equal
        on every replica of a sealed segment (a cold path: reads the whole segment)."""
        info = self._store.segment(segment_id)
        digest = hashlib.sha256()
        offset = info.start_offset
        while offset < info.end_offset:
            entries = await self._store.read(segment_id, offset, CHECKSUM_READ_BYTES)
            if not entries:
                break
            for entry in entries:
                digest.update(struct.pack("<QI", entry.base_offset, entry.record_count))
                digest.update(entry.batch)
            offset = entries[-1].end_offset
        return {
            "segment_id": segment_id,
            "state": info.state.value,
            "start_offset": info.start_offset,
            "end_offset": info.end_offset,
            "sha256": digest.hexdigest(),
        }

    async def delete(self, segment_id: str) -> None:
        session = self.sessions.pop(segment_id, None)
        if session is not None:
            session.fenced = True
        with contextlib.suppress(NotFound):
            await self._store.delete_segment(segment_id)
