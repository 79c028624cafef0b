"""The one way tests check C code for leaked references: memory still held after a second run."""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable

LEAK_BYTES_MAX = 64 << 10
"""More than this still allocated after a run of thousands of calls is a reference leaked per
call (a few bytes each), not the allocator's noise."""


def bytes_kept(run: Callable[[], None]) -> int:
    """Bytes still allocated after ``run``, measured on its second call (the first warms caches,
    interned strings and free lists up)."""
    run()
    gc.collect()
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        run()
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
