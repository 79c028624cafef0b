"""One client connection: decode frames, run unary requests, own the connection's streams.

A protocol error (bad frame, wrong version, oversized frame, unexpected
message type) is answered with one ERROR frame and closes *this* connection;
the broker keeps serving every other.  An error inside one stream (unknown
topic, sealed range, corrupt batch, window overrun) fails only that stream
with a STREAM_ERROR.  Every task a connection starts is owned by it and
cancelled when it closes.

Authentication: a broker started with a cluster secret serves a connection
only after an ``authenticate`` request carrying a credential
(``backends.northguard.credentials``).  It is a unary request rather than a
new frame type so old decoders and the fuzz corpus stay valid, and it is
handled synchronously in frame order: a client may pipeline it with the
requests and stream opens that follow.  Every later request and stream open is
authorized against the credential's ops and scope, with the broker's clock for
expiry (produce: write; consume, list, describe: read; create, delete, seal,
split, merge: admin); ``list_topics`` lists the scope only.  A refusal is an
``unauthorized`` error response (or STREAM_ERROR) at once, never a hang; the
connection stays open so the client can authenticate again with a fresh
credential (a connection may re-authenticate at any time).  ``ping`` is
answered without a credential (it reveals the broker id only).  Streams are
authorized when opened and are not cut when the credential later expires.

Frames a connection answers in one turn of the event loop leave in one
socket write at the end of the turn: a write per Ack was a system call and a
wake-up of the client each, about 5,000 of them a second for one producer
writing 512 ranges (``northguard_writes`` counts the writes,
``northguard_acks`` the Acks).  The Acks of that turn (one group commit
completes every stream it carried) are built then, by each produce session a
commit made due, and go in one ACK frame, up to ``ACK_FRAME_BYTES_MAX``; a
frame queued after them goes after them.

Bounds: ``STREAMS_PER_CONNECTION_MAX`` streams, ``REQUESTS_INFLIGHT_MAX``
unary requests in flight, and ``WRITE_BUFFER_BYTES_MAX`` bytes queued for the
socket before the connection stops reading (back-pressure on a slow client).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from backends.northguard import protocol
from backends.northguard.broker.consume_session import ConsumeSession, SealedSegment
from backends.northguard.broker.coordinator import Coordinator
from backends.northguard.broker.fields import int_field, str_field
from backends.northguard.broker.metrics import BrokerMetrics
from backends.northguard.broker.produce_session import PRODUCE_WINDOW_BYTES_MAX, ProduceSession
from backends.northguard.broker.range_log import RangeLog
from backends.northguard.broker.replication import ReplicaSession
from backends.northguard.broker.requests import BROKER_OPS, handle_request, operation_of
from backends.northguard.credentials import ADMIN, ALL_TOPICS, READ, WRITE, Claims, verify
from backends.northguard.frame_reader import FrameReader
from backends.northguard.protocol import MsgType
from backends.northguard.runtime import CLOSE_FLUSH_S, close_writer
from xinfra.errors import (
    Backpressure,
    InvalidRequest,
    OffsetOutOfRange,
    ProtocolError,
    StorageError,
    Unauthorized,
    XinfraError,
)

log = logging.getLogger(__name__)
_APPEND = MsgType.APPEND  # the enum attribute costs a lookup per frame

STREAMS_PER_CONNECTION_MAX = 10_000
REQUESTS_INFLIGHT_MAX = 64
WRITE_BUFFER_BYTES_MAX = 8 << 20
ACK_FRAME_BYTES_MAX = 1 << 20
"""Acks queued past this many bytes go in a frame of their own at once (a frame's bound is the
client's, 16 MiB by default)."""


class BrokerConnection:
    def __init__(
        self,
        coordinator: Coordinator,
        metrics: BrokerMetrics,
        reader: FrameReader,
        writer: asyncio.StreamWriter,
        secret: bytes | None = None,
    ) -> None:
        self._coordinator = coordinator
        self._secret = secret
        self._claims: Claims | None = None  # None with a secret: not authenticated yet
        self._metrics = metrics
        self._reader = reader
        self._writer = writer
        self._producers: dict[int, ProduceSession] = {}
        self._consumers: dict[int, ConsumeSession] = {}
        self._replicas: dict[int, ReplicaSession] = {}  # replica streams this broker follows
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self._outbox: list[bytes] = []  # frames of this turn, written together at its end
        self._acks: list[bytes] = []  # Acks of this turn, one ACK frame in the outbox when sealed
        self._acks_bytes = 0
        self._acks_due: list[ProduceSession] = []  # sessions with commits to acknowledge
        self._loop = asyncio.get_running_loop()
        peer = writer.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)

    async def run(self) -> None:
        self._metrics.connections.inc()
        try:
            while True:
                frames = await self._reader.frames()
                if not frames:
                    break
                for item in frames:
                    self._dispatch(item)
                self._write_outbox()
                if self._writer.transport.get_write_buffer_size() > WRITE_BUFFER_BYTES_MAX:
                    await self._writer.drain()
        except ProtocolError as error:
            log.warning("closing connection from %s: %s", self.peer, error)
            self._metrics.errors.labels(error.code).inc()
            self._write(protocol.encode_error(error))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            await self.close()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._metrics.connections.dec()
        for producer in self._producers.values():
            producer.close()
        for consumer in list(self._consumers.values()):
            await consumer.close()
        self._metrics.produce_streams.dec(len(self._producers))
        self._metrics.consume_streams.dec(len(self._consumers))
        self._producers.clear()
        self._consumers.clear()
        for session in self._replicas.values():
            session.fenced = True  # its leader is gone: the coordinator fences and seals it
        self._replicas.clear()
        await self._cancel_requests()
        self._write_outbox()  # what was answered before the close (an ERROR frame) still goes
        await close_writer(self._writer)  # bounded: a client that reads nothing is aborted

    async def _cancel_requests(self) -> None:
        """Cancel the requests in flight and wait for them, at most ``CLOSE_FLUSH_S``.

        A request may run a step that finishes before it honours a cancel (a journal commit
        run ``to_completion``, waiting on a metadata replica): a broker's ``stop`` must not wait
        on it without bound, so what is still running then is logged and left to end alone (its
        answer is dropped: ``_write`` writes nothing once the connection is closed)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if not tasks:
            return
        done, running = await asyncio.wait(tasks, timeout=CLOSE_FLUSH_S)
        for task in done:
            if not task.cancelled():
                task.exception()  # retrieved: a request's failure was answered or logged
        if running:
            log.warning(
                "closing connection from %s: %d request(s) still running %.0f s after their "
                "cancel; left to end on their own",
                self.peer, len(running), CLOSE_FLUSH_S,
            )  # fmt: skip

    # -- output ----------------------------------------------------------------------------------

    def _write(self, data: bytes) -> None:
        """Queue one frame: it leaves with the turn's others when the turn ends."""
        if not self._closed:
            self._schedule_write()
            self._seal_acks()  # the commits before it: acknowledged before it
            self._outbox.append(data)

    def _ack(self, entry: bytes) -> None:
        """Queue one stream's Ack (``protocol.ack_entry``): it leaves with the turn's other Acks,
        in one frame."""
        if not self._closed:
            self._schedule_write()
            self._acks.append(entry)
            self._acks_bytes += len(entry)
            if self._acks_bytes >= ACK_FRAME_BYTES_MAX:
                self._frame_acks()

    def _request_acks(self, session: ProduceSession) -> None:
        """``session`` has commits to acknowledge: it builds its Ack when the turn's frames go."""
        if not self._closed:
            self._schedule_write()
            self._acks_due.append(session)

    def _schedule_write(self) -> None:
        """Write at the end of the turn, unless something queued this turn already asked to."""
        if not self._outbox and not self._acks and not self._acks_due:
            self._loop.call_soon(self._write_outbox)

    def _seal_acks(self) -> None:
        """The due sessions' Acks, then every Ack queued, as one frame at the outbox's end."""
        while self._acks_due:  # a session failing here writes its STREAM_ERROR: it may add more
            due, self._acks_due = self._acks_due, []
            for session in due:
                session.acknowledge()
        if self._acks:
            self._frame_acks()

    def _frame_acks(self) -> None:
        self._outbox.append(protocol.encode_acks(self._acks))
        self._acks = []
        self._acks_bytes = 0

    def _write_outbox(self) -> None:
        self._seal_acks()
        outbox = self._outbox
        if outbox:
            self._outbox = []
            if not self._writer.is_closing():
                self._writer.writelines(outbox)
                self._metrics.counts.writes += 1

    async def _write_and_drain(self, data: bytes) -> None:
        self._write(data)
        self._write_outbox()  # a Push: at once, so the buffer's size below counts it
        if self._writer.transport.get_write_buffer_size() > WRITE_BUFFER_BYTES_MAX:
            await self._writer.drain()

    def _stream_error(self, stream_id: int, error: XinfraError) -> None:
        """Fail one stream: tell the client, forget the stream (its later frames are ignored)."""
        self._metrics.errors.labels(error.code).inc()
        if (producer := self._producers.pop(stream_id, None)) is not None:
            producer.close()
            self._metrics.produce_streams.dec()
        if (consumer := self._consumers.pop(stream_id, None)) is not None:
            self._metrics.consume_streams.dec()
            consumer.stop()  # now: the spawned close may be cancelled unrun
            self._spawn(consumer.close())
        if (replica := self._replicas.pop(stream_id, None)) is not None:
            replica.fenced = True
        self._write(
            protocol.encode_json(MsgType.STREAM_ERROR, stream_id, protocol.error_payload(error))
        )

    def _spawn(self, coroutine: Any) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- input -----------------------------------------------------------------------------------

    def _dispatch(self, item: protocol.Frame) -> None:
        kind = item.type
        if kind is _APPEND:
            stream_id, seq, batch = protocol.decode_append(item.body)
            producer = self._producers.get(stream_id)
            if producer is not None:  # else: a stream already failed; its in-flight frames are moot
                try:
                    producer.on_append(seq, batch)
                except XinfraError as error:
                    self._stream_error(stream_id, error)
        elif kind is MsgType.REPLICA_APPEND:
            stream_id, base_offset, count, committed, data = protocol.decode_replica_append(
                item.body
            )
            replica = self._replicas.get(stream_id)
            if replica is not None:
                try:
                    replica.on_append(base_offset, count, committed, data)
                except XinfraError as error:
                    self._stream_error(stream_id, error)
        elif kind is MsgType.REPLICA_OPEN:
            stream_id, payload = protocol.decode_json(item.body)
            self._open(stream_id, payload, self._open_replica)
        elif kind is MsgType.READ:
            stream_id, consumed, window = protocol.decode_read(item.body)
            consumer = self._consumers.get(stream_id)
            if consumer is not None:
                try:
                    consumer.on_read(consumed, window)
                except XinfraError as error:
                    self._stream_error(stream_id, error)
        elif kind is MsgType.REQUEST:
            correlation, payload = protocol.decode_json(item.body)
            if payload.get("op") == "authenticate":
                self._write(
                    protocol.encode_json(MsgType.RESPONSE, correlation, self._authenticate(payload))
                )
            elif len(self._tasks) >= REQUESTS_INFLIGHT_MAX:
                busy = Backpressure(f"more than {REQUESTS_INFLIGHT_MAX} requests in flight")
                self._write(
                    protocol.encode_json(
                        MsgType.RESPONSE, correlation, protocol.error_payload(busy)
                    )
                )
            else:
                self._spawn(self._request(correlation, payload))
        elif kind is MsgType.PRODUCE_OPEN:
            stream_id, payload = protocol.decode_json(item.body)
            self._open(stream_id, payload, self._open_produce)
        elif kind is MsgType.CONSUME_OPEN:
            stream_id, payload = protocol.decode_json(item.body)
            self._open(stream_id, payload, self._open_consume)
        elif kind is MsgType.STREAM_CLOSE:
            stream_id = protocol.decode_stream_close(item.body)
            if (producer := self._producers.pop(stream_id, None)) is not None:
                producer.close()
                self._metrics.produce_streams.dec()
            if (consumer := self._consumers.pop(stream_id, None)) is not None:
                self._metrics.consume_streams.dec()
                consumer.stop()  # now: the spawned close may be cancelled unrun
                self._spawn(consumer.close())
            self._replicas.pop(stream_id, None)  # the session stays for the fence
        else:
            raise ProtocolError(f"a client does not send {kind.name} messages")

    def _authenticate(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Verify a credential and adopt it; a refused one also drops the previous one."""
        if self._secret is None:
            return {"result": {"principal": None}}
        try:
            self._claims = None
            self._claims = verify(self._secret, payload.get("credential"), time.time())  # type: ignore[arg-type]
        except Unauthorized as error:
            log.warning("refused a credential from %s: %s", self.peer, error.message)
            self._metrics.errors.labels(error.code).inc()
            return protocol.error_payload(error)
        claims = self._claims
        return {"result": {"principal": claims.principal, "expires_s": claims.expires_s}}

    def _authorize(self, operation: str | None, topic: str | None) -> None:
        """Raise ``Unauthorized`` unless this connection may do ``operation`` (None: anyone may)."""
        if self._secret is None or operation is None:
            return
        if self._claims is None:
            raise Unauthorized(
                "this Northguard broker requires a credential: send an authenticate request "
                "first (the metadata service issues credentials with topic metadata)"
            )
        self._claims.authorize(operation, topic, time.time())

    async def _request(self, correlation: int, payload: dict[str, Any]) -> None:
        op = str(payload.get("op"))
        try:
            name = payload.get("name")
            topic = ALL_TOPICS if op in BROKER_OPS else name if isinstance(name, str) else None
            self._authorize(operation_of(op), topic)
            result = await handle_request(self._coordinator, payload)
            if op == "list_topics" and self._claims is not None:
                result = {"topics": [t for t in result["topics"] if self._claims.covers(t)]}
            self._metrics.requests.labels(op if len(op) < 40 else "other").inc()
            response: dict[str, Any] = {"result": result}
        except XinfraError as error:
            self._metrics.errors.labels(error.code).inc()
            response = protocol.error_payload(error)
        except Exception as error:  # a bug: report it as internal, keep serving
            log.exception("request %s failed", op)
            response = protocol.error_payload(XinfraError(f"internal error in {op}: {error!r}"))
        self._write(protocol.encode_json(MsgType.RESPONSE, correlation, response))

    def _open(self, stream_id: int, payload: dict[str, Any], opener: Any) -> None:
        try:
            if (
                stream_id in self._producers
                or stream_id in self._consumers
                or stream_id in self._replicas
            ):
                raise InvalidRequest(f"stream id {stream_id} is already open on this connection")
            streams = len(self._producers) + len(self._consumers) + len(self._replicas)
            if streams >= STREAMS_PER_CONNECTION_MAX:
                raise Backpressure(
                    f"more than {STREAMS_PER_CONNECTION_MAX} streams on a connection"
                )
            opener(stream_id, payload)
        except XinfraError as error:
            self._metrics.errors.labels(error.code).inc()
            self._write(
                protocol.encode_json(MsgType.STREAM_ERROR, stream_id, protocol.error_payload(error))
            )
        except (KeyError, TypeError, ValueError, ArithmeticError) as error:
            failure = InvalidRequest(f"malformed stream open: {error!r}")
            self._write(
                protocol.encode_json(
                    MsgType.STREAM_ERROR, stream_id, protocol.error_payload(failure)
                )
            )

    def _open_produce(self, stream_id: int, payload: dict[str, Any]) -> None:
        topic, range_id = str_field(payload, "topic"), int_field(payload, "range_id")
        self._authorize(WRITE, topic)
        window = int_field(payload, "window_bytes", low=1, default=PRODUCE_WINDOW_BYTES_MAX)
        window = min(window, PRODUCE_WINDOW_BYTES_MAX)
        producer_id = int_field(payload, "producer_id")
        range_log = self._coordinator.range_log(topic, range_id)  # NotLeader: not led here
        if range_log.led_by is not None:
            raise range_log.not_leader()
        if (failure := self._coordinator.store_failure) is not None:
            raise StorageError(f"this broker takes no appends until its store recovers: {failure}")
        self._producers[stream_id] = ProduceSession(
            stream_id,
            range_log,
            producer_id,
            window,
            self._ack,
            self._request_acks,
            self._stream_error,
            self._metrics,
        )
        self._metrics.produce_streams.inc()
        self._write(
            protocol.encode_json(
                MsgType.PRODUCE_OPENED,
                stream_id,
                {
                    "window_bytes": window,
                    "segment": range_log.active,
                    "end_offset": range_log.committed,
                },
            )
        )

    def _open_replica(self, stream_id: int, payload: dict[str, Any]) -> None:
        """A segment leader opens the replica stream of a segment this broker follows."""
        self._authorize(ADMIN, ALL_TOPICS)
        str_field(payload, "segment_id")
        int_field(payload, "start_offset")
        if (failure := self._coordinator.store_failure) is not None:
            raise StorageError(f"this broker takes no replicas until its store recovers: {failure}")
        session, end_offset = self._coordinator.replicas.open(
            stream_id, payload, self._write, self._stream_error
        )
        self._replicas[stream_id] = session
        self._write(
            protocol.encode_json(MsgType.REPLICA_OPENED, stream_id, {"end_offset": end_offset})
        )

    def _open_consume(self, stream_id: int, payload: dict[str, Any]) -> None:
        topic, range_id = str_field(payload, "topic"), int_field(payload, "range_id")
        self._authorize(READ, topic)
        offset = int_field(payload, "offset", high=(1 << 63) - 1)
        window = int_field(payload, "window_bytes", low=1, high=protocol.CONSUME_WINDOW_BYTES_MAX)
        source: RangeLog | SealedSegment
        if "segment_id" in payload:  # one sealed segment this broker holds (re-replication)
            self._authorize(ADMIN, ALL_TOPICS)
            source = SealedSegment(self._coordinator.store, str_field(payload, "segment_id"))
            start, end = source.start_offset, source.end_offset
        else:
            source = self._coordinator.range_log(topic, range_id)  # NotLeader: not led here
            if source.led_by is not None:
                raise source.not_leader()
            start, end = source.meta.start_offset, source.committed
        if not start <= offset <= end:
            raise OffsetOutOfRange(f"offset {offset} is outside range {range_id} [{start}, {end}]")
        consumer = ConsumeSession(
            stream_id,
            source,
            offset,
            window,
            self._write_and_drain,
            self._stream_error,
            self._metrics,
        )
        self._consumers[stream_id] = consumer
        self._metrics.consume_streams.inc()
        self._write(
            protocol.encode_json(
                MsgType.CONSUME_OPENED,
                stream_id,
                {"start_offset": start, "end_offset": end},
            )
        )
        consumer.start()
