"""One client connection to a broker: unary requests by correlation id, streams by stream id.

A reader task (owned by the connection, cancelled by ``close``) decodes
frames and routes them.  When the connection fails, every pending request and
every stream is failed with ``BackendUnavailable`` naming the broker, exactly
once; the owners reconnect if they want to.  Requests in flight are bounded
by ``REQUESTS_INFLIGHT_MAX``.

Frames sent in one turn of the event loop (several shards' batches sealed by
the same tick, a credit and a request) leave in one socket write at the end
of the turn: a write is a system call and a wake-up of the broker, the
largest per-batch cost of a producer at a steady rate.  **Writes are at least
``WRITE_GAP_S`` apart**: frames queued sooner after a write wait for that
moment, with whatever the turns until then add.  An application that sends
once per turn to many ranges (each send its own batch: nothing else waits
for that range) otherwise wrote once per batch; the broker then woke, read
and answered per batch too.  Measured on ``bench/northguard_scale.py``'s
512-range workload against an in-memory broker (2 shared cores, with the
broker's writes per turn): 0.5 ms cut the producer's CPU per run by 8-17%
and the broker's by 20-28%, and the rate rose from 0.61-0.64x to
0.77-0.79x of one range's; the p99 of ``bench/northguard.py``'s 10k
records/s run stayed 8.7 ms (its sends are farther apart than the gap, so
they leave at the end of their turn, as before).  At 0.5 ms the producer
still wrote ~2,000 times a second, and on 2 shared cores each write's
wake-up of the broker's event loop was a preemption of the producer: in
``perf sched`` the producer was switched out runnable ~135 times a second
for the broker's loop alone, 0.8-1.3 s of run-queue wait per 8 s run.  Two
sets of interleaved runs of that workload, medians of the 512-range rate: 0.5
ms against 2 ms, 12 runs each, 0.50M against 0.55M records/s; then 1, 2 and 4
ms, 9 runs each, 0.59M, 0.54M and 0.55M.  1 ms: no gap tried did better
within the spread, and a longer one adds more latency.  Full runs of that
bench the same hour did not show it above their spread (512/1 0.70-0.81
against 0.73-0.75 before); ``bench/northguard.py``'s p50 rose 7.2 -> 7.5 ms.

**Writes are bounded** (``WRITE_BYTES_MAX``): the transport is handed at most
that much at once, and only while what it holds is below it; the rest stays
in the outbox, frame by frame, until it drains (a writer task owned by the
connection).  A producer whose windows open in one turn queues tens of MB
(32 MiB per stream); handed over at once, every such turn made one joined
copy of it, the transport a second (and under TLS the encrypted copy in the
SSL buffer and the copy read out of it), each a fresh allocation above
glibc's mmap bound (32 MiB: mmaps of 34-60 MB seen) that was mapped, faulted
in page by page and unmapped again.  Measured on ``bench/northguard.py``'s
100 B produce (1M records, 4 shards): 90-160k page faults per run in the
producing thread, 0.3-1.1 s of kernel time in a 2-3 s run (3-9 us a fault
on the shared VM, varying with the machine's state: TLS runs paid up to
twice the plain ones, the spread of ``tls_produce_ratio``); bounded, 20-50k
faults and 0.10-0.18 s.

Credentials: with a ``CredentialSource`` the connection authenticates first
(``backends.northguard.credentials``), re-authenticates in band (pipelined
before the next request or stream open) once its credential is within
``REFRESH_AHEAD_S`` of expiry and the source has a newer one, and retries a
request refused as ``unauthorized`` once after re-authenticating with a
newer credential.

TLS: with an ``ssl.SSLContext`` (``backends.northguard.tls.client_context``
of the cluster's attributes) ``open`` completes a TLS handshake verifying the
broker's certificate before anything is sent; a failed handshake is a
``BackendUnavailable`` naming TLS and what to check, within the timeout.  A
plaintext connection that a broker closes before any answer (what a TLS
broker does) says TLS may be why.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import ssl
import struct
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from backends.northguard import credentials, protocol, tls
from backends.northguard.frame_reader import FrameReader
from backends.northguard.protocol import MsgType
from backends.northguard.runtime import Runtime, TlsHandshakeError, close_writer
from xinfra.errors import (
    BackendTimeout,
    BackendUnavailable,
    Backpressure,
    ProtocolError,
    Unauthorized,
    XinfraError,
    error_from_code,
)

log = logging.getLogger(__name__)

REQUESTS_INFLIGHT_MAX = 256
WRITE_BUFFER_BYTES_MAX = 8 << 20
WRITE_BYTES_MAX = 1 << 20
"""The most bytes handed to the transport in one write, and its high-water mark: more waits in
the outbox (as frames, not copied) until the transport drains below a quarter of it."""
WRITE_GAP_S = 0.001
"""The least time between two writes of a connection (frames wait at most this long, and only
behind a write that left less than this before them)."""
LONG_TURN_S = 0.005
LONG_TURN_BYTES = 64 << 10
"""A turn that has queued ``LONG_TURN_BYTES`` over more than ``LONG_TURN_S`` writes them then,
not at its end: a producer's first write to 4,096 new ranges queues every stream's open and
first batch in one turn of ~0.2 s, and the broker sat idle through it."""
_STREAM_ID = struct.Struct("<I")
_ACK = MsgType.ACK  # a module constant: the enum's attribute lookup costs more than the test
_STREAM_FRAMES = frozenset(
    (
        MsgType.PUSH,
        MsgType.PRODUCE_OPENED,
        MsgType.CONSUME_OPENED,
        MsgType.STREAM_ERROR,
        MsgType.REPLICA_OPENED,
        MsgType.REPLICA_ACK,
    )
)
"""Frames a stream answers (the stream id leads their body): the data path, tested first."""
REFRESH_AHEAD_S = 60.0
"""Re-authenticate this long before the connection's credential expires."""

