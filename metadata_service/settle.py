"""Settles: the second phase of a seal, a durable intent that any instance can finish.

A Kafka topic cannot be sealed: it takes writes after its epoch is sealed in
MySQL.  So a seal without given end offsets is two-phase.  Version V marks the
epochs sealed with end offsets unknown (consumers wait at their end; producers
move to the new write epochs) and, in the same transaction, owes a *settle*
for each (a ``settles`` row naming V and the time it was written).  Producers
acknowledge V only after their writes under older versions have settled, so
once every live producer has acknowledged V the end offsets read from the
backend are final; one more transaction records them and drops the settle.
Producers that do not acknowledge within ``seal_settle_s_max`` of the row's
creation (not of a restart) are waited for no longer: their late writes would
be invisible to readers; the log says which.

Nothing of this lives only in a request: the request that sealed waits for
its settle, but the settle runs as a task owned by this service, which keeps
it going if the request goes away; a shutdown (SIGTERM) answers the waiting
request at once with the pending state (202) and leaves the row for the next
start; every instance finishes every owed settle when it starts, a repeated
seal finishes what is missing, and ``reconcile`` finishes or reports them.
Two settlers of one epoch are harmless: the first to commit wins.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Mapping
from typing import Any

from metadata_service.runtime import Runtime
from metadata_service.store.repository import EpochRow, SettleRow
from xinfra.errors import InvalidRequest, XinfraError

log = logging.getLogger(__name__)

SEAL_SETTLE_POLL_S = 0.05
"""How often a settle re-reads the registry while it waits for producers."""

SETTLE_ATTEMPTS_MAX = 6
"""Attempts of a settle whose backend read fails; then it waits for a restart, a repeated seal or
a reconcile (the row stays)."""

SETTLE_BACKOFF_S_MAX = 30.0
"""The largest pause between two attempts (exponential from 0.5 s, with full jitter)."""

TopicKey = tuple[str, str]


def check_end_offsets(epoch: EpochRow, end_offsets: Mapping[int, int]) -> dict[int, int]:
    expected = set(range(len(epoch.shards)))
    if set(end_offsets) != expected:
        raise InvalidRequest(
            f"end_offsets of epoch {epoch.number} must name exactly its shards 0..{len(epoch.shards) - 1}"
        )
    return {int(k): int(v) for k, v in end_offsets.items()}


async def seal_end_offsets(rt: Runtime, epoch: EpochRow) -> dict[int, int]:
    """Seal the epoch's physical topic where its backend can, and answer its end offsets.

    Northguard refuses later appends from here on, so a producer that missed
    the settle window gets an error, never an acknowledgement readers would
    drop; Kafka only reports its end offsets (``Backend.seal_topic``).
    """
    cluster, _version = await rt.db(rt.store.get_cluster, epoch.cluster)

    async def seal(backend: Any) -> dict[int, int]:
        offsets: dict[int, int] = await backend.seal_topic(epoch.physical_topic)
        return offsets

    offsets = await rt.backends.call(cluster, seal)
    return check_end_offsets(epoch, offsets)


class _Settle:
    """The one task settling a topic's owed epochs on this instance, and what waiters need."""

    def __init__(self) -> None:
        self.attempt_failed = asyncio.Event()
        self.error: XinfraError | None = None
        self.task: asyncio.Task[None] | None = None


