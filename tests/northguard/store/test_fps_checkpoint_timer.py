"""The background checkpoint runs under the broker's event loop (uvloop), whose timers may fire early.

uvloop (libuv) measures a timer from the time cached at the start of the
loop's iteration, in whole milliseconds, so ``call_later(1.0)`` can run a
little before ``time.monotonic()`` says a second has passed.  A checkpoint
that ran only when the clock agreed never ran at all once the segments were
written and the writes stopped: the WAL grew until the next write.  Real
store, real files, uvloop as in ``broker.main``.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from backends.northguard.runtime import RealRuntime
from backends.northguard.store import FpsStore

uvloop = pytest.importorskip("uvloop")

ROUNDS = 20
WAIT_S = 5.0  # a checkpoint is due 20 ms after a write; generous on a shared machine


async def _checkpoints_after_each_write(data_dir: Path) -> list[int]:
    store = FpsStore(RealRuntime(seed=1), data_dir, group_commit_ms=1.0, checkpoint_ms=20.0)
    await store.open()
    try:
        await store.create_segment("s", 0)
        seen: list[int] = []
        for round_ in range(ROUNDS):  # an idle store after each write: only the timer is left
            before = store.stats.checkpoints
            await store.append("s", round_, 1, b"x")
            deadline = time.monotonic() + WAIT_S
            while store.stats.checkpoints == before and time.monotonic() < deadline:
                await asyncio.sleep(0.005)  # polls a counter; the store's own timer must act
            seen.append(store.stats.checkpoints - before)
        return seen
    finally:
        await store.close()


def test_an_idle_store_checkpoints_under_uvloop(tmp_path: Path) -> None:
    seen = uvloop.run(_checkpoints_after_each_write(tmp_path / "data"))
    assert all(seen), f"writes followed by no checkpoint: {seen.count(0)} of {ROUNDS}"
