"""Throughput of the fps store alone: appends/s, records/s and MB/s through group commit, on a real disk.

Each shape is a batch of ``records_per_batch`` records of ``record_bytes``
(the batch is opaque to the store, so only its size matters).  ``segments``
producers each keep ``window`` appends in flight, as broker produce streams do.
Prints one JSON object last: {"bench", "machine", "figures", "targets"}.

    .venv/bin/python bench/northguard_store.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from backends.northguard.runtime import RealRuntime
from backends.northguard.store import FpsStore

SHAPES = {"100B": 100, "1KiB": 1024}  # record bytes


async def run_shape(
    data_dir: Path, record_bytes: int, args: argparse.Namespace
) -> dict[str, float]:
    store = FpsStore(RealRuntime(), data_dir)
    await store.open()
    batch = os.urandom(record_bytes * args.records_per_batch)
    latencies_s: list[float] = []
    deadline = time.perf_counter() + args.seconds

    async def producer(segment_id: str) -> int:
        await store.create_segment(segment_id, 0)
        next_offset = 0
        appended = 0
        in_flight: set[asyncio.Future[float]] = set()

        async def one(offset: int) -> float:
            started = time.perf_counter()
            await store.append(segment_id, offset, args.records_per_batch, batch)
            return time.perf_counter() - started

        while time.perf_counter() < deadline or in_flight:
            while len(in_flight) < args.window and time.perf_counter() < deadline:
                in_flight.add(asyncio.ensure_future(one(next_offset)))
                next_offset += args.records_per_batch
            done, in_flight = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                latencies_s.append(future.result())
                appended += 1
        return appended

    started = time.perf_counter()
    counts = await asyncio.gather(*(producer(f"bench-{n}") for n in range(args.segments)))
    elapsed_s = time.perf_counter() - started
    direct = store.direct_io("bench-0")
    flushes = store.flush_count
    await store.close()
    appends = sum(counts)
    latencies_ms = sorted(s * 1000 for s in latencies_s)
    return {
        "appends_per_s": round(appends / elapsed_s),
        "records_per_s": round(appends * args.records_per_batch / elapsed_s),
        "mb_per_s": round(appends * len(batch) / elapsed_s / 1e6, 1),
        "flushes_per_s": round(flushes / elapsed_s, 1),
        "appends_per_flush": round(appends / max(flushes, 1), 1),
        "append_latency_ms_p50": round(statistics.median(latencies_ms), 2),
        "append_latency_ms_p99": round(latencies_ms[int(len(latencies_ms) * 0.99) - 1], 2),
        "direct_io": direct,
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1.5 s per shape instead of 10 s")
    parser.add_argument(
        "--dir", type=Path, default=None, help="where to write (default: a temporary directory)"
    )
    parser.add_argument("--segments", type=int, default=8)
    parser.add_argument("--window", type=int, default=32, help="appends in flight per segment")
    parser.add_argument("--records-per-batch", type=int, default=100)
    args = parser.parse_args()
    args.seconds = 1.5 if args.quick else 10.0
    figures: dict[str, object] = {}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="ng-store-bench-") as scratch:
        for name, record_bytes in SHAPES.items():
            result = await run_shape(Path(scratch) / name, record_bytes, args)
            for key, value in result.items():
                figures[f"{key}_{name}"] = value
    machine = {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "segments": args.segments,
        "window": args.window,
        "records_per_batch": args.records_per_batch,
        "seconds_per_shape": args.seconds,
    }
    print(
        json.dumps(
            {"bench": "northguard_store", "machine": machine, "figures": figures, "targets": {}}
        )
    )


if __name__ == "__main__":
    asyncio.run(main())
