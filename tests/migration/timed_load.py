"""Keyed load that also times every send, by the migration step it was sent in.

``TimedStream`` is the epoch tests' ``Stream`` (keyed records without pause,
what was acknowledged where) plus, for each record, how long its ``send`` waited
for the acknowledgement: from the call to ``send`` (which may wait for buffer
room) to the future resolving.  The test names the step under way
(``stream.step = "cut_over"``) before it asks for it, and each record counts
against the step it was sent in, so ``stall_s_max()`` is the longest wait of any
send per step, compared with ``migration.machine.producer_stall_s_max``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from sdk_live import VC, keyed_value
from test_sdk_epochs import KEYS, Stream

from clients import Positions, XinfraProducerOptions, open_producer
from xinfra.model import Position, Record


class TimedStream(Stream):  # type: ignore[misc]
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.step = "before"
        self.waits_s: dict[str, list[float]] = {}

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        seq = 0
        while not self._stop.is_set():
            key = seq % KEYS
            value = keyed_value(key, seq)
            sent_s, step = loop.time(), self.step
            future = await self.producer.send(self.topic, value, key=b"%d" % key)
            future.add_done_callback(lambda f, v=value, t=sent_s, s=step: self._timed(v, f, t, s))
            seq += 1
            self.sent = seq
            if seq % 20 == 0:
                await asyncio.sleep(0.002)  # pacing of the load generator, not synchronisation

    def _timed(
        self, value: bytes, future: asyncio.Future[Position], sent_s: float, step: str
    ) -> None:
        self.waits_s.setdefault(step, []).append(asyncio.get_running_loop().time() - sent_s)
        self._done(value, future)

    def stall_s_max(self) -> dict[str, float]:
        """The longest send-to-acknowledgement wait of the records sent in each step."""
        return {step: max(waits) for step, waits in self.waits_s.items()}


class TimedBatchStream(TimedStream):
    """``TimedStream`` sending ``BATCH`` keyed records per ``send_batch`` call: a topic with one
    write epoch takes them straight to the backend, many writes in flight, and dual writes
    through the shard queues, so every step of a migration crosses between the two paths."""

    BATCH = 20

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        seq = 0
        while not self._stop.is_set():
            records = [
                Record(keyed_value(i % KEYS, i), b"%d" % (i % KEYS))
                for i in range(seq, seq + self.BATCH)
            ]
            sent_s, step = loop.time(), self.step
            future = await self.producer.send_batch(self.topic, records)
            future.add_done_callback(
                lambda f, r=records, t=sent_s, s=step: self._timed_batch(r, f, t, s)  # type: ignore[misc]
            )
            seq += self.BATCH
            self.sent = seq
            await asyncio.sleep(0.002)  # pacing of the load generator, not synchronisation

    def _timed_batch(
        self, records: list[Record], future: asyncio.Future[Positions], sent_s: float, step: str
    ) -> None:
        self.waits_s.setdefault(step, []).append(asyncio.get_running_loop().time() - sent_s)
        if future.exception() is not None:
            self.failed.append(future.exception())  # type: ignore[arg-type]
            return
        for record, position in zip(records, future.result(), strict=True):
            assert record.value is not None
            self.acked[record.value] = position


@contextlib.asynccontextmanager
async def load(live: Any, topic: str, stream_type: type[Stream] = Stream) -> AsyncIterator[Any]:
    """Keyed records sent to ``topic`` without pause while the block runs, by a client token's
    producer; on exit every record sent was acknowledged and none failed."""
    token = await live.client_token(f"writer-{topic}")
    producer = await open_producer(
        live.url, token, VC, XinfraProducerOptions(linger_ms=2), topics=[topic], lease_s=6
    )
    stream = stream_type(producer, topic)
    stream.start()
    try:
        yield stream
        await stream.stop()
    finally:
        with contextlib.suppress(Exception):
            await stream.stop()
        await producer.close()
    assert not stream.failed, f"{len(stream.failed)} records failed, e.g. {stream.failed[:3]}"
    assert len(stream.acked) == stream.sent


def timed_load(
    live: Any, topic: str, stream_type: type[TimedStream] = TimedStream
) -> contextlib.AbstractAsyncContextManager[TimedStream]:
    """``load`` with a ``TimedStream``: every send timed by the step it was sent in."""
    return load(live, topic, stream_type)