class SettleService:
    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime
        self._settles: dict[TopicKey, _Settle] = {}
        self._stopping = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Resume every owed settle (left by an instance that died or stopped while waiting)."""
        self._loop = asyncio.get_running_loop()
        owed = await self.rt.db(self.rt.store.owed_settles)
        for key in sorted({(row.virtual_cluster, row.topic) for row in owed}):
            self._ensure(key)
        if owed:
            log.info("resuming %d owed settle(s) of %d topic(s)", len(owed), len(self._settles))

    def begin_shutdown(self) -> None:
        """Answer waiting requests now (202, pending).  Safe from a signal handler."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stopping.set)

    async def stop(self) -> None:
        """Cancel the settles still running; their rows stay owed for the next start."""
        self._stopping.set()
        tasks = [s.task for s in self._settles.values() if s.task is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._settles.clear()

    # ---- settling -----------------------------------------------------------------------

    async def settle(self, vc: str, name: str) -> bool:
        """Finish the topic's owed settles; True when none is left, False when still pending.

        Still pending means this instance is shutting down (the settle resumes
        at the next start).  A failed backend read raises its error; the task
        keeps retrying with backoff.
        """
        if not await self.rt.db(self.rt.store.owed_settles, vc, name):
            return True
        if self._stopping.is_set():
            return False
        settle = self._ensure((vc, name))
        assert settle.task is not None
        stopping = asyncio.ensure_future(self._stopping.wait())
        failed = asyncio.ensure_future(settle.attempt_failed.wait())
        try:
            await asyncio.wait({settle.task, stopping, failed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            failed.cancel()
        if settle.task.done() and not settle.task.cancelled():
            settle.task.result()  # the settle's own failure (a bug) reaches the caller
            return not await self.rt.db(self.rt.store.owed_settles, vc, name)
        if settle.attempt_failed.is_set() and settle.error is not None:
            raise settle.error
        return False

    def resume(self, vc: str, name: str) -> None:
        """Settle the topic's owed epochs in the background (no-op if already running here)."""
        self._ensure((vc, name))

    def _ensure(self, key: TopicKey) -> _Settle:
        settle = self._settles.get(key)
        if settle is None:
            settle = _Settle()
            settle.task = asyncio.create_task(self._run(key, settle), name=f"settle {key}")
            self._settles[key] = settle
        return settle

    async def _run(self, key: TopicKey, settle: _Settle) -> None:
        """Attempts with capped, jittered exponential backoff; the row outlives a give-up."""
        try:
            for attempt in range(SETTLE_ATTEMPTS_MAX):
                try:
                    await self._settle_once(*key)
                    return
                except XinfraError as error:
                    settle.error = error
                    settle.attempt_failed.set()
                    pause_s = random.uniform(0, min(SETTLE_BACKOFF_S_MAX, 0.5 * 2**attempt))
                    log.warning(
                        "settling %s/%s failed (attempt %d of %d, next in %.1f s): %s",
                        *key,
                        attempt + 1,
                        SETTLE_ATTEMPTS_MAX,
                        pause_s,
                        error,
                    )
                    if attempt + 1 < SETTLE_ATTEMPTS_MAX:
                        await asyncio.sleep(pause_s)
                    settle.attempt_failed.clear()
            log.error(
                "settling %s/%s: giving up after %d attempts; the settle stays owed "
                "(a repeated seal, a reconcile or a restart retries it)",
                *key,
                SETTLE_ATTEMPTS_MAX,
            )
        except Exception:
            log.exception("settling %s/%s failed unexpectedly; the settle stays owed", *key)
            raise
        finally:
            if self._settles.get(key) is settle:
                del self._settles[key]

    async def _settle_once(self, vc: str, name: str) -> None:
        owed = await self.rt.db(self.rt.store.owed_settles, vc, name)
        by_version: dict[int, list[SettleRow]] = {}
        for row in owed:
            by_version.setdefault(row.version, []).append(row)
        for version in sorted(by_version):
            rows = by_version[version]
            deadline = min(r.created_ms for r in rows) / 1000 + self.rt.config.seal_settle_s_max
            await self._wait_for_producers(vc, name, version, deadline)
            await self.finish(vc, name, [r.epoch for r in rows])

    async def finish(
        self,
        vc: str,
        name: str,
        numbers: list[int],
        given: Mapping[int, dict[int, int]] | None = None,
    ) -> None:
        """Read (or take ``given``) end offsets and record them, if the settles are still owed."""
        _topic, epochs = await self.rt.db(self.rt.store.get_topic, vc, name)
        by_number = {e.number: e for e in epochs}
        offsets = {}
        for number in numbers:
            epoch = by_number.get(number)
            if epoch is None:
                continue  # the topic was deleted meanwhile; its settles went with it
            offsets[number] = (
                check_end_offsets(epoch, given[number])
                if given is not None and number in given
                else await seal_end_offsets(self.rt, epoch)
            )
        version = await self.rt.db(self.rt.store.finish_settle, vc, name, offsets)
        if version is not None:
            await self.rt.publish((vc, name), version)

    async def behind(self, vc: str, name: str, version: int) -> list[str]:
        """Live producers of the topic that have not acknowledged ``version``."""
        clients = await self.rt.db(
            self.rt.store.list_clients, vc, self.rt.config.clients_per_vcluster_max
        )
        return [
            c.client_id
            for c in clients
            if c.kind == "producer" and name in c.topics and c.acked.get(name, -1) < version
        ]

    async def _wait_for_producers(self, vc: str, name: str, version: int, deadline: float) -> None:
        while True:
            behind = await self.behind(vc, name, version)
            if not behind:
                return
            if time.time() >= deadline:
                log.warning(
                    "sealing %s/%s: producers %s did not acknowledge version %d in %.0f s; "
                    "recording end offsets without them",
                    vc,
                    name,
                    behind,
                    version,
                    self.rt.config.seal_settle_s_max,
                )
                return
            await asyncio.sleep(SEAL_SETTLE_POLL_S)
