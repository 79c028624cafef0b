"""The SDK's cost over the bare backend: produce and consume records/s, same run, same broker.

Set-up (started here): tansu (``start_kafka``), a Northguard broker when
``backends.northguard.launcher`` exists, and a metadata service in-process
(uvicorn in a thread, SQLite) with both clusters registered.

For each backend, on a topic of ``SHARDS`` shards, ``records`` records of a
``KEY_BYTES``-byte key and a ``VALUE_BYTES``-byte value:

* bare produce: the same ``Record`` objects routed by key (``shard_of_key``,
  inside the timed part: a keyed topic needs it with or without the SDK) into
  per-shard batches of ``BARE_BATCH_RECORDS``, sent with ``ShardProducer.send``,
  at most ``BARE_WINDOW`` batches in flight: what a careful user of the backend gets.
* SDK produce: ``XinfraProducer.send_batch`` of the same ``BARE_BATCH_RECORDS``
  records per call (key routing, batching, back-pressure, positions all
  included), then ``flush``: the like-for-like figure the target is on.
* SDK produce per record: ``XinfraProducer.send`` one record at a time, a
  future each (Kafka-client style); reported beside, no target.
* bare consume / SDK consume: a ``ShardReader`` over every shard, and an
  ``XinfraConsumer`` assigned the virtual topic, each reading the same physical
  topic (the one the SDK wrote) from the start until every record is back.

Each round runs every loop once on fresh topics; ``--quick`` and full runs
both do three rounds.  Rates are medians over rounds, ratios the median of the
per-round paired ratios (a shared 2-core machine is noisy).  Each timed loop
runs under ``frozen_heap`` (bench/report.py): the records the bench prepared
are kept out of the collector's full scans, while garbage the timed code makes
is collected as usual.

Targets: SDK / bare >= 0.8 for produce and consume on every backend run.

    .venv/bin/python bench/sdk.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import statistics
import sys
import tempfile
import threading
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import uvicorn  # noqa: E402
from report import emit, frozen_heap, target  # noqa: E402  (bench/report.py: the shape every bench prints)

from clients import XinfraConsumerOptions, open_consumer, open_producer  # noqa: E402
from metadata_service import ServiceConfig, create_app  # noqa: E402
from xinfra.backend import Backend, ShardProducer, open_backend  # noqa: E402
from xinfra.keyspace import shard_of_key, shard_ranges  # noqa: E402
from xinfra.model import ClusterKind, PhysicalCluster, Record  # noqa: E402
from xinfra.rest import MetadataClient  # noqa: E402
from xinfra.services.kafka import start_kafka  # noqa: E402
from xinfra.services.ports import free_port  # noqa: E402

TOKEN = "bench-" + uuid.uuid4().hex
VC = "default"
SHARDS = 4
KEY_BYTES = 8
VALUE_BYTES = 100
BARE_BATCH_RECORDS = 1000
BARE_WINDOW = 16
TARGET_RATIO = 0.8


def log(message: str) -> None:
    print(f"[bench sdk] {message}", file=sys.stderr, flush=True)


class Service:
    """The metadata service under uvicorn in a thread of this process."""

    def __init__(self, run_dir: Path) -> None:
        self.port = free_port()
        config = ServiceConfig(
            database_url=f"sqlite:///{run_dir / 'metadata.db'}",
            run_dir=run_dir,
            admin_token=TOKEN,
            backend_factory=open_backend,
            long_poll_s_max=5.0,
        )
        self.server = uvicorn.Server(
            uvicorn.Config(
                create_app(config),
                host="127.0.0.1",
                port=self.port,
                log_level="warning",
                timeout_graceful_shutdown=1,
            )
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the metadata service did not start")
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


def start_northguard(run_dir: Path) -> tuple[str, Any] | None:
    """``(bootstrap, handle with stop())`` of a Northguard broker, or None while it is absent."""
    try:
        importlib.import_module("backends.northguard.backend")
        launcher = importlib.import_module("backends.northguard.launcher")
    except ImportError as error:
        log(f"Northguard skipped: {error}")
        return None
    for name in ("start_northguard", "start_cluster", "start_broker"):
        start = getattr(launcher, name, None)
        if start is not None:
            handle = start(run_dir / "northguard")
            bootstrap = getattr(handle, "url", None) or getattr(handle, "bootstrap", None)
            return str(bootstrap), handle
    log("Northguard skipped: backends.northguard.launcher has no start function this bench knows")
    return None


def make_records(count: int) -> list[tuple[bytes, bytes]]:
    value = b"v" * VALUE_BYTES
    return [(b"%08d" % (i % 100_000), value) for i in range(count)]


async def bare_produce(backend: Backend, topic: str, records: list[tuple[bytes, bytes]]) -> float:
    await backend.create_topic(topic, shard_ranges(SHARDS))
    built = [Record(value, key) for key, value in records]
    producer = backend.producer(topic)
    with frozen_heap():
        return await _bare_produce(producer, built)


async def _bare_produce(producer: ShardProducer, built: list[Record]) -> float:
    started = time.perf_counter()
    per_shard: dict[int, list[Record]] = {}
    for record in built:
        per_shard.setdefault(shard_of_key(record.key or b"", SHARDS), []).append(record)
    batches = [
        (shard, rs[i : i + BARE_BATCH_RECORDS])
        for shard, rs in per_shard.items()
        for i in range(0, len(rs), BARE_BATCH_RECORDS)
    ]
    in_flight: set[asyncio.Future[list[int]]] = set()
    for shard, batch in batches:
        if len(in_flight) >= BARE_WINDOW:
            done, in_flight = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                future.result()
        in_flight.add(producer.send(shard, batch))
    for future in asyncio.as_completed(in_flight):
        await future
    await producer.flush()
    elapsed_s = time.perf_counter() - started
    await producer.close()
    return len(built) / elapsed_s


async def sdk_produce(
    url: str, topic: str, records: list[tuple[bytes, bytes]], per_record: bool
) -> float:
    producer = await open_producer(url, TOKEN, VC, topics=[topic])
    try:
        futures: list[asyncio.Future[Any]] = []
        built = [Record(value, key) for key, value in records]
        with frozen_heap():
            started = time.perf_counter()
            if per_record:
                for key, value in records:
                    futures.append(await producer.send(topic, value, key=key))
            else:
                for i in range(0, len(built), BARE_BATCH_RECORDS):
                    batch = built[i : i + BARE_BATCH_RECORDS]
                    futures.append(await producer.send_batch(topic, batch))
            await producer.flush()
            elapsed_s = time.perf_counter() - started
        failed = [f for f in futures if f.exception() is not None]
        if failed:
            raise RuntimeError(f"{len(failed)} records failed: {failed[0].exception()}")
        return len(records) / elapsed_s
    finally:
        await producer.close()


async def bare_consume(backend: Backend, physical: str, expected: int) -> float:
    reader = backend.reader(physical)
    try:
        reader.assign(dict.fromkeys(range(SHARDS), 0))
        count = 0
        with frozen_heap():
            started = time.perf_counter()
            while count < expected:
                count += len(await reader.poll(5000, timeout_s=1.0))
            return expected / (time.perf_counter() - started)
    finally:
        await reader.close()


async def sdk_consume(url: str, topic: str, expected: int) -> float:
    consumer = await open_consumer(url, TOKEN, VC, options=XinfraConsumerOptions(), topics=[topic])
    try:
        await consumer.assign(topic)
        count = 0
        with frozen_heap():
            started = time.perf_counter()
            while count < expected:
                count += len(await consumer.poll(5000, timeout_s=1.0))
            return expected / (time.perf_counter() - started)
    finally:
        await consumer.close()


async def measure(
    name: str, cluster: PhysicalCluster, url: str, records: list[tuple[bytes, bytes]], rounds: int
) -> dict[str, float]:
    """Bare and SDK loops alternate for ``rounds`` rounds; rates are medians, ratios paired medians."""
    backend = open_backend(cluster)
    rates: dict[str, list[float]] = {
        op: [] for op in ("bare_p", "sdk_p", "sdk_r", "bare_c", "sdk_c", "ratio_p", "ratio_c")
    }
    try:
        # Warm both paths (connections, metadata) on a few records first.
        await bare_produce(backend, f"bench-warm-{uuid.uuid4().hex[:8]}", records[:2000])
        for round_ in range(rounds):
            bare_topic = f"bench-bare-{uuid.uuid4().hex[:8]}"
            virtual = f"bench-sdk-{uuid.uuid4().hex[:8]}"
            per_record_topic = f"bench-sdk-send-{uuid.uuid4().hex[:8]}"
            with MetadataClient(url, token=TOKEN) as admin:
                metadata = admin.create_topic(VC, virtual, cluster.name, SHARDS)
                admin.create_topic(VC, per_record_topic, cluster.name, SHARDS)
            physical = metadata.current_epoch.physical_topic
            bare_p = await bare_produce(backend, bare_topic, records)
            sdk_p = await sdk_produce(url, virtual, records, per_record=False)
            sdk_r = await sdk_produce(url, per_record_topic, records, per_record=True)
            bare_c = await bare_consume(backend, physical, len(records))
            sdk_c = await sdk_consume(url, virtual, len(records))
            for op, value in (
                ("bare_p", bare_p),
                ("sdk_p", sdk_p),
                ("sdk_r", sdk_r),
                ("bare_c", bare_c),
                ("sdk_c", sdk_c),
                ("ratio_p", sdk_p / bare_p),
                ("ratio_c", sdk_c / bare_c),
            ):
                rates[op].append(value)
            log(
                f"{name} round {round_}: produce bare {bare_p:,.0f}/s, SDK send_batch "
                f"{sdk_p:,.0f}/s, SDK send {sdk_r:,.0f}/s; consume bare {bare_c:,.0f}/s, "
                f"SDK {sdk_c:,.0f}/s"
            )
    finally:
        await backend.close()
    m = {op: statistics.median(values) for op, values in rates.items()}
    return {
        f"{name}_bare_produce_records_per_s": round(m["bare_p"]),
        f"{name}_sdk_produce_records_per_s": round(m["sdk_p"]),
        f"{name}_sdk_send_per_record_records_per_s": round(m["sdk_r"]),
        f"{name}_send_per_record_ratio": round(m["sdk_r"] / m["bare_p"], 3),
        f"{name}_bare_consume_records_per_s": round(m["bare_c"]),
        f"{name}_sdk_consume_records_per_s": round(m["sdk_c"]),
        f"{name}_produce_ratio": round(m["ratio_p"], 3),
        f"{name}_consume_ratio": round(m["ratio_c"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="Reduced size, under a minute.")
    args = parser.parse_args()
    count = 50_000 if args.quick else 300_000
    rounds = 3
    records = make_records(count)
    figures: dict[str, float] = {
        "records": count,
        "rounds": rounds,
        "value_bytes": VALUE_BYTES,
        "shards": SHARDS,
    }
    targets: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory(prefix="xinfra-bench-sdk-") as tmp, ExitStack() as stack:
        run_dir = Path(tmp)
        kafka = start_kafka(run_dir / "kafka")
        stack.callback(kafka.stop)
        service = Service(run_dir / "service")
        stack.callback(service.stop)
        clusters = [PhysicalCluster(name="kafka", kind=ClusterKind.KAFKA, bootstrap=kafka.url)]
        northguard = start_northguard(run_dir)
        if northguard is not None:
            stack.callback(northguard[1].stop)
            clusters.append(
                PhysicalCluster(
                    name="northguard", kind=ClusterKind.NORTHGUARD, bootstrap=northguard[0]
                )
            )
        with MetadataClient(service.url, token=TOKEN) as admin:
            for cluster in clusters:
                admin.register_cluster(cluster)
        for cluster in clusters:
            figures.update(
                asyncio.run(measure(cluster.name, cluster, service.url, records, rounds))
            )
            for op in ("produce", "consume"):
                name = f"{cluster.name}_{op}_ratio"
                targets[name] = target(figures[name], TARGET_RATIO)
    emit("sdk", figures, targets)


if __name__ == "__main__":
    main()
