"""Background disk work runs on threads that yield the CPU; work someone waits for does not.

On a machine whose cores the broker shares (with its producers, or other
brokers), a writer pass's burst on eight threads took the cores from the
event loop.  ``Runtime.run_background`` runs work nobody waits for (the
writer's own passes, timed checkpoints) on threads whose Linux nice value is
``BACKGROUND_NICE`` above the process's.  A pass or checkpoint that a read, a
seal, a delete or a close waits for runs at the caller's priority: lowered,
it would make them wait behind every busy thread of the machine.  Nice is per
thread only on Linux, so elsewhere nothing is lowered.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest
from store_faults import FaultyRuntime, Hold

from backends.northguard.runtime import BACKGROUND_NICE, RealRuntime
from backends.northguard.store import FpsStore
from backends.northguard.store.fps import _BACKGROUND_POOL, _FSYNC_POOL
from backends.northguard.store.segment_meta import SEGMENT_SUFFIX

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="nice is per thread on Linux only")


def thread_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, 0)  # 0: the calling thread, on Linux


LOWERED = min(thread_nice() + BACKGROUND_NICE, 19)


class NiceOfWriter(Hold):
    """The first write of a file: the nice value of the thread that makes it."""

    def __init__(self) -> None:
        super().__init__(released=True)
        self.nice: int | None = None

    def arrive(self) -> bool:
        if not self.reached.is_set():
            self.nice = thread_nice()
        return super().arrive()


async def test_the_runtime_and_the_pools_run_background_work_lowered() -> None:
    runtime = RealRuntime()
    ours = thread_nice()
    assert await runtime.run_background(thread_nice) == LOWERED
    assert await runtime.run_blocking(thread_nice) == ours
    assert _BACKGROUND_POOL.submit(thread_nice).result(timeout=30) == LOWERED
    assert _FSYNC_POOL.submit(thread_nice).result(timeout=30) == ours
    assert thread_nice() == ours  # the caller's own priority is untouched


async def write_nice(tmp_path: Path, *, read_waits: bool) -> int | None:
    """The nice of the thread that writes an acknowledged append to its segment file: by the
    pass a read waits for, or by the pass the writer makes on its own (the unwritten bound)."""
    runtime = FaultyRuntime()
    store = FpsStore(
        runtime,
        tmp_path / ("read" if read_waits else "bound"),
        group_commit_ms=1.0,
        checkpoint_ms=3_600_000.0,  # no timed checkpoint: only the pass under test writes
        read_cache_bytes_max=0,  # a read goes to the file, so waits for the frames to be there
        segment_write_bytes=1 << 30,
        unwritten_bytes_max=(1 << 30) if read_waits else 1,
    )
    await store.open()
    try:
        await store.create_segment("r", 0)
        hold = runtime.faulty_disk.holds["pwrite", "r" + SEGMENT_SUFFIX] = NiceOfWriter()
        await store.append("r", 0, 1, b"x" * 100)
        if read_waits:
            assert hold.nice is None  # acknowledged, not written yet
            entries = await asyncio.wait_for(store.read("r", 0, 1 << 20), 30)
            assert [e.base_offset for e in entries] == [0]
        assert await asyncio.to_thread(hold.done.wait, 30)
        return hold.nice
    finally:
        await store.close()


async def test_a_pass_a_read_waits_for_runs_at_the_readers_priority(tmp_path: Path) -> None:
    assert await write_nice(tmp_path, read_waits=True) == thread_nice()


async def test_a_pass_nobody_waits_for_runs_lowered(tmp_path: Path) -> None:
    assert await write_nice(tmp_path, read_waits=False) == LOWERED
