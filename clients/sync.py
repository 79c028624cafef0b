"""Blocking flavours of the SDK for code without an event loop.

Each sync client owns one event-loop thread and runs its asyncio client there;
calls cross with ``run_coroutine_threadsafe``.  The asyncio clients stay the one
implementation: the sync ones add no logic, only the thread hop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

from clients.consumer import StartAt, XinfraConsumer, XinfraRecord
from clients.producer import XinfraProducer
from xinfra.model import Header, Position

T = TypeVar("T")


class LoopThread:
    """An event loop running in a daemon thread until ``stop``."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def run(self, coroutine: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        return self.submit(coroutine).result(timeout_s)

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
        if not self.loop.is_running():
            self.loop.close()


class SyncProducer:
    """``XinfraProducer`` for blocking code: ``send`` returns a ``concurrent.futures.Future``.

    Thread safe: any thread may call ``send``; records one thread sends to one
    shard keep their order.  ``build`` runs on the producer's own loop, e.g.
    ``SyncProducer(lambda: open_producer(url, token, vc))``.
    """

    def __init__(self, build: Callable[[], Awaitable[XinfraProducer]]) -> None:
        self._thread = LoopThread("xinfra-producer")
        try:
            self._producer = self._thread.run(_await(build))
        except BaseException:
            self._thread.stop()
            raise

    def send(
        self,
        topic: str,
        value: bytes | None,
        *,
        key: bytes | None = None,
        headers: Sequence[Header] = (),
        timestamp_ms: int | None = None,
        shard: int | None = None,
    ) -> concurrent.futures.Future[Position]:
        """Queue a record; errors ``XinfraProducer.send`` raises at once come through the future."""

        async def queue() -> Position:
            future = await self._producer.send(
                topic, value, key=key, headers=headers, timestamp_ms=timestamp_ms, shard=shard
            )
            return await future

        return self._thread.submit(queue())

    def produce(
        self,
        topic: str,
        value: bytes | None,
        *,
        key: bytes | None = None,
        shard: int | None = None,
        timeout_s: float | None = None,
    ) -> Position:
        """Send one record and wait for its position."""
        return self.send(topic, value, key=key, shard=shard).result(timeout_s)

    def flush(self) -> None:
        self._thread.run(self._producer.flush())

    def close(self) -> None:
        try:
            self._thread.run(self._producer.close())
        finally:
            self._thread.stop()

    def __enter__(self) -> SyncProducer:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


class SyncConsumer:
    """``XinfraConsumer`` for blocking code; one thread at a time should drive it."""

    def __init__(self, build: Callable[[], Awaitable[XinfraConsumer]]) -> None:
        self._thread = LoopThread("xinfra-consumer")
        try:
            self._consumer = self._thread.run(_await(build))
        except BaseException:
            self._thread.stop()
            raise

    def assign(
        self, topic: str, shards: Sequence[int] | None = None, start: StartAt | int = "earliest"
    ) -> None:
        self._thread.run(self._consumer.assign(topic, shards, start))

    def seek(self, topic: str, position: Position, delivered: Position | None = None) -> None:
        self._thread.run(_call(lambda: self._consumer.seek(topic, position, delivered)))

    def seek_to_beginning(self, topic: str, shards: Sequence[int] | None = None) -> None:
        self._thread.run(self._consumer.seek_to_beginning(topic, shards))

    def seek_to_end(self, topic: str, shards: Sequence[int] | None = None) -> None:
        self._thread.run(self._consumer.seek_to_end(topic, shards))

    def seek_to_timestamp(
        self, topic: str, timestamp_ms: int, shards: Sequence[int] | None = None
    ) -> None:
        self._thread.run(self._consumer.seek_to_timestamp(topic, timestamp_ms, shards))

    def pause(self, topic: str, shards: Sequence[int]) -> None:
        self._thread.run(_call(lambda: self._consumer.pause(topic, shards)))

    def resume(self, topic: str, shards: Sequence[int]) -> None:
        self._thread.run(_call(lambda: self._consumer.resume(topic, shards)))

    def poll(self, max_records: int = 1000, timeout_s: float = 1.0) -> list[XinfraRecord]:
        return self._thread.run(self._consumer.poll(max_records, timeout_s))

    def positions(self) -> dict[tuple[str, int], Position]:
        return self._thread.run(_call(self._consumer.positions))

    def crossings(self) -> dict[tuple[str, int], Position]:
        return self._thread.run(_call(self._consumer.crossings))

    def commit(
        self, positions: dict[tuple[str, int], Position] | None = None
    ) -> dict[tuple[str, int], Position]:
        return self._thread.run(self._consumer.commit(positions))

    def close(self) -> None:
        try:
            self._thread.run(self._consumer.close())
        finally:
            self._thread.stop()

    def __enter__(self) -> SyncConsumer:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


async def _await(build: Callable[[], Awaitable[T]]) -> T:
    return await build()


async def _call(function: Callable[[], T]) -> T:
    return function()
