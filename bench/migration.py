"""Live migration Kafka -> Northguard: the producer's stall during dual writes, and 100 topics moved.

Set-up (started here): tansu (the Kafka side, memory-only), one Northguard
broker (fps store) and the metadata service as its own process (``python -m
metadata_service serve`` on SQLite, the embedded default of ``xinfra up``), so
the service does not share this process's interpreter with the measured
producer.

Produce latency, per round, on a fresh topic of ``SHARDS`` shards on Kafka:
one SDK producer (``XinfraProducer``, linger 2 ms) sends keyed 100-byte
records open-loop at ``rate`` records/s (latency counted from each record's
scheduled time to its acknowledgement: a stall shows in every record
scheduled during it).  Two measured windows of ``window_s`` each:

* ``source``: the topic on Kafka alone (before any migration);
* ``dual``: dual writes (Kafka first, then Northguard, per shard in order; a
  send is acknowledged once both hold it).

Rounds alternate which window goes first: even rounds measure ``source``,
advance to dual writes, measure ``dual``, then time the cut-over step
(``cutover_*``: records scheduled while the step runs) and measure ``target``
(Northguard alone, after the cut-over: a send during dual writes waits for the
source, then for the target, since the target record carries the source
position, so ``dual`` is about ``source`` + ``target``); odd rounds advance
first, measure ``dual``, roll back, then measure ``source``.  Records
scheduled during a step or the warm-up are in no window.  A consumer in this
process reads the topic throughout (``assign``, through the epochs);
``*_consumer_lag_*`` is, per window, the time from a record's scheduled send
to its delivery (the cut-over's: readers wait for the source's end offsets,
then cross into the target).  It must deliver every record once.  Every send's
outcome is checked (a failed send stops the bench).  ``dual_over_source_p99``
is the median of the per-round ratios.

100 idle topics, per round: ``topics`` new topics (2 shards each, no
clients) on Kafka, listed in a file; timed from the start to the exit of
``xinfra migrate run --topics-from FILE --to northguard --parallel N --json``
(a subprocess: CLI start-up included), which must report every topic
completed.

Targets (issue 13): dual-write p99 < 2x source p99; 100 topics < 60 s.

    .venv/bin/python bench/migration.py --quick
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from report import (  # noqa: E402  (bench/report.py: what every bench shares)
    OpenLoop,
    Rounds,
    alternating,
    bench_parser,
    delta,
    finish,
    guard,
    percentile,
    prometheus_counters,
    report_only,
    rounds_of,
    storage_facts,
    target,
)
from service import start_metadata_service  # noqa: E402

from backends.northguard.launcher import start_northguard_broker  # noqa: E402
from clients import XinfraProducerOptions, open_consumer, open_producer  # noqa: E402
from xinfra.model import ClusterKind, PhysicalCluster, Position  # noqa: E402
from xinfra.rest import MetadataClient  # noqa: E402
from xinfra.services.kafka import start_kafka  # noqa: E402

BENCH = "migration"
TOKEN = "bench-admin-" + uuid.uuid4().hex
VC = "default"
SHARDS = 4
KEYS = 64
VALUE_BYTES = 100
LINGER_MS = 2.0
IDLE_SHARDS = 2
TARGET_P99_RATIO = 2.0
TARGET_TOPICS_S = 60.0
SIDES = ("source", "dual")


def log(message: str) -> None:
    print(f"[bench migration] {message}", file=sys.stderr, flush=True)


class Load:
    """One producer on an open-loop schedule; each record's latency, by its scheduled time."""

    def __init__(self, url: str, topic: str, rate: float) -> None:
        self.url, self.topic = url, topic
        self.schedule = OpenLoop(rate, duration_s=24 * 3600)
        self.latencies: list[tuple[float, float]] = []
        """(scheduled perf_counter time, latency ms) of every acknowledged record."""
        self.failed: list[str] = []
        self.padding = os.urandom(VALUE_BYTES - 8)
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.sent = 0

    async def start(self) -> None:
        self.producer = await open_producer(
            self.url, TOKEN, VC, XinfraProducerOptions(linger_ms=LINGER_MS), topics=[self.topic]
        )
        self.schedule.begin()
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while not self._stop.is_set():
            for index in self.schedule.due():
                key = b"key-%d" % (index % KEYS)
                value = index.to_bytes(8, "big") + self.padding  # the reader finds its index
                future = await self.producer.send(self.topic, value, key=key)
                future.add_done_callback(lambda f, i=index: self._done(i, f))  # type: ignore[misc]
                self.sent += 1
            await asyncio.sleep(self.schedule.wait_s())

    def _done(self, index: int, future: asyncio.Future[Position]) -> None:
        error = future.exception()
        if error is not None:
            self.failed.append(str(error))
            return
        self.latencies.append((self.schedule.scheduled(index), self.schedule.latency_ms(index)))

    async def stop(self) -> None:
        self._stop.set()
        assert self._task is not None
        await self._task
        await self.producer.flush()
        await self.producer.close()
        if self.failed:
            raise AssertionError(f"{len(self.failed)} sends failed, e.g. {self.failed[:3]}")
        if len(self.latencies) != self.sent:
            raise AssertionError(f"{self.sent} sent, {len(self.latencies)} acknowledged")

    def window(self, start: float, end: float) -> list[float]:
        return [ms for at, ms in self.latencies if start <= at < end]


