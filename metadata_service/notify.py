"""Topic-change notifications: wake long-polls and invalidate caches on every instance.

MySQL is the source of truth; a notification only says "topic T changed, re-read it".
With one instance (the embedded default) notifications stay in-process.  With
several, they travel through one ZooKeeper znode, ``<root>/changes``, whose
data is a JSON ring of the last ``RING_SIZE`` changes, each with a sequence
number.  A writer appends with a compare-and-set on the znode version; every
instance holds a data watch on it.  ZooKeeper watches are one-shot, so a
reader may see several new changes at once; the ring lets it apply each one,
and when it has missed more than the ring holds (a gap in sequence numbers)
or lost its ZooKeeper session, it invalidates everything and wakes every
waiter, which re-read MySQL.  A spurious wake-up costs one read; a missed one
is impossible.

Latency: a change reaches the other instances after one ZooKeeper write and one
watch event, a few milliseconds on a LAN, far below the 100 ms budget.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

from xinfra.errors import Backpressure

log = logging.getLogger(__name__)

TopicKey = tuple[str, str]
"""(virtual cluster, topic)."""

RING_SIZE = 128
CAS_ATTEMPTS_MAX = 50


class ChangeHub:
    """The in-process side: waiters per topic and invalidation listeners.  Event-loop only.

    ``generation`` increases on every invalidation; a reader that saw it change
    during a store read must not cache what it read (it may predate the change).
    """

    def __init__(self, waiters_max: int) -> None:
        self.waiters_max = waiters_max
        self.generation = 0
        self.stopping = False
        """The instance is shutting down: a long-poll answers with what it has, at once."""
        self._waiters: dict[TopicKey, set[asyncio.Future[None]]] = {}
        self._waiter_count = 0
        self._listeners: list[Callable[[TopicKey | None], None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def waiter_count(self) -> int:
        return self._waiter_count

    def add_listener(self, listener: Callable[[TopicKey | None], None]) -> None:
        self._listeners.append(listener)

    def changed(self, key: TopicKey | None) -> None:
        """Topic ``key`` changed (None: anything may have changed)."""
        self.generation += 1
        for listener in self._listeners:
            listener(key)
        if key is None:
            targets = [f for waiters in self._waiters.values() for f in waiters]
        else:
            targets = list(self._waiters.get(key, ()))
        for future in targets:
            if not future.done():
                future.set_result(None)

    def waiter(self, key: TopicKey) -> asyncio.Future[None]:
        """A future resolved at the next change of ``key``; release it with ``discard``."""
        if self._waiter_count >= self.waiters_max:
            raise Backpressure(
                f"{self._waiter_count} long-polls are waiting on this instance, the maximum; "
                "retry with backoff or poll without after_version"
            )
        self._loop = loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._waiters.setdefault(key, set()).add(future)
        self._waiter_count += 1
        return future

    def begin_shutdown(self) -> None:
        """Answer every long-poll now, and any later one at once.  Safe from a signal handler.

        Left waiting, they ran into uvicorn's graceful-shutdown timeout, which
        cancels each with a logged traceback and answers its client 500."""
        self.stopping = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake_all)

    def _wake_all(self) -> None:
        for future in [f for waiters in self._waiters.values() for f in waiters]:
            if not future.done():
                future.set_result(None)

    def discard(self, key: TopicKey, future: asyncio.Future[None]) -> None:
        waiters = self._waiters.get(key)
        if waiters is not None and future in waiters:
            waiters.remove(future)
            self._waiter_count -= 1
            if not waiters:
                del self._waiters[key]


class Notifier(Protocol):
    hub: ChangeHub

    async def start(self) -> None: ...

    async def publish(self, key: TopicKey | None, version: int) -> None: ...

    def healthy(self) -> bool: ...

    @property
    def cache_safe(self) -> bool:
        """False while changes from other instances could be missed (no cache then)."""
        ...

    async def stop(self) -> None: ...


class LocalNotifier:
    """One instance: a change is published to this process only."""

    def __init__(self, hub: ChangeHub) -> None:
        self.hub = hub

    async def start(self) -> None:
        return None

    async def publish(self, key: TopicKey | None, version: int) -> None:
        self.hub.changed(key)

    def healthy(self) -> bool:
        return True

    @property
    def cache_safe(self) -> bool:
        return True

    async def stop(self) -> None:
        return None


class ZooKeeperNotifier:
    """Several instances: changes travel through a watched ZooKeeper znode (see module docstring)."""

    def __init__(
        self,
        hub: ChangeHub,
        hosts: str,
        root: str,
        on_received: Callable[[int], None] | None = None,
        connect_timeout_s: float = 15.0,
    ) -> None:
        self.hub = hub
        self.hosts = hosts
        self.path = f"{root.rstrip('/')}/changes"
        self.connect_timeout_s = connect_timeout_s
        self._on_received = on_received or (lambda n: None)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: Any = None
        self._last_seq: int | None = None
        self._connected = threading.Event()
        self._lock = threading.Lock()

    async def start(self) -> None:
        from kazoo.client import KazooClient, KazooState

        self._loop = asyncio.get_running_loop()
        client = KazooClient(hosts=self.hosts, timeout=10.0)
        self._client = client

        def on_state(state: str) -> None:
            if state == KazooState.CONNECTED:
                self._connected.set()
                # Changes made while we were away may be missed: drop everything and re-read.
                self._deliver(None)
            else:
                self._connected.clear()
                self._deliver(None)

        client.add_listener(on_state)
        await asyncio.to_thread(client.start, self.connect_timeout_s)
        self._connected.set()
        await asyncio.to_thread(client.ensure_path, self.path)
        client.DataWatch(self.path)(self._on_data)

    def _deliver(self, key: TopicKey | None) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self.hub.changed, key)

    def _on_data(self, data: bytes | None, _stat: Any) -> None:
        """Kazoo thread: apply every change in the ring newer than the last one seen."""
        try:
            ring: dict[str, Any] = json.loads(data) if data else {"seq": 0, "changes": []}
        except ValueError:
            ring = {"seq": 0, "changes": []}
        seq = int(ring.get("seq", 0))
        changes = ring.get("changes", [])
        with self._lock:
            last = self._last_seq
            self._last_seq = seq
        if last is None or seq <= last:
            return  # the first read sets the baseline; nothing to wake
        fresh = [c for c in changes if c[0] > last]
        self._on_received(len(fresh))
        if not fresh or fresh[0][0] != last + 1 or any(c[1] is None for c in fresh):
            self._deliver(None)  # a gap: some changes fell out of the ring
            return
        for _seq, vc, topic, _version in fresh:
            self._deliver((vc, topic))

    def _write(self, key: TopicKey | None, version: int) -> None:
        from kazoo.exceptions import BadVersionError

        client = self._client
        for _attempt in range(CAS_ATTEMPTS_MAX):
            data, stat = client.get(self.path)
            try:
                ring: dict[str, Any] = json.loads(data) if data else {"seq": 0, "changes": []}
            except ValueError:
                ring = {"seq": 0, "changes": []}
            seq = int(ring.get("seq", 0)) + 1
            entry = [seq, key[0], key[1], version] if key else [seq, None, None, version]
            changes = [*ring.get("changes", [])[-(RING_SIZE - 1) :], entry]
            try:
                client.set(
                    self.path,
                    json.dumps({"seq": seq, "changes": changes}).encode(),
                    version=stat.version,
                )
                return
            except BadVersionError:
                continue
        # Heavy contention: publish a gap, which makes every instance re-read everything.
        data, _stat = client.get(self.path)
        seq = int(json.loads(data or b'{"seq": 0}').get("seq", 0)) + 2
        client.set(self.path, json.dumps({"seq": seq, "changes": []}).encode())

    async def publish(self, key: TopicKey | None, version: int) -> None:
        """Wake this instance at once, then the others through ZooKeeper.

        The store write has committed before this is called; a ZooKeeper failure
        here must not fail the request, so it is logged and the other
        instances catch up when their session is restored (they invalidate all).
        """
        self.hub.changed(key)
        try:
            await asyncio.to_thread(self._write, key, version)
        except Exception as error:  # the change is committed; only its notification failed
            log.warning("could not publish the change of %s to ZooKeeper: %s", key, error)

    def healthy(self) -> bool:
        return self._connected.is_set()

    @property
    def cache_safe(self) -> bool:
        return self._connected.is_set()

    async def stop(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await asyncio.to_thread(client.stop)
            await asyncio.to_thread(client.close)


class MetadataCache:
    """Serialized TopicMetadata per topic, bounded LRU, dropped on every change notification."""

    def __init__(self, hub: ChangeHub, entries_max: int) -> None:
        self.entries_max = entries_max
        self._entries: OrderedDict[TopicKey, tuple[int, bytes]] = OrderedDict()
        hub.add_listener(self.invalidate)

    def get(self, key: TopicKey) -> tuple[int, bytes] | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key: TopicKey, version: int, body: bytes) -> None:
        self._entries[key] = (version, body)
        self._entries.move_to_end(key)
        while len(self._entries) > self.entries_max:
            self._entries.popitem(last=False)

    def invalidate(self, key: TopicKey | None) -> None:
        if key is None:
            self._entries.clear()
        else:
            self._entries.pop(key, None)

    def __len__(self) -> int:
        return len(self._entries)
