"""Background disk work (segment writes, checkpoints) runs on threads that yield the CPU.

On a machine whose cores the broker shares (with its producers, or other
brokers), a writer pass's burst on many threads took the cores from the event
loop.  ``Runtime.run_background`` runs such work on threads whose Linux nice
value is ``BACKGROUND_NICE`` above the caller's; ``run_blocking`` (flushes,
reads: what acknowledgements and answers wait on) keeps the caller's priority.
Nice is per thread only on Linux, so elsewhere nothing is lowered.
"""

from __future__ import annotations

import os
import sys

import pytest

from backends.northguard.runtime import BACKGROUND_NICE, RealRuntime
from backends.northguard.store.fps import _FSYNC_POOL

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="nice is per thread on Linux only")


def thread_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, 0)  # 0: the calling thread, on Linux


async def test_background_work_runs_lowered_and_blocking_work_does_not() -> None:
    runtime = RealRuntime()
    ours = thread_nice()
    lowered = min(ours + BACKGROUND_NICE, 19)
    assert await runtime.run_background(thread_nice) == lowered
    assert await runtime.run_blocking(thread_nice) == ours
    assert _FSYNC_POOL.submit(thread_nice).result(timeout=30) == lowered  # side-by-side writes
    assert thread_nice() == ours  # the caller's own priority is untouched
