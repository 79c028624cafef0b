"""The coalescing buffer: many commits become one batched upsert, acknowledged after it lands.

Commits accumulate in a dict keyed by checkpoint key (the last write per key
wins); one flush writes them all.  Every commit in a batch waits for that
batch's flush and fails with it: a commit is acknowledged only once it is
durable.  When a batch flies is group commit, as databases do it: at once when
no flight is out (a lone commit waits for its write, not for a timer too);
while one is, the batch grows until a flight lands, ``keys_max`` keys wait or
``interval_s`` has passed.  So batches are as large as the write's latency
makes them: under load the flights follow each other, each carrying what came
while the one before was out.  (A fixed ``interval_s`` wait before every flush
left a closed-loop committer idle for it on every commit: the service idled a
quarter of the time under ``bench/groups.py``.)

Flushes are pipelined: up to ``flights_max`` run at once, and the next batch
fills while they do, so the event loop parses requests while MySQL writes.
Per-key order still holds: a flush that shares a key with an earlier flush in
flight starts its upsert only once that one has finished, so an older value
never lands after a newer one (committers that wait for their acknowledgement,
as consumers do, never share a key between flights, and never wait).

Bounds: at most ``keys_max`` keys wait and ``flights_max`` batches are in
flight; a commit that finds the buffer full waits for the flush that empties
it (back-pressure), never grows it.

``offer`` is ``put`` for a caller that cannot wait (the hot commit route of
``metadata_service.hot_routes``): the flush's future, or None when there is
no room now, and the caller takes the waiting path.

"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping
from typing import Generic, TypeVar

from xinfra.errors import Unavailable

K = TypeVar("K")


class CoalescingBuffer(Generic[K]):
    def __init__(
        self,
        flush: Callable[[dict[K, int]], Awaitable[None]],
        interval_s: float = 0.005,
        keys_max: int = 10_000,
        flights_max: int = 4,
    ) -> None:
        assert interval_s > 0 and keys_max > 0 and flights_max > 0
        self._flush = flush
        self.interval_s = interval_s
        self.keys_max = keys_max
        self._pending: dict[K, int] = {}
        self._done: asyncio.Future[None] | None = None
        self._ready = asyncio.Event()
        self._wake = asyncio.Event()
        """Set when the batch is full or a flight lands: time to take what waits."""
        self._slots = asyncio.Semaphore(flights_max)
        self._flights: dict[asyncio.Task[None], dict[K, int]] = {}
        self._task: asyncio.Task[None] | None = None
        self.commits = 0
        self.flushes = 0

    @property
    def in_flight(self) -> int:
        """Batches taken and not yet acknowledged (waiting for an earlier flight, or writing)."""
        return len(self._flights)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="checkpoint-flush")

    async def put(self, values: Mapping[K, int]) -> None:
        """Return once ``values`` are flushed; raise what the flush raised."""
        assert len(values) <= self.keys_max, "a single commit larger than the buffer"
        if self._task is None or self._task.done():
            raise RuntimeError("the checkpoint buffer is not running")
        while len(self._pending) + len(values) > self.keys_max and self._done is not None:
            await asyncio.shield(self._done)  # back-pressure: wait for the flush that empties it
        await asyncio.shield(self._add(values))

    def offer(self, values: Mapping[K, int]) -> asyncio.Future[None] | None:
        """``put`` without waiting: the future of the flush that will hold ``values`` (its result
        or exception is the commit's), or None when the buffer has no room for them now or is
        not running (``put`` waits for room, or raises)."""
        assert len(values) <= self.keys_max, "a single commit larger than the buffer"
        if self._task is None or self._task.done():
            return None
        if len(self._pending) + len(values) > self.keys_max:
            return None
        return self._add(values)

    def _add(self, values: Mapping[K, int]) -> asyncio.Future[None]:
        if self._done is None:
            self._done = asyncio.get_running_loop().create_future()
        done = self._done
        self._pending.update(values)
        self.commits += 1
        self._ready.set()
        if len(self._pending) >= self.keys_max:
            self._wake.set()
        return done

    async def _run(self) -> None:
        while True:
            await self._ready.wait()
            if self._flights:  # the batch grows while one flies, for at most the interval
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.interval_s)
            await self._slots.acquire()
            if not self._take():
                self._slots.release()

    def _take(self) -> bool:
        """Start a flight for what waits; False when nothing did."""
        batch, done = self._pending, self._done
        self._pending, self._done = {}, None
        self._ready.clear()
        self._wake.clear()
        if done is None:
            return False
        earlier = [t for t, keys in self._flights.items() if not keys.keys().isdisjoint(batch)]
        flight = asyncio.get_running_loop().create_task(
            self._fly(batch, done, earlier), name="checkpoint-flight"
        )
        self._flights[flight] = batch
        return True

    async def _fly(
        self, batch: dict[K, int], done: asyncio.Future[None], earlier: list[asyncio.Task[None]]
    ) -> None:
        try:
            if earlier:  # the same keys, older values: they land first, whatever their outcome
                await asyncio.wait(earlier)
            await self._flush(batch)
        except asyncio.CancelledError:
            done.set_exception(Unavailable("the service stopped before the commit was written"))
            done.exception()
            raise
        except Exception as error:
            done.set_exception(error)
            done.exception()  # retrieved: every waiter re-raises it, none may be left
        else:
            done.set_result(None)
            self.flushes += 1
        finally:
            current = asyncio.current_task()
            assert current is not None
            self._flights.pop(current, None)
            self._slots.release()
            self._wake.set()

    async def stop(self) -> None:
        """Flush what waits, then stop; commits after this fail."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._slots.acquire()
        if not self._take():
            self._slots.release()
        if self._flights:
            await asyncio.wait(list(self._flights))