class Reader:
    """One consumer reading the topic while it moves: when each record arrived, each once."""

    def __init__(self, url: str, topic: str) -> None:
        self.url, self.topic = url, topic
        self.received: dict[int, float] = {}
        self.twice = 0
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.consumer = await open_consumer(self.url, TOKEN, VC, topics=[self.topic])
        await self.consumer.assign(self.topic)
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while not self._stop.is_set():
            records = await self.consumer.poll(5000, timeout_s=0.1)
            now = time.perf_counter()
            for record in records:
                index = int.from_bytes((record.value or b"")[:8], "big")
                if index in self.received:
                    self.twice += 1
                else:
                    self.received[index] = now

    async def stop(self, load: Load) -> None:
        """Once every acknowledged record arrived (or 60 s): each once, none missing."""
        deadline = time.monotonic() + 60
        while len(self.received) < load.sent and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # the reader catching up, bounded
        self._stop.set()
        assert self._task is not None
        await self._task
        await self.consumer.close()
        if len(self.received) != load.sent or self.twice:
            raise AssertionError(
                f"read {len(self.received)} of {load.sent} records, {self.twice} twice"
            )

    def lags(self, load: Load, start: float, end: float) -> list[float]:
        """Delivery lag (ms from the record's scheduled send) of the records scheduled in a window."""
        return [
            (self.received[i] - load.schedule.scheduled(i)) * 1000
            for i in range(load.sent)
            if start <= load.schedule.scheduled(i) < end
        ]


async def latency_round(
    number: int, order: list[str], admin: MetadataClient, url: str, args: Any
) -> dict[str, float]:
    topic = f"lat-{number}"
    path = f"/v1/vclusters/{VC}/topics/{topic}/migration"
    await asyncio.to_thread(admin.create_topic, VC, topic, "kafka", SHARDS)

    def step(suffix: str, **body: Any) -> dict[str, Any]:
        answer: dict[str, Any] = admin.request("POST", path + suffix, json=body, timeout_s=120)
        if answer.get("paused"):
            raise AssertionError(f"{topic}: step paused, late clients {answer['late_clients']}")
        return answer

    load = Load(url, topic, args.rate)
    reader = Reader(url, topic)
    await reader.start()
    await load.start()
    windows: dict[str, tuple[float, float]] = {}

    async def measure(name: str) -> None:
        start = time.perf_counter()
        await asyncio.sleep(args.window_s)  # the measured window: the load runs meanwhile
        windows[name] = (start, time.perf_counter())

    try:
        await asyncio.sleep(args.warmup_s)  # connections, first metadata, code paths
        await asyncio.to_thread(step, "", target_cluster="northguard")
        if order[0] == "source":
            await measure("source")
            await asyncio.to_thread(step, "/advance", expected_state="dual_write")
            await measure("dual")
            begin = time.perf_counter()
            await asyncio.to_thread(step, "/advance", expected_state="cut_over")
            windows["cutover"] = (begin, time.perf_counter())
            await measure("target")  # Northguard alone: what dual writes add to the source
        else:
            await asyncio.to_thread(step, "/advance", expected_state="dual_write")
            await measure("dual")
            await asyncio.to_thread(step, "/rollback")
            await measure("source")
    finally:
        await load.stop()
        await reader.stop(load)
    figures: dict[str, float] = {}
    for name, (start, end) in windows.items():
        values = load.window(start, end)
        if not values:
            raise AssertionError(f"no record acknowledged in window {name}")
        figures[f"{name}_p99_ms"] = percentile(values, 0.99)
        figures[f"{name}_max_ms"] = max(values)
        figures[f"{name}_records"] = len(values)
        lags = reader.lags(load, start, end)
        figures[f"{name}_consumer_lag_p99_ms"] = percentile(lags, 0.99)
        figures[f"{name}_consumer_lag_max_ms"] = max(lags)
    if "cutover" in windows:
        figures["cutover_s"] = windows["cutover"][1] - windows["cutover"][0]
    return figures


def topics_round(number: int, admin: MetadataClient, url: str, work: Path, args: Any) -> float:
    names = [f"idle-{number}-{i:03d}" for i in range(args.topics)]
    for name in names:
        admin.create_topic(VC, name, "kafka", IDLE_SHARDS)
    listing = work / f"topics-{number}.txt"
    listing.write_text("\n".join(names) + "\n")
    env = {
        **os.environ,
        "XINFRA_METADATA_URL": url,
        "XINFRA_TOKEN": TOKEN,
        "XINFRA_VIRTUAL_CLUSTER": VC,
    }
    argv = [str(ROOT / ".venv" / "bin" / "xinfra"), "migrate", "run", "--topics-from"]
    argv += [str(listing), "--to", "northguard", "--parallel", str(args.parallel), "--json"]
    started = time.perf_counter()
    result = subprocess.run(argv, capture_output=True, env=env, timeout=600, check=False)
    elapsed = time.perf_counter() - started
    if result.returncode != 0:
        raise AssertionError(f"xinfra migrate run exited {result.returncode}: {result.stderr!r}")
    body = json.loads(result.stdout)
    if body["completed"] != len(names) or body["failed"]:
        raise AssertionError(f"not every topic completed: {body['failed']} failed")
    return elapsed


