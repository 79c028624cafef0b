"""Topic-metadata cache misses, coalesced: one store query per batch of topics.

Why: a store call is a thread hop plus a MySQL round trip (about 0.25 ms
here), and under load the worker threads convoy on the GIL with the event
loop, each waiting up to the 5 ms switch interval to get back from a socket
read: one thread per miss served a few hundred misses a second.  Here one
batch is in flight at a time, on one worker thread; misses arriving meanwhile
queue for the next batch, so the batch grows with the load (at most
``batch_topics_max`` topics per query) and the round trips do not.

Freshness: a miss joins only a batch that has not started, so its read starts
after the miss arrived and sees every change committed before it.  Misses of
the same topic queued together share one read.
"""

from __future__ import annotations

import asyncio
import itertools

from metadata_service.notify import TopicKey
from metadata_service.runtime import Runtime
from xinfra.model import TopicMetadata

BATCH_TOPICS_MAX = 64
"""Topics per store query (the IN list of one round trip)."""


class MetadataReader:
    """Reads TopicMetadata from the store in batches.  Event-loop only."""

    def __init__(self, runtime: Runtime, batch_topics_max: int = BATCH_TOPICS_MAX) -> None:
        self.rt = runtime
        self.batch_topics_max = batch_topics_max
        self._queued: dict[TopicKey, asyncio.Future[TopicMetadata | None]] = {}
        self._draining: asyncio.Task[None] | None = None

    async def read(self, key: TopicKey) -> TopicMetadata | None:
        """The topic's client view, None when it is not visible; store errors are raised."""
        future = self._queued.get(key)
        if future is None:
            future = asyncio.get_running_loop().create_future()
            self._queued[key] = future
            if self._draining is None or self._draining.done():
                self._draining = asyncio.create_task(self._drain(), name="metadata-reader")
        # Shielded: one caller giving up must not cancel the read the others wait for.
        return await asyncio.shield(future)

    async def _drain(self) -> None:
        """Run batches until nothing is queued; every future gets its result or the error."""
        while self._queued:
            keys = list(itertools.islice(self._queued, self.batch_topics_max))
            batch = {key: self._queued.pop(key) for key in keys}
            try:
                found = await self.rt.db(self.rt.store.read_metadata_many, keys)
            except Exception as error:
                for future in batch.values():
                    future.set_exception(error)
                    future.exception()  # retrieved here: a caller that gave up leaves no warning
                continue
            for key, future in batch.items():
                future.set_result(found[key])
