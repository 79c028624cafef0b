"""The reading side of a Northguard connection: frames decoded as the socket delivers bytes.

asyncio's ``StreamReader`` copies every byte it is fed into its buffer, and
``read()`` copies it out twice (a bytearray slice, then ``bytes``) and moves
what is left to the front; the frame decoder then copied the bytes into its
own buffer and each frame out of it.  Measured on a broker taking 100-byte
records from one producer (cProfile, ``bench/northguard_scale.py``'s
workload): those copies were the largest single cost of its event loop,
more than every append's own work at 1 range, and at 512 ranges, where the
broker lags and its buffer fills, each ``read()`` moved a megabyte.

``FrameReader`` is the ``StreamReader`` a ``StreamReaderProtocol`` feeds
(so ``StreamWriter``, TLS and ``drain`` work unchanged), but what it is fed
goes straight through a ``FrameDecoder``: each frame's body is copied once,
out of the bytes the socket delivered.  Flow control is ``StreamReader``'s:
the transport is paused while more than twice ``limit`` bytes of decoded
frames wait for ``frames()``, and resumed when they are taken.

A malformed frame fails the reader with the decoder's ``ProtocolError``,
raised by ``frames()`` once the frames of earlier reads are taken (those of
the read that held it go with it, as with the decoder alone: the owner
closes the connection, and none of them was answered).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import SupportsIndex

from backends.northguard.protocol import Frame, FrameDecoder
from xinfra.errors import ProtocolError


class FrameReader(asyncio.StreamReader):
    def __init__(self, frame_bytes_max: int, limit: int) -> None:
        super().__init__(limit=limit)
        self._pause_bytes = 2 * limit
        self._decoder = FrameDecoder(frame_bytes_max)
        self._ready: list[Frame] = []
        self._ready_bytes = 0
        # Apart from the base's exception(): a malformed frame fails frames(), not the writer's
        # drain() (which raises the reader's exception), the connection's loss fails both.
        self._failure: BaseException | None = None
        self._frames_waiter: asyncio.Future[None] | None = None
        self._frames_transport: asyncio.BaseTransport | None = None
        self._reading_paused = False
        self.received_any = False
        """Whether the peer sent any byte yet (a TLS broker closes a plaintext peer at once)."""

    def set_transport(self, transport: asyncio.BaseTransport) -> None:
        super().set_transport(transport)
        self._frames_transport = transport

    def feed_data(self, data: Iterable[SupportsIndex]) -> None:
        """What the protocol received (``bytes``, from a transport): decoded now."""
        chunk = data if isinstance(data, bytes) else bytes(data)
        if not chunk or self._failure is not None:
            return
        self.received_any = True
        try:
            frames = self._decoder.feed(chunk)
        except ProtocolError as error:  # raised by frames() once the frames ready are taken
            self._failure = error
            frames = []
        if frames:
            self._ready += frames
            self._ready_bytes += sum(len(frame.body) for frame in frames)
        self._wake()
        transport = self._frames_transport
        if (
            transport is not None
            and not self._reading_paused
            and self._ready_bytes > self._pause_bytes
            and isinstance(transport, asyncio.ReadTransport)
        ):
            try:
                transport.pause_reading()
            except NotImplementedError:  # a transport that cannot pause: buffer instead
                self._frames_transport = None
            else:
                self._reading_paused = True

    def feed_eof(self) -> None:
        super().feed_eof()
        self._wake()

    def set_exception(self, exc: Exception) -> None:
        super().set_exception(exc)
        if self._failure is None:
            self._failure = exc
        self._wake()

    def _wake(self) -> None:
        waiter = self._frames_waiter
        if waiter is not None:
            self._frames_waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def frames(self) -> list[Frame]:
        """The frames decoded since the last call, waiting for one; ``[]`` at the end of the
        stream; raises the decoder's ``ProtocolError`` or the connection's error after the frames
        that came before it."""
        while not self._ready:
            if self._failure is not None:
                raise self._failure
            if self.at_eof():  # the base's buffer stays empty: what is fed goes to the decoder
                return []
            assert self._frames_waiter is None, "frames() is awaited by one task at a time"
            self._frames_waiter = asyncio.get_running_loop().create_future()
            try:
                await self._frames_waiter
            finally:
                self._frames_waiter = None
        frames, self._ready = self._ready, []
        self._ready_bytes = 0
        if self._reading_paused:
            self._reading_paused = False
            transport = self._frames_transport
            if isinstance(transport, asyncio.ReadTransport):
                transport.resume_reading()
        return frames
