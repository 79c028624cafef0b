"""The client end of a produce stream: Appends out while under the window, Acks in.

The stream knows nothing of records: it sends encoded batches with sequence
numbers and reports acknowledged ``(seq, base_offset)`` pairs and failures
to its owner (``on_acks``, ``on_failure``).  Retrying on another stream
(after a reconnection or a segment roll) is the owner's decision; the
sequence numbers let the broker drop what it already has.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from backends.northguard import protocol
from backends.northguard.client.connection import ClientConnection, error_of
from backends.northguard.protocol import MsgType
from xinfra.errors import ProtocolError, XinfraError

PRODUCE_WINDOW_BYTES = 16 << 20
"""The window a producer asks for; the broker may grant less."""


class ProduceStream:
    def __init__(
        self,
        connection: ClientConnection,
        topic: str,
        range_id: int,
        producer_id: int,
        on_acks: Callable[[int, tuple[int, ...]], None],
        on_failure: Callable[[XinfraError], None],
        window_bytes: int = PRODUCE_WINDOW_BYTES,
    ) -> None:
        self.connection = connection
        self.topic = topic
        self.range_id = range_id
        self.producer_id = producer_id
        self._on_acks = on_acks
        self._on_failure = on_failure
        self.window_bytes = window_bytes
        self.inflight_bytes = 0
        self._sizes: dict[int, int] = {}
        self.opened: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.failure: XinfraError | None = None
        self.stream_id = connection.open_stream(self)
        connection.send(
            protocol.encode_json(
                MsgType.PRODUCE_OPEN,
                self.stream_id,
                {
                    "topic": topic,
                    "range_id": range_id,
                    "producer_id": producer_id,
                    "window_bytes": window_bytes,
                },
            )
        )

    def has_room(self, size: int) -> bool:
        """One batch may go behind the open, before its answer (the broker takes one batch
        past any window when nothing is pending); more wait for the window it grants."""
        if self.inflight_bytes == 0:
            return True
        return self.opened.done() and self.inflight_bytes + size <= self.window_bytes

    def append(self, seq: int, batch: bytes) -> None:
        self._sizes[seq] = len(batch)
        self.inflight_bytes += len(batch)
        self.connection.send(protocol.encode_append(self.stream_id, seq, batch))

    def on_ack(self, first_seq: int, offsets: tuple[int, ...], window_bytes: int) -> None:
        sizes = self._sizes
        for seq in range(first_seq, first_seq + len(offsets)):
            self.inflight_bytes -= sizes.pop(seq, 0)
        self.window_bytes = window_bytes
        self._on_acks(first_seq, offsets)

    def on_frame(self, kind: MsgType, body: bytes) -> None:
        if kind is MsgType.PRODUCE_OPENED:
            _, payload = protocol.decode_json(body)
            self.window_bytes = int(payload["window_bytes"])
            if not self.opened.done():
                self.opened.set_result(None)
        elif kind is MsgType.STREAM_ERROR:
            _, payload = protocol.decode_json(body)
            self.connection.forget_stream(self.stream_id)
            self.on_failure(error_of(payload))
        else:
            self.on_failure(ProtocolError(f"unexpected {kind.name} on a produce stream"))

    def on_failure(self, error: XinfraError) -> None:
        if self.failure is not None:
            return
        self.failure = error
        if not self.opened.done():
            self.opened.set_exception(error)
            self.opened.exception()  # retrieved: the owner learns through on_failure
        self._on_failure(error)

    def close(self) -> None:
        if self.failure is None and not self.connection.closed:
            self.connection.send(protocol.encode_stream_close(self.stream_id))
        self.connection.forget_stream(self.stream_id)
        self.failure = self.failure or XinfraError("produce stream closed")