def main() -> None:
    parser = bench_parser(__doc__, rounds_default=4)  # even: each window goes first as often
    parser.add_argument("--rate", type=float, default=0, help="records/s of the producer")
    parser.add_argument("--window-s", type=float, default=0, help="seconds per measured window")
    parser.add_argument("--warmup-s", type=float, default=2.0)
    parser.add_argument("--topics", type=int, default=100, help="idle topics migrated at once")
    parser.add_argument("--parallel", type=int, default=8, help="xinfra migrate run --parallel")
    args = parser.parse_args()
    args.rate = args.rate or (500.0 if args.quick else 1000.0)
    args.window_s = args.window_s or (3.0 if args.quick else 6.0)
    rounds_n = rounds_of(args)
    rounds = Rounds()
    rounds.set("rounds", rounds_n)
    facts: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="xinfra-bench-migration-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        kafka = start_kafka(work / "kafka")
        stack.callback(kafka.stop)
        ng_data = work / "northguard" / "data"
        northguard = start_northguard_broker(ng_data, log_path=work / "northguard.log")
        stack.callback(northguard.stop)
        service = start_metadata_service(
            work, "service", admin_token=TOKEN, database_url=f"sqlite:///{work / 'metadata.db'}"
        )
        stack.callback(service.stop)
        metrics_url = f"http://127.0.0.1:{northguard.http_port}/metrics"
        with MetadataClient(service.url, token=TOKEN, timeout_s=120) as admin:
            admin.register_cluster(
                PhysicalCluster(name="kafka", kind=ClusterKind.KAFKA, bootstrap=kafka.url)
            )
            admin.register_cluster(
                PhysicalCluster(
                    name="northguard", kind=ClusterKind.NORTHGUARD, bootstrap=northguard.url
                )
            )
            before = prometheus_counters(metrics_url, "northguard_store_")
            for number, order in enumerate(alternating(rounds_n, list(SIDES))):
                got = asyncio.run(latency_round(number, order, admin, service.url, args))
                got["dual_over_source_p99"] = got["dual_p99_ms"] / got["source_p99_ms"]
                if "target_p99_ms" in got:  # how far dual writes are from source + target in series
                    serial = got["source_p99_ms"] + got["target_p99_ms"]
                    got["dual_over_serial_p99"] = got["dual_p99_ms"] / serial
                rounds.update(got)
                log(
                    f"round {number} ({' first, '.join(order)} second): p99 source "
                    f"{got['source_p99_ms']:.1f} ms, dual {got['dual_p99_ms']:.1f} ms "
                    f"({got['dual_over_source_p99']:.2f}x); max source {got['source_max_ms']:.1f}"
                    f" ms, dual {got['dual_max_ms']:.1f} ms"
                )
                wall = topics_round(number, admin, service.url, work, args)
                rounds.add("topics_migrate_s", wall)
                log(f"round {number}: {args.topics} idle topics migrated in {wall:.1f} s")
            after = prometheus_counters(metrics_url, "northguard_store_")
        counted = delta(before, after)
        facts = {
            **{f"northguard_{k}": v for k, v in storage_facts(ng_data).items()},
            "northguard_fsyncs": int(counted.get("northguard_store_fsyncs_total", 0)),
            "northguard_flushes": int(counted.get("northguard_store_flushes_total", 0)),
        }
    figures = rounds.figures()
    targets = {
        "dual_over_source_p99": target(figures["dual_over_source_p99"], TARGET_P99_RATIO, "<="),
        "topics_migrate_s": target(figures["topics_migrate_s"], TARGET_TOPICS_S, "<="),
        "dual_max_over_source_max": report_only(
            figures["dual_max_ms"] / figures["source_max_ms"], TARGET_P99_RATIO, "<="
        ),
    }
    finish(
        BENCH,
        figures,
        targets,
        no_fail=args.no_fail,
        spread=rounds.spread(),
        config={
            "producer": {
                "client": "one XinfraProducer, send() per record, open-loop",
                "rate_per_s": args.rate,
                "linger_ms": LINGER_MS,
                "value_bytes": VALUE_BYTES,
                "keys": KEYS,
                "shards": SHARDS,
            },
            "window_s": args.window_s,
            "warmup_s": args.warmup_s,
            "order": "even rounds source then dual (then the cut-over step); odd rounds dual, "
            "rollback, then source",
            "topics": args.topics,
            "topic_shards": IDLE_SHARDS,
            "parallel": args.parallel,
            "ack_timeout_s": 30.0,
            "metadata_service": "its own process, SQLite (the embedded default), notify local",
        },
        peer="none: the same producer before and during dual writes; tansu keeps data in memory, "
        "Northguard fsyncs (counters in machine)",
        quick=args.quick,
        **facts,
    )


if __name__ == "__main__":
    guard(BENCH, main)
