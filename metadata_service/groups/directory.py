"""Who coordinates each group, and where its state survives an instance: ZooKeeper, or memory.

ZooKeeper layout under the service's root (``zk_root``)::

    instances/<instance id>       ephemeral: {"url": advertised URL}
    groups/<vc>/<group>/state     persistent: the GroupState JSON, written with version checks
    groups/<vc>/<group>/leader    ephemeral: {"instance", "url"} of the coordinating instance

The first instance that needs a group creates its ``leader`` znode and
coordinates it until its session ends (SIGKILL: after the session timeout;
a clean stop: at once).  Every state write is a compare-and-set on the
znode's version, so an instance that lost the group without knowing it (a
long pause, a partition) fails its next write instead of overwriting the
new coordinator: ``GroupMoved``.  On a lost session every claim is dropped.

``MemoryDirectory`` is the embedded default (no ZooKeeper): one instance,
which coordinates every group, and state that lives as long as the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from metadata_service.groups.state import GroupState
from xinfra.errors import GroupMoved, GroupNotFound, Unavailable

log = logging.getLogger(__name__)

GroupKey = tuple[str, str]
"""(virtual cluster, group)."""

CLAIM_ATTEMPTS = 3
"""Claims of a group whose leader znode vanishes between our create and our read (its
coordinator's session just ended): each attempt may then win it; past them, ``Unavailable``."""


@dataclass(frozen=True)
class Claim:
    """Either this instance coordinates the group (``state``/``version``) or ``url`` does."""

    state: GroupState | None = None
    version: int = -1
    url: str | None = None
    instance: str | None = None

    @property
    def mine(self) -> bool:
        return self.url is None and self.instance is None


class Directory(Protocol):
    def on_lost(self, callback: Callable[[], None]) -> None:
        """``callback`` runs on the event loop when every claim of this instance is void."""
        ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def connected(self) -> bool: ...

    async def claim(self, key: GroupKey, create: bool) -> Claim:
        """Coordinate ``key`` (its state, None if new and ``create``) or learn who does.

        Raises ``GroupNotFound`` when the group has no state and not ``create``.
        """
        ...

    async def save(self, key: GroupKey, state: GroupState, version: int) -> int:
        """Write ``state`` if its stored version is still ``version``; the new version.

        Raises ``GroupMoved`` when another instance has written since.
        """
        ...

    async def delete(self, key: GroupKey, version: int) -> None: ...

    async def list_groups(self, vc: str) -> list[str]: ...

    async def read(self, key: GroupKey) -> GroupState | None:
        """The stored state, whoever coordinates (for listings)."""
        ...


class MemoryDirectory:
    """One instance, no ZooKeeper: it coordinates everything; state dies with the process."""

    def __init__(self) -> None:
        self._states: dict[GroupKey, tuple[GroupState, int]] = {}

    def on_lost(self, callback: Callable[[], None]) -> None:
        return None

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    def connected(self) -> bool:
        return True

    async def claim(self, key: GroupKey, create: bool) -> Claim:
        stored = self._states.get(key)
        if stored is None:
            if not create:
                raise GroupNotFound(f"consumer group {key[1]!r} does not exist in {key[0]!r}")
            return Claim(state=None, version=-1)
        state, version = stored
        return Claim(state=GroupState.from_json(state.to_json()), version=version)

    async def save(self, key: GroupKey, state: GroupState, version: int) -> int:
        stored = self._states.get(key)
        if (stored[1] if stored else -1) != version:
            raise GroupMoved(f"group {key[1]!r} was written by someone else; retry")
        self._states[key] = (GroupState.from_json(state.to_json()), version + 1)
        return version + 1

    async def delete(self, key: GroupKey, version: int) -> None:
        self._states.pop(key, None)

    async def list_groups(self, vc: str) -> list[str]:
        return sorted(g for v, g in self._states if v == vc)

    async def read(self, key: GroupKey) -> GroupState | None:
        stored = self._states.get(key)
        return stored[0] if stored else None


class ZooKeeperDirectory:
    """Claims and state in ZooKeeper (see the module docstring); kazoo calls run on threads."""

    def __init__(
        self, hosts: str, root: str, instance_id: str, url: str | None, session_s: float
    ) -> None:
        self.hosts = hosts
        self.root = root.rstrip("/")
        self.instance_id = instance_id
        self.url = url
        self.session_s = session_s
        self._client: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._connected = threading.Event()
        self._registered = threading.Event()
        self._callbacks: list[Callable[[], None]] = []

    def _group_path(self, key: GroupKey) -> str:
        return f"{self.root}/groups/{key[0]}/{key[1]}"

    def on_lost(self, callback: Callable[[], None]) -> None:
        self._callbacks.append(callback)

    def _lost(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            for callback in self._callbacks:
                loop.call_soon_threadsafe(callback)

    async def start(self) -> None:
        from kazoo.client import KazooClient, KazooState

        self._loop = asyncio.get_running_loop()
        client = KazooClient(hosts=self.hosts, timeout=self.session_s)
        self._client = client

        def on_state(state: str) -> None:
            if state == KazooState.CONNECTED:
                self._connected.set()
            else:
                self._connected.clear()
                if state == KazooState.LOST:
                    self._registered.clear()  # our ephemeral znodes went with the session
                    self._lost()

        client.add_listener(on_state)
        await asyncio.to_thread(client.start, 15.0)
        self._connected.set()
        await asyncio.to_thread(self._register)

    def _register(self) -> None:
        from kazoo.exceptions import NodeExistsError

        client = self._client
        client.ensure_path(f"{self.root}/instances")
        client.ensure_path(f"{self.root}/groups")
        with contextlib.suppress(NodeExistsError):  # registered already in this session
            client.create(
                f"{self.root}/instances/{self.instance_id}",
                json.dumps({"url": self.url}).encode(),
                ephemeral=True,
            )
        self._registered.set()

    async def stop(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            # Closing the session deletes our ephemeral znodes: other instances take over at once.
            await asyncio.to_thread(client.stop)
            await asyncio.to_thread(client.close)

    def connected(self) -> bool:
        return self._connected.is_set()

    def _claim(self, key: GroupKey, create: bool) -> Claim:
        from kazoo.exceptions import NodeExistsError, NoNodeError

        client = self._client
        if not self._registered.is_set():
            self._register()  # a new session after a lost one
        path = self._group_path(key)
        try:
            data, stat = client.get(f"{path}/state")
            state: GroupState | None = GroupState.from_json(data)
            version = stat.version
        except NoNodeError:
            if not create:
                raise GroupNotFound(
                    f"consumer group {key[1]!r} does not exist in {key[0]!r}"
                ) from None
            state, version = None, -1
        me = json.dumps({"instance": self.instance_id, "url": self.url}).encode()
        for _ in range(CLAIM_ATTEMPTS):
            try:
                client.ensure_path(path)
                client.create(f"{path}/leader", me, ephemeral=True)
                break
            except NodeExistsError:
                try:
                    data, _ = client.get(f"{path}/leader")
                except NoNodeError:
                    continue  # its session ended between our create and our read: claim again
                leader = json.loads(data)
                if leader["instance"] != self.instance_id:
                    return Claim(url=leader["url"], instance=leader["instance"])
                break
        else:
            raise Unavailable(f"the coordinator of consumer group {key[1]!r} keeps changing; retry")
        # Re-read after the claim: a coordinator that died just before may have written since.
        try:
            data, stat = client.get(f"{path}/state")
            state, version = GroupState.from_json(data), stat.version
        except NoNodeError:
            state, version = None, -1
        return Claim(state=state, version=version)

    async def claim(self, key: GroupKey, create: bool) -> Claim:
        self._require()
        return await asyncio.to_thread(self._claim, key, create)

    def _save(self, key: GroupKey, state: GroupState, version: int) -> int:
        from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError

        client = self._client
        path = f"{self._group_path(key)}/state"
        try:
            if version < 0:
                client.create(path, state.to_json())
                return 0
            return int(client.set(path, state.to_json(), version=version).version)
        except (BadVersionError, NodeExistsError, NoNodeError):
            raise GroupMoved(
                f"group {key[1]!r} was taken over by another instance; retry"
            ) from None

    async def save(self, key: GroupKey, state: GroupState, version: int) -> int:
        self._require()
        try:
            return await asyncio.to_thread(self._save, key, state, version)
        except GroupMoved:
            raise
        except Exception as error:  # a connection loss: we may no longer coordinate
            raise GroupMoved(f"could not write group {key[1]!r} to ZooKeeper: {error}") from None

    def _delete(self, key: GroupKey, version: int) -> None:
        from kazoo.exceptions import BadVersionError, NoNodeError

        client = self._client
        path = self._group_path(key)
        try:
            client.delete(f"{path}/state", version=version)
        except BadVersionError:
            raise GroupMoved(f"group {key[1]!r} changed while being deleted; retry") from None
        except NoNodeError:
            pass
        client.delete(path, recursive=True)

    async def delete(self, key: GroupKey, version: int) -> None:
        self._require()
        await asyncio.to_thread(self._delete, key, version)

    def _list(self, vc: str) -> list[str]:
        from kazoo.exceptions import NoNodeError

        try:
            names = self._client.get_children(f"{self.root}/groups/{vc}")
        except NoNodeError:
            return []
        return sorted(n for n in names if self._client.exists(f"{self.root}/groups/{vc}/{n}/state"))

    async def list_groups(self, vc: str) -> list[str]:
        self._require()
        return await asyncio.to_thread(self._list, vc)

    def _read(self, key: GroupKey) -> GroupState | None:
        from kazoo.exceptions import NoNodeError

        try:
            data, _ = self._client.get(f"{self._group_path(key)}/state")
        except NoNodeError:
            return None
        return GroupState.from_json(data)

    async def read(self, key: GroupKey) -> GroupState | None:
        self._require()
        return await asyncio.to_thread(self._read, key)

    def _require(self) -> None:
        if self._client is None or not self._connected.is_set():
            raise Unavailable("this instance is not connected to ZooKeeper; retry")
