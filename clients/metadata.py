"""Where the SDK gets topic metadata, and how it keeps it fresh.

``MetadataSource`` is what producers and consumers need from the metadata
service; ``clients.service`` implements it over HTTP.  ``TopicWatch`` keeps the
latest ``TopicMetadata`` of one topic current by long-polling, and keeps the
last good copy when the service is down: data that can still flow keeps
flowing, and the watch retries with capped exponential backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from xinfra.errors import XinfraError
from xinfra.model import TopicMetadata

log = logging.getLogger(__name__)

BACKOFF_S_MIN = 0.1
BACKOFF_S_MAX = 5.0


class MetadataSource(Protocol):
    async def topic_metadata(self, topic: str) -> TopicMetadata:
        """The current metadata; raises ``TopicNotFound``, ``Unauthenticated``, ``Unavailable``."""
        ...

    async def wait_for_change(
        self, topic: str, after_version: int, timeout_s: float
    ) -> TopicMetadata | None:
        """Long-poll: metadata newer than ``after_version``, or None after ``timeout_s``."""
        ...

    async def acknowledge(self, topic: str, version: int) -> None:
        """Tell the service this client now runs on ``version`` of the topic."""
        ...

    async def close(self) -> None:
        """Unregister and release connections."""
        ...


class TopicWatch:
    """The freshest metadata of one topic, kept current by a long-poll task this object owns.

    A new version is acknowledged to the service only after ``settle`` returns:
    a producer settles when no write it started under an older version is
    still in flight, so once every producer has acknowledged version V the
    service knows nothing more lands in an epoch that V retired.
    """

    def __init__(
        self,
        source: MetadataSource,
        metadata: TopicMetadata,
        settle: Callable[[TopicMetadata], Awaitable[None]] | None = None,
        long_poll_s: float = 20.0,
    ) -> None:
        self.source = source
        self.current = metadata
        self._settle = settle
        self._long_poll_s = long_poll_s
        self._task: asyncio.Task[None] | None = None
        self.changed = asyncio.Event()

    @property
    def topic(self) -> str:
        return self.current.topic.name

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name=f"watch:{self.topic}"
            )

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def apply(self, metadata: TopicMetadata) -> None:
        """Adopt a newer version (older or equal ones are ignored: versions only grow)."""
        if metadata.version <= self.current.version:
            return
        self.current = metadata
        self.changed.set()
        self.changed = asyncio.Event()

    async def _run(self) -> None:
        backoff_s = BACKOFF_S_MIN
        while True:
            try:
                newer = await self.source.wait_for_change(
                    self.topic, self.current.version, self._long_poll_s
                )
                if newer is not None and newer.version > self.current.version:
                    self.apply(newer)
                    if self._settle is not None:
                        await self._settle(newer)
                    await self.source.acknowledge(self.topic, newer.version)
                backoff_s = BACKOFF_S_MIN
            except XinfraError as error:
                # Keep the last metadata: producing and consuming go on while the service is away.
                log.warning(
                    "metadata watch on %s: %s; retrying in %.1f s", self.topic, error, backoff_s
                )
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, BACKOFF_S_MAX)
