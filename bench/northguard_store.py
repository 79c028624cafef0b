"""Throughput of the fps store alone: appends/s, records/s and MB/s through group commit, on a real disk.

Each shape is a batch of ``records_per_batch`` records of ``record_bytes``
(the batch is opaque to the store, so only its size matters).  ``segments``
producers each keep ``window`` appends in flight, as broker produce streams do.
No peer runs beside it: the figures are the store's own.  Each shape runs in
``--rounds`` rounds (3; 1 with ``--quick``), alternating which shape goes
first, on a fresh store each time; figures are medians with their min-max
spread.  The store's own counters say what was made durable: flushes (group
commits), fsync calls, records per fsync; ``machine`` names the filesystem of
the data directory and whether O_DIRECT was granted (probed there, and as the
store's segment files report it).
Prints one JSON object last: {"bench", "machine", "figures", "spread", "config", "targets"}.

    .venv/bin/python bench/northguard_store.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from report import (  # bench/report.py: what every bench shares
    Rounds,
    alternating,
    bench_parser,
    finish,
    guard,
    percentile,
    rounds_of,
    storage_facts,
)

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
    flushes = store.stats.flushes
    fsyncs = store.stats.fsyncs
    await store.close()
    appends = sum(counts)
    latencies_ms = sorted(s * 1000 for s in latencies_s)
    return {
        "appends_per_s": round(appends / elapsed_s),
        "records_per_s": round(appends * args.records_per_batch / elapsed_s),
        "mb_per_s": round(appends * len(batch) / elapsed_s / 1e6, 1),
        "flushes_per_s": round(flushes / elapsed_s, 1),
        "appends_per_flush": round(appends / max(flushes, 1), 1),
        "fsyncs_per_s": round(fsyncs / elapsed_s, 1),
        "records_per_fsync": round(appends * args.records_per_batch / max(fsyncs, 1), 1),
        "append_latency_ms_p50": round(statistics.median(latencies_ms), 2),
        "append_latency_ms_p99": round(percentile(latencies_ms, 0.99), 2),
        "direct_io": float(direct),
    }


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument(
        "--dir", type=Path, default=None, help="where to write (default: a temporary directory)"
    )
    parser.add_argument("--segments", type=int, default=8)
    parser.add_argument("--window", type=int, default=32, help="appends in flight per segment")
    parser.add_argument("--records-per-batch", type=int, default=100)
    args = parser.parse_args()
    args.seconds = 1.5 if args.quick else 10.0
    rounds_n = rounds_of(args)
    rounds = Rounds()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="ng-store-bench-") as scratch:
        facts = storage_facts(scratch)
        for number, order in enumerate(alternating(rounds_n, list(SHAPES))):
            for name in order:
                data_dir = Path(scratch) / f"{name}-{number}"
                result = asyncio.run(run_shape(data_dir, SHAPES[name], args))
                for key, value in result.items():
                    rounds.add(f"{key}_{name}", value)
                print(
                    f"[bench northguard_store] round {number} {name}: "
                    f"{result['records_per_s']:,.0f} records/s, {result['mb_per_s']} MB/s, "
                    f"{result['fsyncs_per_s']} fsyncs/s, p99 {result['append_latency_ms_p99']} ms",
                    file=sys.stderr,
                    flush=True,
                )
    figures = rounds.figures()
    figures["rounds"] = rounds_n
    direct = all(
        v == 1.0 for name, vs in rounds.values.items() if name.startswith("direct_io") for v in vs
    )
    finish(
        "northguard_store",
        figures,
        {},
        no_fail=args.no_fail,
        spread=rounds.spread(),
        config={
            "segments": args.segments,
            "window": args.window,
            "records_per_batch": args.records_per_batch,
            "seconds_per_shape": args.seconds,
            "store": "FpsStore defaults (group commit, WAL + segment fsync per flush)",
        },
        peer="none: the store alone",
        store_segments_direct_io=direct,
        **facts,
    )


if __name__ == "__main__":
    guard("northguard_store", main)
