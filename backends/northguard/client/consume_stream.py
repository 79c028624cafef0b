"""The client end of a consume stream: Pushes in (bounded by the window), Reads out.

Pushed entries wait in ``entries`` until the owner takes them; the broker
never pushes more than the window beyond what the owner reported consumed,
so the buffer is bounded by the window (plus at most one entry).  The owner
calls ``consumed`` as it takes entries; a Read is sent once a quarter of
the window has been consumed, so the broker keeps pushing without a round
trip per entry.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from backends.northguard import protocol
from backends.northguard.client.connection import ClientConnection, error_of
from backends.northguard.protocol import MsgType
from xinfra.errors import ProtocolError, XinfraError


class ConsumeStream:
    def __init__(
        self,
        connection: ClientConnection,
        topic: str,
        range_id: int,
        offset: int,
        window_bytes: int,
        on_data: Callable[[], None],
        segment_id: str | None = None,
    ) -> None:
        self._connection = connection
        self.topic = topic
        self.range_id = range_id
        self.offset = offset
        self.window_bytes = window_bytes
        self._on_data = on_data
        self.entries: deque[tuple[int, bytes]] = deque()
        self.failure: XinfraError | None = None
        self._consumed = 0
        self._reported = 0
        self.stream_id = connection.open_stream(self)
        payload: dict[str, object] = {
            "topic": topic,
            "range_id": range_id,
            "offset": offset,
            "window_bytes": window_bytes,
        }
        if segment_id is not None:  # one sealed segment of any replica (re-replication)
            payload["segment_id"] = segment_id
        connection.send(protocol.encode_json(MsgType.CONSUME_OPEN, self.stream_id, payload))

    def on_ack(self, first_seq: int, offsets: tuple[int, ...], window_bytes: int) -> None:
        self.on_failure(ProtocolError("unexpected ACK on a consume stream"))

    def on_frame(self, kind: MsgType, body: bytes) -> None:
        if kind is MsgType.PUSH:
            _, entries = protocol.decode_push(body)
            self.entries.extend(entries)
            self._on_data()
        elif kind is MsgType.CONSUME_OPENED:
            pass
        elif kind is MsgType.STREAM_ERROR:
            _, payload = protocol.decode_json(body)
            self._connection.forget_stream(self.stream_id)
            self.on_failure(error_of(payload))
        else:
            self.on_failure(ProtocolError(f"unexpected {kind.name} on a consume stream"))

    def on_failure(self, error: XinfraError) -> None:
        if self.failure is None:
            self.failure = error
            self._on_data()

    def consumed(self, size: int) -> None:
        """The owner took ``size`` bytes of entries: move the window when worth a frame."""
        self._consumed += size
        if self._consumed - self._reported >= self.window_bytes // 4 and self.failure is None:
            self._reported = self._consumed
            try:
                self._connection.send(
                    protocol.encode_read(self.stream_id, self._consumed, self.window_bytes)
                )
            except XinfraError as error:
                self.on_failure(error)

    def close(self) -> None:
        if self.failure is None and not self._connection.closed:
            self._connection.send(protocol.encode_stream_close(self.stream_id))
        self._connection.forget_stream(self.stream_id)
        self.failure = self.failure or XinfraError("consume stream closed")
        self.entries.clear()