CredentialSource = Callable[[], str | None]
"""The freshest credential for a cluster (None: the broker is open), asked at every (re)connect."""


class StreamHandler(Protocol):
    def on_frame(self, kind: MsgType, body: bytes) -> None: ...

    def on_ack(self, first_seq: int, offsets: tuple[int, ...], window_bytes: int) -> None:
        """One Ack of an ACK frame (the frame holds those of many streams)."""

    def on_failure(self, error: XinfraError) -> None: ...


def error_of(payload: dict[str, Any]) -> XinfraError:
    error = payload.get("error") or {}
    return error_from_code(str(error.get("code", "internal")), str(error.get("message", "")))


class ClientConnection:
    def __init__(
        self,
        address: str,
        reader: FrameReader,
        writer: asyncio.StreamWriter,
        credential_source: CredentialSource | None = None,
        encrypted: bool = False,
    ) -> None:
        self.address = address
        self.encrypted = encrypted
        self._credential_source = credential_source
        self._credential: str | None = None
        self._credential_expires_s = float("inf")
        self._reader = reader
        self._writer = writer
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._streams: dict[int, StreamHandler] = {}
        self._correlations = itertools.count(1)
        self._stream_ids = itertools.count(1)
        self.failure: XinfraError | None = None
        self._outbox: deque[bytes] = deque()  # frames not yet handed to the transport, in order
        self._outbox_bytes = 0
        self._write_due: asyncio.Handle | None = None  # writes the outbox: end of turn, or gap
        self._write_waits = False  # ``_write_due`` is the gap's timer (uvloop's is no TimerHandle)
        self._last_write_s = float("-inf")  # the loop's clock at the last write
        self._queued_since_s = 0.0  # ``time.monotonic()`` when the outbox's oldest frame came
        self._writing: asyncio.Task[None] | None = None  # waits for the transport to drain
        self._hooks: list[Callable[[], None]] = []  # run before the next write (``before_write``)
        self._running_hooks = False
        self._loop = asyncio.get_running_loop()
        writer.transport.set_write_buffer_limits(high=WRITE_BYTES_MAX)
        self._task = asyncio.create_task(self._read_loop(), name=f"northguard-conn-{address}")

    @classmethod
    async def open(
        cls,
        runtime: Runtime,
        address: str,
        timeout_s: float,
        frame_bytes_max: int = protocol.FRAME_BYTES_MAX,
        credential_source: CredentialSource | None = None,
        tls_context: ssl.SSLContext | None = None,
    ) -> ClientConnection:
        """Connect (TLS when ``tls_context``), then authenticate when the source has a credential.

        Every failure is an ``XinfraError`` within ``timeout_s`` per step: ``BackendUnavailable``
        for the network and TLS, ``Unauthorized``/``Timeout`` for the authentication.
        """
        host, _, port = address.rpartition(":")
        try:
            reader, writer = await runtime.network.connect(
                host, int(port), timeout_s, frame_bytes_max, tls_context
            )
        except TlsHandshakeError as error:
            raise BackendUnavailable(tls.describe_failure(address, error)) from error
        except (OSError, TimeoutError) as error:
            raise BackendUnavailable(
                f"cannot connect to Northguard broker {address}: {error or type(error).__name__}"
            ) from error
        connection = cls(address, reader, writer, credential_source, tls_context is not None)
        credential = credential_source() if credential_source is not None else None
        if credential is not None:
            try:
                await connection.authenticate(credential, timeout_s)
            except BaseException:
                await connection.close()
                raise
        return connection

    async def authenticate(self, credential: str, timeout_s: float) -> None:
        """Present ``credential``; ``Unauthorized`` when the broker refuses it."""
        await self._request("authenticate", timeout_s, {"credential": credential})
        self._adopt(credential)

    def _adopt(self, credential: str) -> None:
        self._credential = credential
        self._credential_expires_s = credentials.expires_s(credential)

    def _newer_credential(self) -> str | None:
        source = self._credential_source
        fresh = source() if source is not None else None
        return fresh if fresh is not None and fresh != self._credential else None

    def refresh_credential(self) -> None:
        """Pipeline an ``authenticate`` with a newer credential when the current one is about to
        expire: the broker handles frames in order, so what follows is authorized by it."""
        if self._credential is None or time.time() < self._credential_expires_s - REFRESH_AHEAD_S:
            return
        fresh = self._newer_credential()
        if fresh is not None:
            correlation = next(self._correlations) & 0xFFFFFFFF  # its answer is not awaited
            self.send(
                protocol.encode_json(
                    MsgType.REQUEST, correlation, {"op": "authenticate", "credential": fresh}
                )
            )
            self._adopt(fresh)

    @property
    def closed(self) -> bool:
        return self.failure is not None

    # -- requests --------------------------------------------------------------------------------

    async def request(self, op: str, timeout_s: float, /, **arguments: Any) -> dict[str, Any]:
        """Send one unary request and return its result; raise the broker's error by its code.

        Refused as ``unauthorized`` (an expired credential), it is retried once after
        authenticating with a newer credential from the source, if there is one.
        """
        self.refresh_credential()
        try:
            return await self._request(op, timeout_s, arguments)
        except Unauthorized:
            fresh = self._newer_credential()
            if fresh is None:
                raise
            await self.authenticate(fresh, timeout_s)
            return await self._request(op, timeout_s, arguments)

    async def _request(
        self, op: str, timeout_s: float, arguments: dict[str, Any]
    ) -> dict[str, Any]:
        if self.failure is not None:
            raise self.failure
        if len(self._pending) >= REQUESTS_INFLIGHT_MAX:
            raise Backpressure(f"more than {REQUESTS_INFLIGHT_MAX} requests in flight")
        correlation = next(self._correlations) & 0xFFFFFFFF
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[correlation] = future
        try:
            self.send(protocol.encode_json(MsgType.REQUEST, correlation, {"op": op, **arguments}))
            payload = await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            raise BackendTimeout(
                f"{op} to Northguard broker {self.address} got no answer in {timeout_s:g} s"
            ) from None
        finally:
            self._pending.pop(correlation, None)
        if "error" in payload:
            raise error_of(payload)
        result: dict[str, Any] = payload.get("result") or {}
        return result

    # -- streams ---------------------------------------------------------------------------------

    def open_stream(self, handler: StreamHandler) -> int:
        if self.failure is not None:
            raise self.failure
        self.refresh_credential()
        stream_id = next(self._stream_ids) & 0xFFFFFFFF
        self._streams[stream_id] = handler
        return stream_id

    def forget_stream(self, stream_id: int) -> None:
        self._streams.pop(stream_id, None)

    def send(self, data: bytes) -> None:
        """Queue one frame; it is written, in order, with the others queued by then: at the end of
        the turn, or ``WRITE_GAP_S`` after the last write if that is later (at once past
        ``WRITE_BYTES_MAX`` bytes; at once in a turn past ``LONG_TURN_S``)."""
        if self.failure is not None:
            raise self.failure
        self._outbox.append(data)
        self._outbox_bytes += len(data)
        due = self._write_due
        if due is None:
            self._schedule_write()
        elif self._outbox_bytes >= LONG_TURN_BYTES:
            if time.monotonic() - self._queued_since_s >= LONG_TURN_S:  # a long turn: now
                due.cancel()
                self._on_write_due()
            elif self._write_waits and self._outbox_bytes >= WRITE_BYTES_MAX:
                due.cancel()
                self._write_waits = False
                self._write_due = self._loop.call_soon(self._on_write_due)

    def before_write(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` right before the next write, which is scheduled as ``send`` schedules one:
        the frames it queues leave with that write.

        A producer seals an idle shard's records here rather than in a handle of
        its own at the end of the turn: they could not leave sooner, and with
        hundreds of ranges written at once that handle was one per batch.  On a
        failed connection the hooks run at the next turn (their frames then go
        to the owner's next stream)."""
        if self.failure is not None:
            raise self.failure
        self._hooks.append(hook)
        self._schedule_write()

    def _schedule_write(self) -> None:
        """Schedule the next write, unless one is due or the hooks of the one under way are
        running (what they queue leaves with it)."""
        if self._write_due is not None or self._running_hooks:
            return
        self._queued_since_s = time.monotonic()
        delay_s = self._last_write_s + WRITE_GAP_S - self._loop.time()
        self._write_waits = delay_s > 0
        if self._write_waits:
            self._write_due = self._loop.call_later(delay_s, self._on_write_due)
        else:
            self._write_due = self._loop.call_soon(self._on_write_due)

    def _on_write_due(self) -> None:
        self._write_due = None
        hooks = self._hooks
        if hooks:
            self._hooks = []
            self._running_hooks = True  # their frames go with this write, not a next one
            try:
                for hook in hooks:
                    hook()
            finally:
                self._running_hooks = False
        self._last_write_s = self._loop.time()
        self._write_outbox()
        if self._hooks:  # registered by a hook: the next write
            self._schedule_write()

    def _write_outbox(self, everything: bool = False) -> None:
        """Hand the transport the outbox's frames, in order, ``WRITE_BYTES_MAX`` at a time while
        it holds less than that (``everything``: all of them, for ``close``); what is left is
        written by the writer task as the transport drains."""
        outbox = self._outbox
        if not outbox or self.failure is not None:
            return
        transport = self._writer.transport
        # <=: a transport pauses its writer above its high-water mark (WRITE_BYTES_MAX), so
        # whenever this stops short the writer task's drain() waits instead of returning at once
        while outbox and (everything or transport.get_write_buffer_size() <= WRITE_BYTES_MAX):
            size = len(outbox[0])
            if len(outbox) == 1 or size >= WRITE_BYTES_MAX:
                data = outbox.popleft()
            else:
                parts = [outbox.popleft()]
                while outbox and size + len(outbox[0]) <= WRITE_BYTES_MAX:
                    size += len(outbox[0])
                    parts.append(outbox.popleft())
                data = b"".join(parts)
            self._outbox_bytes -= len(data)
            self._writer.write(data)
        if outbox and self._writing is None:
            self._writing = self._loop.create_task(
                self._write_as_drained(), name=f"northguard-conn-writer-{self.address}"
            )

    async def _write_as_drained(self) -> None:
        try:
            while self._outbox and self.failure is None:
                await self._writer.drain()
                left = len(self._outbox)
                self._write_outbox()
                if len(self._outbox) == left:  # drained, yet not below the mark: never spin
                    await asyncio.sleep(0)
        except ConnectionError as error:
            self._fail(BackendUnavailable(f"connection to {self.address} lost: {error}"))
        finally:
            self._writing = None

    @property
    def write_buffer_full(self) -> bool:
        buffered = self._writer.transport.get_write_buffer_size() + self._outbox_bytes
        return buffered > WRITE_BUFFER_BYTES_MAX

    async def drain(self) -> None:
        if self.failure is not None:
            raise self.failure
        try:
            self._write_outbox()
            while self._outbox and self.failure is None:
                await self._writer.drain()
                self._write_outbox()
            await self._writer.drain()
        except ConnectionError as error:
            self._fail(BackendUnavailable(f"connection to {self.address} lost: {error}"))
            raise self.failure from error  # type: ignore[misc]

    # -- reading ---------------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        failure: XinfraError
        try:
            while True:
                frames = await self._reader.frames()
                if not frames:
                    failure = BackendUnavailable(
                        f"Northguard broker {self.address} closed the connection"
                        + self._unanswered_hint()
                    )
                    break
                for item in frames:
                    self._dispatch(item)
        except asyncio.CancelledError:
            failure = BackendUnavailable(f"connection to Northguard broker {self.address} closed")
        except ProtocolError as error:
            failure = error
        except (OSError, asyncio.IncompleteReadError) as error:
            failure = BackendUnavailable(
                f"connection to Northguard broker {self.address} lost: {error}"
                + self._unanswered_hint()
            )
        except XinfraError as error:  # a connection-level ERROR from the broker
            failure = error
        self._fail(failure)

    def _unanswered_hint(self) -> str:
        """Why a plaintext connection may end before its first answer: the broker wants TLS."""
        if self._reader.received_any or self.encrypted:
            return ""
        return f" before answering ({tls.PLAINTEXT_HINT})"

    def _dispatch(self, item: protocol.Frame) -> None:
        kind, body = item
        if kind is _ACK:
            streams = self._streams
            for stream_id, first_seq, offsets, window_bytes in protocol.decode_acks(body):
                handler = streams.get(stream_id)
                if handler is not None:
                    handler.on_ack(first_seq, offsets, window_bytes)
        elif kind in _STREAM_FRAMES:
            if len(body) < 4:
                raise ProtocolError(f"{kind.name} shorter than its stream id")
            (stream_id,) = _STREAM_ID.unpack_from(body)
            handler = self._streams.get(stream_id)
            if handler is not None:
                handler.on_frame(kind, body)
        elif kind is MsgType.RESPONSE:
            correlation, payload = protocol.decode_json(body)
            future = self._pending.get(correlation)
            if future is not None and not future.done():
                future.set_result(payload)
        elif kind is MsgType.ERROR:
            _, payload = protocol.decode_json(body)
            raise error_of(payload)
        else:
            raise ProtocolError(f"a broker does not send {kind.name} messages")

    def _fail(self, failure: XinfraError) -> None:
        if self.failure is not None:
            return
        self.failure = failure
        self._outbox.clear()
        self._outbox_bytes = 0
        if self._write_due is not None:
            self._write_due.cancel()
            self._write_due = None
        hooks, self._hooks = self._hooks, []
        for hook in hooks:
            self._loop.call_soon(hook)
        for future in self._pending.values():
            if not future.done():
                future.set_exception(failure)
        streams, self._streams = self._streams, {}
        for handler in streams.values():
            handler.on_failure(failure)
        with contextlib.suppress(Exception):
            self._writer.close()

    async def close(self) -> None:
        """Close the socket and fail whatever is pending.  Idempotent.

        Bounded: frames already sent (a stream's close) get ``CLOSE_FLUSH_S`` to leave; a peer
        that does not read them by then has the connection aborted (``close_writer``)."""
        self._write_outbox(everything=True)
        self._fail(BackendUnavailable(f"connection to Northguard broker {self.address} closed"))
        for task in (self._task, self._writing):
            if task is None:
                continue
            if not task.done():
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await close_writer(self._writer)
