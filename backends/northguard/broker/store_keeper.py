"""Return a failed store to service without a restart: reopen it with backoff until the disk allows.

After a disk error the store is fail-stop (see ``store.fps``): it refuses
every write, the broker refuses ``PRODUCE_OPEN`` with its error and reports
it on ``/health``.  The keeper, a task owned by the broker, then calls
``store.reopen()`` (release every file, recover again) after a wait that
doubles from ``REOPEN_BACKOFF_S_MIN`` to ``REOPEN_BACKOFF_S_MAX``, with
jitter.  A full disk therefore returns to service a few seconds after space
is freed; a dead one costs one recovery attempt every ``REOPEN_BACKOFF_S_MAX``
seconds and one log line each.  The backoff restarts from the bottom only
when the store stayed healthy for ``REOPEN_BACKOFF_S_MAX`` after a reopen.

Each attempt is counted in ``northguard_store_reopens_total{outcome}``.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter

from backends.northguard.runtime import Runtime
from backends.northguard.shielded import to_completion
from backends.northguard.store.base import SegmentStore
from xinfra.errors import StorageError

log = logging.getLogger(__name__)

REOPEN_BACKOFF_S_MIN = 0.5
REOPEN_BACKOFF_S_MAX = 5.0
CHECK_S = 0.25
"""How often the keeper looks at the store while it is healthy (a property read)."""


class StoreKeeper:
    def __init__(self, runtime: Runtime, store: SegmentStore, registry: CollectorRegistry) -> None:
        self._runtime = runtime
        self._store = store
        self.reopens = Counter(
            "northguard_store_reopens",
            "Attempts to reopen a failed store",
            ["outcome"],
            registry=registry,
        )

    async def run(self) -> None:
        """Forever (cancelled by the broker's stop): wait for a failure, reopen with backoff."""
        attempts = 0
        reopened_s = float("-inf")
        while True:
            failure = self._store.failure
            if failure is None:
                if self._runtime.monotonic_s() - reopened_s > REOPEN_BACKOFF_S_MAX:
                    attempts = 0  # healthy long enough since the last reopen: a new incident
                await self._runtime.sleep(CHECK_S)
                continue
            wait_s = min(REOPEN_BACKOFF_S_MAX, REOPEN_BACKOFF_S_MIN * 2 ** min(attempts, 16))
            wait_s *= 0.5 + 0.5 * self._runtime.random.random()
            attempts += 1
            log.warning(
                "store failed (%s); refusing produce streams, reopening in %.1f s (attempt %d)",
                failure.message,
                wait_s,
                attempts,
            )
            await self._runtime.sleep(wait_s)
            try:
                await to_completion(self._store.reopen())  # never stop with files half-open
            except StorageError as error:
                self.reopens.labels("failed").inc()
                log.warning("store reopen failed: %s", error.message)
                continue
            self.reopens.labels("ok").inc()
            reopened_s = self._runtime.monotonic_s()
