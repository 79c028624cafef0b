"""Run one broker process until SIGTERM/SIGINT: logging, uvloop when installed, a clean stop."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import logging
import signal
import time

from backends.northguard.broker.server import Broker, BrokerConfig

log = logging.getLogger("backends.northguard.broker")

GC_THRESHOLDS = (50_000, 20, 100)
"""The collector's thresholds while serving (see ``_serve``); CPython's default is (700, 10, 10)."""
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3  # glibc's mallopt parameters
MALLOC_KEEP_BYTES = 512 << 20
"""Free memory glibc's malloc keeps at the top of its heap instead of giving it back."""
MALLOC_MMAP_BYTES = 32 << 20
"""Allocations from this size up are mapped on their own (glibc's largest threshold)."""
MALLOC_TOP_PAD_BYTES = 16 << 20
"""Extra memory asked of the kernel each time the heap grows (fewer, larger growths)."""


def run_broker(config: BrokerConfig, log_level: str = "INFO") -> None:
    """Serve until SIGTERM or SIGINT, then stop cleanly (exit status 0)."""
    keep_freed_memory()
    logging.basicConfig(
        level=log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s [broker " + config.broker_id + "] %(message)s",
    )
    try:
        import uvloop
    except ImportError:  # plain asyncio works; uvloop is only faster
        asyncio.run(_serve(config))
    else:
        uvloop.run(_serve(config))


def keep_freed_memory() -> None:
    """Have glibc's malloc reuse the memory the data path frees instead of returning it.

    Every batch received is copied into fresh memory that lives until the
    batch is in its segment file and out of the read cache.  By default glibc
    hands the top of its heap back to the kernel past 128 KiB free, and maps
    each allocation over its (adaptive) mmap threshold anew, so the next
    batches fault their pages in again: 17,000-35,000 minor faults per
    500,000 records appended (measured), at 5-8 us each in this VM.  The
    price is that a broker keeps the memory of its busiest moment, as a JVM
    keeps its heap.  Elsewhere than glibc (no ``mallopt``) nothing changes.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return
    mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_BYTES)
    mallopt(_M_TRIM_THRESHOLD, MALLOC_KEEP_BYTES)
    mallopt(_M_TOP_PAD, MALLOC_TOP_PAD_BYTES)


async def _serve(config: BrokerConfig) -> None:
    broker = Broker(config)
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop_requested.set)
    started_s = time.monotonic()
    # A start builds what lives as long as the process (every range's and segment's metadata,
    # twice: parsed, then as objects): the collector would only scan it again and again, 0.22 s
    # of a 0.79 s start at 24,576 segments (measured).  Once that is frozen, below, it runs again.
    gc.disable()
    await broker.start()
    start_s = time.monotonic() - started_s
    # What exists now (modules, recovered state) lives as long as the process: out of the
    # collector's full scans, which otherwise stall the event loop 40-70 ms each under load
    # (measured), every append and ack waiting behind them.
    gc.freeze()
    # Metadata made while serving (ranges, segments, their logs: ~30 objects per new range) is
    # long-lived too, and with the default thresholds (700, 10, 10) every 25% of growth cost a
    # full scan of all of it: 8 full collections, 0.7 s of CPU on the event loop, in two first
    # writes to 4,096 new ranges (measured with gc.callbacks).  Young collections that rare
    # still find the short-lived cycles; the full scans become rare.
    gc.set_threshold(*GC_THRESHOLDS)
    gc.enable()
    print(
        f"northguard broker {config.broker_id} ready on {config.host}:{broker.port} "
        f"({'TLS' if broker.tls else 'plaintext'}) "
        f"(recovered in {start_s:.3f} s)",
        flush=True,
    )
    try:
        await stop_requested.wait()
        log.info("stop requested: closing connections and the store")
    finally:
        with contextlib.suppress(Exception):
            await broker.stop()
