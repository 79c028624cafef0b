"""Writer passes are paced: a flush right after a pass does not start another one (its frames wait
for ``write_pass_ms``), but a read that needs frames not yet in their segment file starts one at
once.  Asserted on the store's pass counter with timers that never fire, never on time."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from store_faults import StoreFactory

from backends.northguard.runtime import RealRuntime


class FrozenTimers(RealRuntime):
    """The real runtime whose timers never fire: whatever completes here needed no timer."""

    def call_later(self, seconds: float, callback: Callable[[], None]) -> asyncio.TimerHandle:
        handle = asyncio.get_running_loop().call_later(3600.0, callback)
        handle.cancel()
        return handle


async def test_flushes_after_a_pass_wait_for_the_next_and_a_read_starts_it(
    open_fps: StoreFactory,
) -> None:
    store = await open_fps(runtime=FrozenTimers(seed=1), group_commit_ms=0, read_cache_bytes_max=0)
    await store.create_segment("s1", 0)
    for offset in range(5):  # one flush each
        await asyncio.wait_for(store.append("s1", offset, 1, bytes([offset]) * 10), 30)
    assert store.flush_count == 5
    # the first flush's frames were written at once; the four later flushes started no pass
    entries = await asyncio.wait_for(store.read("s1", 4, 1 << 20), 30)  # needs one: starts it
    assert [(e.base_offset, e.batch) for e in entries] == [(4, bytes([4]) * 10)]
    assert store.stats.segment_write_passes == 2
    entries = await asyncio.wait_for(store.read("s1", 0, 1 << 20), 30)
    assert [e.batch for e in entries] == [bytes([i]) * 10 for i in range(5)]
