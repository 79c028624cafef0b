"""Background disk work runs on threads that yield the CPU; work someone waits for does not.

On a machine whose cores the broker shares (with its producers, or other
brokers), a writer pass's burst on eight threads took the cores from the
event loop.  ``Runtime.run_background`` runs work nobody waits for (the
writer's own passes, timed checkpoints) on threads under Linux's
``SCHED_IDLE``.  A pass or checkpoint that a read, a seal, a delete or a
close waits for runs at the caller's priority: lowered, it would make them
wait behind every busy thread of the machine.  So do a pass forced by the
bound of unwritten bytes and a checkpoint that releases a full WAL file: on
busy CPUs they would wait without end, and memory or WAL files pile up.  The
policy is per thread only on Linux, so elsewhere nothing is lowered.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest
from store_faults import FaultyRuntime, Hold

from backends.northguard.runtime import RealRuntime
from backends.northguard.store import FpsStore
from backends.northguard.store.fps import _BACKGROUND_POOL, _FSYNC_POOL
from backends.northguard.store.segment_meta import SEGMENT_SUFFIX

pytestmark = pytest.mark.skipif(
    sys.platform != "linux", reason="the policy is per thread on Linux only"
)


def thread_policy() -> int:
    return os.sched_getscheduler(0)  # 0: the calling thread, on Linux


class PolicyOf(Hold):
    """The next call of one operation on one file: the scheduling policy of the thread making it."""

    def __init__(self) -> None:
        super().__init__(released=True)
        self.policy: int | None = None

    def arrive(self) -> bool:
        if not self.reached.is_set():
            self.policy = thread_policy()
        return super().arrive()


async def test_the_runtime_and_the_pools_run_background_work_lowered() -> None:
    runtime = RealRuntime()
    ours = thread_policy()
    assert ours != os.SCHED_IDLE
    assert await runtime.run_background(thread_policy) == os.SCHED_IDLE
    assert await runtime.run_blocking(thread_policy) == ours
    assert _BACKGROUND_POOL.submit(thread_policy).result(timeout=30) == os.SCHED_IDLE
    assert _FSYNC_POOL.submit(thread_policy).result(timeout=30) == ours
    assert thread_policy() == ours  # the caller's own priority is untouched


async def write_policy(tmp_path: Path, *, forced_by: str) -> int | None:
    """The policy of the thread that writes an acknowledged append to its segment file, in the
    pass ``forced_by`` a waiting read, the unwritten bound, or the segment's own size (ripe)."""
    runtime = FaultyRuntime()
    store = FpsStore(
        runtime,
        tmp_path / forced_by,
        group_commit_ms=1.0,
        checkpoint_ms=3_600_000.0,  # no timed checkpoint: only the pass under test writes
        read_cache_bytes_max=0,  # a read goes to the file, so waits for the frames to be there
        segment_write_bytes=1 if forced_by == "ripe" else 1 << 30,
        unwritten_bytes_max=1 if forced_by == "bound" else 1 << 30,
    )
    await store.open()
    try:
        await store.create_segment("r", 0)
        hold = runtime.faulty_disk.holds["pwrite", "r" + SEGMENT_SUFFIX] = PolicyOf()
        await store.append("r", 0, 1, b"x" * 100)
        if forced_by == "read":
            assert hold.policy is None  # acknowledged, not written yet
            entries = await asyncio.wait_for(store.read("r", 0, 1 << 20), 30)
            assert [e.base_offset for e in entries] == [0]
        assert await asyncio.to_thread(hold.done.wait, 30)
        return hold.policy
    finally:
        await store.close()


async def test_a_pass_a_read_waits_for_runs_at_the_readers_priority(tmp_path: Path) -> None:
    assert await write_policy(tmp_path, forced_by="read") == thread_policy()


async def test_a_pass_the_unwritten_bound_forces_runs_at_the_loops_priority(tmp_path: Path) -> None:
    assert await write_policy(tmp_path, forced_by="bound") == thread_policy()


async def test_a_pass_nobody_waits_for_runs_lowered(tmp_path: Path) -> None:
    assert await write_policy(tmp_path, forced_by="ripe") == os.SCHED_IDLE


async def checkpoint_sync_policy(tmp_path: Path, *, wal_full: bool) -> int | None:
    """The policy of the thread that syncs a segment file in the checkpoint after one append:
    the timed one, or the one a full WAL file starts (the second append rolls the WAL)."""
    runtime = FaultyRuntime()
    store = FpsStore(
        runtime,
        tmp_path / ("full" if wal_full else "timed"),
        group_commit_ms=1.0,
        checkpoint_ms=3_600_000.0 if wal_full else 20.0,
        segment_write_bytes=1 << 30,
        unwritten_bytes_max=1 << 30,
        wal_file_bytes_max=1 if wal_full else 1 << 30,
    )
    await store.open()
    try:
        await store.create_segment("r", 0)
        hold = runtime.faulty_disk.holds["fsync", "r" + SEGMENT_SUFFIX] = PolicyOf()
        await store.append("r", 0, 1, b"x" * 100)
        if wal_full:
            await store.append("r", 1, 1, b"y" * 100)  # a flush of its own: the WAL rolls first
        assert await asyncio.to_thread(hold.done.wait, 30)
        return hold.policy
    finally:
        await store.close()


async def test_a_timed_checkpoint_runs_lowered(tmp_path: Path) -> None:
    assert await checkpoint_sync_policy(tmp_path, wal_full=False) == os.SCHED_IDLE


async def test_a_checkpoint_that_releases_a_full_wal_file_runs_at_the_loops_priority(
    tmp_path: Path,
) -> None:
    assert await checkpoint_sync_policy(tmp_path, wal_full=True) == thread_policy()
