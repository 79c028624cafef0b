"""Where the SDK gets topic metadata, and how it keeps it fresh.

``MetadataSource`` is what producers and consumers need from the metadata
service; ``clients.service`` implements it over HTTP.  ``TopicWatch`` keeps the
latest ``TopicMetadata`` of one topic current by long-polling, and keeps the
last good copy when the service is down: data that can still flow keeps
flowing, and the watch retries with ``xinfra.backoff``'s delays (the rule every client
follows).

Errors the service gives that no retry will cure (a revoked token, a token
scoped elsewhere, a deleted topic) are kept on the watch as ``error``; the
producer and the consumer raise them on their next call, so the application
learns of them instead of a log line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from xinfra.backoff import backoff_s
from xinfra.errors import Forbidden, NotFound, Unauthenticated, Unavailable, XinfraError
from xinfra.model import TopicMetadata

log = logging.getLogger(__name__)

FATAL_ERRORS: tuple[type[XinfraError], ...] = (Unauthenticated, Forbidden, NotFound)
"""Service answers that mean the client must stop using the topic, not retry."""
FATAL_FAILURES = 8
"""A fatal answer counts as this many failures in a row: the watch asks again at the longest
backoff (a revoked token may be restored; nothing to gain from asking often)."""


class MetadataSource(Protocol):
    async def connect(self, timeout_s: float) -> None:
        """Check the service answers and accepts the token, retrying for up to ``timeout_s``.

        Raises ``Unauthenticated``, ``Forbidden``, ``NotFound`` (no such virtual
        cluster) at once, ``Unavailable`` once the time is up.
        """
        ...

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

    def check(self) -> None:
        """Raise the fatal error the service last gave (a revoked token), if any."""
        ...

    async def close(self) -> None:
        """Unregister and release connections."""
        ...


async def fetch_metadata(source: MetadataSource, topic: str, timeout_s: float) -> TopicMetadata:
    """First metadata of a topic, retrying an unreachable service with backoff up to ``timeout_s``.

    A client has nothing to run on before its first metadata, so unlike the
    watch this gives up: ``Unavailable`` after the time, and at once any
    non-retriable error (``TopicNotFound``, ``Unauthenticated``, ...).
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    failures = 0
    while True:
        try:
            return await source.topic_metadata(topic)
        except XinfraError as error:
            remaining_s = deadline - loop.time()
            if not error.retriable:
                raise
            if remaining_s <= 0:
                raise Unavailable(
                    f"no metadata for topic {topic!r} after {timeout_s:.1f} s: {error.message}; "
                    "check the metadata service URL (XINFRA_METADATA_URL) and that it runs"
                ) from error
            failures += 1
            await asyncio.sleep(min(backoff_s(failures), remaining_s))


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
        self.error: XinfraError | None = None
        """The last fatal answer of the service (revoked token, deleted topic); None when fine."""
        self._settle = settle
        self._long_poll_s = long_poll_s
        self._task: asyncio.Task[None] | None = None
        self.changed = asyncio.Event()
        self.listeners: list[Callable[[TopicMetadata], None]] = []
        """Called with every adopted metadata (the backend pool refreshes credentials by it)."""

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
        """Adopt a newer version (older ones are ignored: versions only grow).

        The same version with other clusters (a re-signed Northguard credential) is adopted
        silently: nothing a producer or consumer routes by changed, so nobody is woken.
        """
        if metadata.version == self.current.version and metadata.clusters != self.current.clusters:
            self.current = metadata
            for listener in self.listeners:
                listener(metadata)
            return
        if metadata.version <= self.current.version:
            return
        self.current = metadata
        for listener in self.listeners:
            listener(metadata)
        self.changed.set()
        self.changed = asyncio.Event()

    async def _run(self) -> None:
        failures = 0
        while True:
            try:
                newer = await self.source.wait_for_change(
                    self.topic, self.current.version, self._long_poll_s
                )
                self.error = None
                if newer is not None and newer.version == self.current.version:
                    self.apply(newer)  # the same topology, fresher credentials
                elif newer is not None and newer.version > self.current.version:
                    self.apply(newer)
                    if self._settle is not None:
                        await self._settle(newer)
                    await self.source.acknowledge(self.topic, newer.version)
                failures = 0
            except XinfraError as error:
                # Keep the last metadata: producing and consuming go on while the service is away.
                failures += 1
                if isinstance(error, FATAL_ERRORS):
                    self.error = error
                    failures = max(failures, FATAL_FAILURES)
                delay_s = backoff_s(failures)
                log.warning(
                    "metadata watch on %s: %s; retrying in %.1f s", self.topic, error, delay_s
                )
                await asyncio.sleep(delay_s)
