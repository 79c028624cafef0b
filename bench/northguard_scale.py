"""Northguard with many ranges and segments: the curves of cost against work that must stay flat.

One broker process (fps store) on a temporary directory, driven by the SDK's
``NorthguardBackend``; its own counters (``/metrics``) are read before and
after each phase.

* **Produce throughput against ranges written at once**: the same records
  (``--records`` values of 100 B, 4,000,000 by default: a steady state over
  several checkpoints, see ``RECORDS_PER_RUN``; ``Record`` objects built inside the timed
  loop), one producer, sent ``--batch`` at a time to range ``(n // batch) %
  width`` of a fresh topic of ``width`` ranges, for width 1, 8, 64 and 512;
  every send's offsets are checked.  The loop yields to the event loop once
  per send, as an application awaiting its input does (a loop that never
  yields lets no linger timer fire until it ends, so it measures the client's
  build time and then the broker's, one after the other).  The widths run in a rotated order each
  round (paired rounds: the 512/1 ratio is taken per round), each on a quiet
  store: after a run, untimed, the bench waits for a checkpoint that leaves
  nothing acknowledged outside its segment file (``quiet``).  Per width the
  broker's flushes, fsyncs per flush (the flushes' own: the WAL's), mean
  flush time, appends per flush, every fsync and the checkpoints', the segment
  file appends of the writer passes, the segment files made with the time
  their opens took, the CPU seconds of this process (the producer) and of the
  broker (on 2 cores the producer's own CPU bounds the rate, and the broker's
  competes with it), and the acknowledged bytes not yet in their segment files
  at the run's end (written by the checkpoint the bench then waits for) are
  reported.
* **First write to 4,096 new ranges**: a fresh topic of 4,096 ranges, one
  record sent to every range at once; timed from the first send to the last
  acknowledgement (every range opens its first segment: a store create and a
  journal op each).
* **Restart with 4,096 active segments**: right after that write, SIGTERM and
  a new process on the same directory; timed from the spawn to the client
  port answering (interpreter start included), and the broker's own
  recovery time (``northguard_start_seconds``).
* **Open descriptors at 20,000 segments**: the rounds above leave 4,096 more
  segments each; once past 20,000, every range of the first topic is read
  back from offset 0 (sealed segments through the pool), then the pool's
  descriptors, its bound (``--descriptors-max``, a setting of the broker) and
  the process's open descriptors (``/proc/<pid>/fd``) are reported.

There is no peer here: the figures are compared with the issue's (1.65M
records/s at 1 range, 0.26M at 512; 5 s restart at 4,000 active segments;
7 s first write to 4,096 ranges; a failed store at 9,788 segments).

Targets (hard): produce at 512 ranges >= 0.8x the 1-range figure; restart
with 4,096 active segments < 1 s; first write to 4,096 new ranges < 1 s;
open descriptors at 20,000 segments <= the pool's bound.

    .venv/bin/python bench/northguard_scale.py            # full: 3 rounds, 5 generations
    .venv/bin/python bench/northguard_scale.py --quick    # 1 round, smaller
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from report import (  # bench/report.py: what every bench shares
    Rounds,
    bench_parser,
    cpu_s,
    delta,
    finish,
    frozen_heap,
    guard,
    prometheus_counters,
    rounds_of,
    storage_facts,
    target,
)

from backends.northguard.backend import NorthguardBackend
from backends.northguard.launcher import NorthguardProcess, start_northguard_broker
from xinfra.backend import ProducerOptions, ShardProducer
from xinfra.errors import Backpressure
from xinfra.keyspace import shard_ranges
from xinfra.model import ClusterKind, PhysicalCluster, Record

WIDTHS = (1, 8, 64, 512)
NEW_RANGES = 4096
SEGMENTS_GOAL = 20_000
LINGER_MS = 5.0
QUIET_WAIT_S = 30.0
RECORDS_PER_RUN = 4_000_000
"""Records per width run: 440 MB, several of the store's checkpoint cycles (one per second
or per 192 MiB WAL file).  At 500,000 (55 MB, under one cycle) whether a run paid for a
checkpoint and its segment writes depended on the runs around it: work a run left behind
its last acknowledgement landed in the next run, whatever its width.  The 512/1 ratio of
one round went from 0.58 to 0.83 with the order of the widths, and to 1.7 once that work
ran at a lower CPU priority (a 1-range run right after a 512-range one paid for both).
Runs this long measured 0.68-0.73 for the same code, before and after that change."""


def progress(message: str) -> None:
    print(f"[bench northguard_scale] {message}", file=sys.stderr, flush=True)


def backend_of(process: NorthguardProcess) -> NorthguardBackend:
    return NorthguardBackend(
        PhysicalCluster(
            name="ng",
            kind=ClusterKind.NORTHGUARD,
            bootstrap=process.url,
            attributes={"request_timeout_s": "120"},
        )
    )


def metrics(process: NorthguardProcess) -> dict[str, float]:
    return prometheus_counters(f"http://127.0.0.1:{process.http_port}/metrics", "northguard_")


async def produce(
    producer: ShardProducer, values: list[bytes], count: int, batch: int, width: int
) -> float:
    """Records/s of ``count`` records; every send's offsets are checked."""
    acked = [0]
    failures: list[BaseException] = []
    pending: set[asyncio.Future[list[int]]] = set()

    def on_done(future: asyncio.Future[list[int]]) -> None:
        pending.discard(future)
        error = future.exception()
        if error is not None:
            failures.append(error)
        else:
            offsets = future.result()
            if offsets != list(range(offsets[0], offsets[0] + len(offsets))):
                failures.append(AssertionError(f"offsets not contiguous: {offsets[:3]}..."))
            acked[0] += len(offsets)

    pool = len(values)
    with frozen_heap():
        started = time.perf_counter()
        n = 0
        while n < count:
            end = min(n + batch, count)
            records = [Record(values[i % pool]) for i in range(n, end)]
            shard = (n // batch) % width
            while True:
                try:
                    future = producer.send(shard, records)
                    break
                except Backpressure:
                    await asyncio.wait(set(pending), return_when=asyncio.FIRST_COMPLETED)
            pending.add(future)
            future.add_done_callback(on_done)
            n = end
            await asyncio.sleep(0)  # an application's await per send: linger timers can fire
        await producer.flush()
        elapsed = time.perf_counter() - started
    if failures or acked[0] != count:
        raise AssertionError(f"produce: {acked[0]}/{count} acknowledged, {failures[:3]}")
    return count / elapsed


async def quiet(process: NorthguardProcess) -> None:
    """Wait (untimed) until the WAL holds nothing (``northguard_store_wal_bytes``): every
    acknowledged frame is in a synced segment file, so the next width starts on a quiet store.

    A 512-range run ends with ~70 MB acknowledged and not yet in its files
    (``unwritten_mb_at_end``); without this wait the writes and the checkpoint
    that take it ran in the next run's window, which with the rotated order is
    the 1-range run in two rounds of three: it ran 5-20% slower there than
    when it went first, and the ratio came out higher (0.83 in one full run
    whose round with the 1-range run first gave 0.73).  Waiting for a checkpoint
    counted after the run instead never ended when the run's last checkpoint had
    already released everything before the run's closing scrape."""
    deadline = time.monotonic() + QUIET_WAIT_S
    while metrics(process).get("northguard_store_wal_bytes", 0.0) != 0:
        if time.monotonic() > deadline:
            raise AssertionError(f"the store was not quiet {QUIET_WAIT_S:g} s after a run")
        await asyncio.sleep(0.05)


def flush_facts(counts: dict[str, float]) -> dict[str, Any]:
    flushes = counts.get("northguard_store_flushes_total", 0.0)
    flush_fsyncs = counts.get("northguard_store_flush_fsyncs_total", 0.0)
    appends = counts.get("northguard_store_flushed_appends_total", 0.0)
    flush_s = counts.get("northguard_store_flush_seconds_total", 0.0)
    return {
        "flushes": int(flushes),
        "fsyncs_per_flush": round(flush_fsyncs / flushes, 2) if flushes else None,
        "flush_ms_mean": round(flush_s / flushes * 1000, 2) if flushes else None,
        "appends_per_flush": round(appends / flushes, 1) if flushes else None,
        "checkpoint_fsyncs": int(counts.get("northguard_store_checkpoint_fsyncs_total", 0.0)),
        "checkpoints": int(counts.get("northguard_store_checkpoints_total", 0.0)),
        "fsyncs": int(counts.get("northguard_store_fsyncs_total", 0.0)),  # every kind, everyone's
        "segment_writes": int(counts.get("northguard_store_segment_writes_total", 0.0)),
        "files_created": int(counts.get("northguard_store_segment_files_created_total", 0.0)),
        "file_create_s": round(
            counts.get("northguard_store_segment_file_create_seconds_total", 0.0), 4
        ),
    }


async def throughput_round(
    number: int, process: NorthguardProcess, values: list[bytes], args: argparse.Namespace
) -> tuple[dict[str, float], dict[str, Any]]:
    figures: dict[str, float] = {}
    facts: dict[str, Any] = {}
    shift = number % len(WIDTHS)
    order = list(WIDTHS[shift:]) + list(WIDTHS[:shift])
    backend = backend_of(process)
    try:
        for width in order:
            topic = f"tp-{number}-{width}"
            await backend.create_topic(topic, shard_ranges(width))
            producer = backend.producer(topic, ProducerOptions(linger_ms=LINGER_MS))
            before = metrics(process)
            cpu_before = (time.process_time(), cpu_s(process.pid))
            rate = await produce(producer, values, args.records, args.batch, width)
            cpu_after = (time.process_time(), cpu_s(process.pid))
            after = metrics(process)
            await producer.close()
            await quiet(process)
            figures[f"produce_{width}_ranges_records_per_s"] = rate
            facts[f"width_{width}"] = {
                **flush_facts(delta(before, after)),
                "client_cpu_s": round(cpu_after[0] - cpu_before[0], 2),
                "broker_cpu_s": round(cpu_after[1] - cpu_before[1], 2),
                # left for the checkpoint that ``quiet`` waits for, outside every run's window
                "unwritten_mb_at_end": round(
                    after.get("northguard_store_unwritten_bytes", 0.0) / 1e6, 1
                ),
            }
            progress(f"round {number + 1}: {width} ranges: {rate:,.0f} records/s")
    finally:
        await backend.close()
    return figures, facts


async def first_write(process: NorthguardProcess, topic: str) -> float:
    """Seconds from the first send to the last acknowledgement, one record to each new range."""
    backend = backend_of(process)
    try:
        await backend.create_topic(topic, shard_ranges(NEW_RANGES))
        producer = backend.producer(topic, ProducerOptions(linger_ms=1.0))
        started = time.perf_counter()
        results = await asyncio.gather(
            *(producer.send(s, [Record(b"%d" % s)]) for s in range(NEW_RANGES))
        )
        elapsed = time.perf_counter() - started
        await producer.close()
        if any(offsets != [0] for offsets in results):
            raise AssertionError("a first write was not acknowledged at offset 0")
    finally:
        await backend.close()
    return elapsed


def restart(process: NorthguardProcess) -> tuple[float, float]:
    """SIGTERM, then a new process: (seconds from spawn to serving, the broker's own start)."""
    process.stop()
    started = time.perf_counter()
    process.restart()
    elapsed = time.perf_counter() - started
    return elapsed, metrics(process).get("northguard_start_seconds", float("nan"))


async def read_back(process: NorthguardProcess, topic: str) -> None:
    """Every range of ``topic`` from offset 0: one record each, its value checked."""
    backend = backend_of(process)
    reader = backend.reader(topic)
    try:
        reader.assign(dict.fromkeys(range(NEW_RANGES), 0))
        got: dict[int, bytes | None] = {}
        deadline = time.monotonic() + 300
        while len(got) < NEW_RANGES:
            if time.monotonic() > deadline:
                raise AssertionError(f"read back only {len(got)} of {NEW_RANGES} ranges")
            for record in await reader.poll(max_records=NEW_RANGES, timeout_s=1.0):
                got[record.shard] = record.value
        if got != {s: b"%d" % s for s in range(NEW_RANGES)}:
            raise AssertionError("read back values differ from those written")
    finally:
        await reader.close()
        await backend.close()


async def run(args: argparse.Namespace) -> tuple[Rounds, dict[str, Any]]:
    rounds = Rounds()
    facts: dict[str, Any] = {}
    values = [os.urandom(100) for _ in range(1024)]
    with tempfile.TemporaryDirectory(prefix="bench-ng-scale-", dir=args.dir) as run_dir:
        data_dir = Path(run_dir) / "ng-data"
        process = start_northguard_broker(
            data_dir,
            log_path=Path(run_dir) / "ng.log",
            extra_args=["--descriptors-max", str(args.descriptors_max)],
        )
        try:
            facts.update(storage_facts(data_dir))
            warm = backend_of(process)
            await warm.create_topic("warm", shard_ranges(8))
            producer = warm.producer("warm", ProducerOptions(linger_ms=LINGER_MS))
            await produce(producer, values, args.records // 4, args.batch, 8)
            await producer.close()
            await warm.close()
            await quiet(process)  # round 1's first width starts quiet too
            for number in range(args.rounds):
                figures, width_facts = await throughput_round(number, process, values, args)
                rounds.update(figures)
                facts[f"round_{number + 1}"] = width_facts
            rounds.ratio(
                "produce_512_vs_1_ratio",
                "produce_512_ranges_records_per_s",
                "produce_1_ranges_records_per_s",
            )
            generation = 0
            while generation < args.generations:
                seconds = await first_write(process, f"fw-{generation}")
                rounds.add("first_write_4096_ranges_s", seconds)
                active = metrics(process).get("northguard_store_segments", 0.0)
                restart_s, start_s = restart(process)
                rounds.add("restart_4096_active_s", restart_s)
                rounds.add("restart_4096_active_broker_start_s", start_s)
                generation += 1
                progress(
                    f"generation {generation}: first write {seconds:.3f} s, restart "
                    f"{restart_s:.3f} s (broker start {start_s:.3f} s) with {active:.0f} segments"
                )
            await read_back(process, "fw-0")
            now = metrics(process)
            assert process.popen is not None
            descriptors = len(os.listdir(f"/proc/{process.popen.pid}/fd"))
            rounds.set("segments", int(now["northguard_store_segments"]))
            rounds.set("pool_descriptors", int(now["northguard_store_pool_descriptors"]))
            rounds.set("pool_descriptors_max", int(now["northguard_store_pool_descriptors_max"]))
            rounds.set("process_open_descriptors", descriptors)
            rounds.set("snapshot_bytes", int(now.get("northguard_snapshot_bytes", 0)))
            rounds.set(
                "snapshot_build_s", round(now.get("northguard_snapshot_build_seconds", 0.0), 3)
            )
            rounds.set("snapshots", int(now.get("northguard_snapshots_total", 0)))
        finally:
            process.stop()
    return rounds, facts


def main() -> None:
    parser = bench_parser(__doc__, rounds_default=3)
    parser.add_argument("--records", type=int, default=0, help="100-byte records per width run")
    parser.add_argument("--batch", type=int, default=100, help="records per send call")
    parser.add_argument(
        "--generations",
        type=int,
        default=0,
        help="first writes to 4,096 new ranges, each followed by a restart (default: enough "
        "for 20,000 segments; 2 with --quick)",
    )
    parser.add_argument("--descriptors-max", type=int, default=1024, help="the pool's bound")
    parser.add_argument("--dir", default=None, help="where the data directory goes")
    args = parser.parse_args()
    args.rounds = rounds_of(args)
    args.records = args.records or (1_000_000 if args.quick else RECORDS_PER_RUN)
    args.generations = args.generations or (2 if args.quick else -(-SEGMENTS_GOAL // NEW_RANGES))
    rounds, facts = asyncio.run(run(args))
    figures = rounds.figures()
    figures["rounds"] = args.rounds
    targets = {
        "produce_512_vs_1_ratio": target(figures["produce_512_vs_1_ratio"], 0.8),
        "restart_4096_active_s": target(figures["restart_4096_active_s"], 1.0, "<="),
        "first_write_4096_ranges_s": target(figures["first_write_4096_ranges_s"], 1.0, "<="),
        "open_descriptors_bounded": target(
            figures["pool_descriptors"], figures["pool_descriptors_max"], "<="
        ),
    }
    if not args.quick and figures["segments"] < SEGMENTS_GOAL:
        targets["segments_reached"] = target(figures["segments"], SEGMENTS_GOAL)
    finish(
        "northguard_scale",
        figures,
        targets,
        no_fail=args.no_fail,
        spread=rounds.spread(),
        config={
            "records": args.records,
            "value_bytes": 100,
            "batch": args.batch,
            "linger_ms": LINGER_MS,
            "widths": list(WIDTHS),
            "new_ranges": NEW_RANGES,
            "generations": args.generations,
            "descriptors_max": args.descriptors_max,
        },
        **facts,
    )


if __name__ == "__main__":
    guard("northguard_scale", main)
