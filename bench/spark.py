"""Spark's batch read of a virtual topic across two epochs against the SDK consumer, same records.

Set-up (started here, like ``bench/sdk.py``): tansu, a Northguard broker and
an in-process metadata service.  One virtual topic of ``SHARDS`` shards gets
``records`` records (``KEY_BYTES``-byte keys, ``VALUE_BYTES``-byte values from
a pool of distinct ones) through the SDK producer: the first half while its
epoch 0 lives on Kafka (tansu), then an epoch 1 on Northguard is added (epoch 0
sealed at its end offsets) and the second half goes there.  Every send's
position is kept: the ledger says how many records each (epoch, shard) holds.

Timed, each round, both sides reading the whole topic from the start:

* Spark: ``spark.read.format("xinfra")`` on a ``local[2]`` session (both
  cores), planning included, aggregated per (epoch, shard) in the same job:
  count, the sum of the values' CRC32s, lowest and highest offset.  The
  SparkSession and its JVM start once, before the rounds (a long-lived
  cluster), and one read warms the Python workers;
* SDK: one ``XinfraConsumer`` in this process, ``assign(topic)`` and ``poll``
  until every record is back, checking count, the CRC32 sum of the values and
  offset continuity per (epoch, shard) in the timed loop.

Both sides are checked against the ledger (count, checksum, every (epoch,
shard) from offset 0 to its end, no gap).  Rounds are paired and alternate
which side goes first; figures are medians with the min-max spread, the ratio
the median of the per-round ratios.

Target: Spark / SDK >= 1.0 (the point of Spark is to read wider than one process).

    .venv/bin/python bench/spark.py --quick
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
import zlib
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from report import (  # noqa: E402  (bench/report.py: what every bench shares)
    ReadCheck,
    Rounds,
    alternating,
    bench_parser,
    finish,
    frozen_heap,
    guard,
    rounds_of,
    storage_facts,
    target,
)
from sdk import TOKEN, VC, Service  # noqa: E402  (the in-process metadata service)

from backends.northguard.launcher import start_northguard_broker  # noqa: E402
from clients import XinfraConsumerOptions, open_consumer, open_producer  # noqa: E402
from xinfra.model import ClusterKind, PhysicalCluster, Record  # noqa: E402
from xinfra.rest import MetadataClient  # noqa: E402
from xinfra.services.kafka import start_kafka  # noqa: E402

SHARDS = 4
KEY_BYTES = 8
VALUE_BYTES = 100
VALUE_POOL = 4096
BATCH_RECORDS = 1000
POLL_RECORDS = 5000
TARGET_RATIO = 1.0
SIDES = ("spark", "sdk")
TOPIC = "bench-spark"
SPARK_MASTER = "local[2]"

Ends = dict[tuple[int, int], int]
"""(epoch, shard) -> the offset after its last record."""


def log(message: str) -> None:
    print(f"[bench spark] {message}", file=sys.stderr, flush=True)


class Ledger:
    """What a reader must find: count, value checksum, and the end of every (epoch, shard)."""

    def __init__(self) -> None:
        self.count = 0
        self.checksum = 0
        self.ends: Ends = {}

    def verify(self, side: str, count: int, checksum: int, ends: Ends, gaps: int) -> None:
        problems = []
        if count != self.count:
            problems.append(f"read {count} records, expected {self.count}")
        if checksum != self.checksum:
            problems.append(f"value checksum {checksum:#x}, expected {self.checksum:#x}")
        if gaps:
            problems.append(f"{gaps} offset gaps or repeats")
        if ends != self.ends:
            problems.append(f"(epoch, shard) ends {ends}, expected {self.ends}")
        if problems:
            raise AssertionError(f"{side}: " + "; ".join(problems))


async def produce(url: str, records: list[tuple[bytes, bytes]], ledger: Ledger) -> None:
    """Send through the SDK; every acknowledged position goes into the ledger."""
    producer = await open_producer(url, TOKEN, VC, topics=[TOPIC])
    try:
        futures = []
        for i in range(0, len(records), BATCH_RECORDS):
            batch = [Record(value, key) for key, value in records[i : i + BATCH_RECORDS]]
            futures.append(await producer.send_batch(TOPIC, batch))
        await producer.flush()
        for future in futures:
            for position in await future:
                key = (position.epoch, position.shard)
                ledger.ends[key] = max(ledger.ends.get(key, 0), position.offset + 1)
                ledger.count += 1
        ledger.checksum += sum(zlib.crc32(value) for _, value in records)
    finally:
        await producer.close()


def prepare(url: str, count: int) -> Ledger:
    """The topic: half on a Kafka epoch (sealed), half on a Northguard epoch."""
    values = [os.urandom(VALUE_BYTES) for _ in range(VALUE_POOL)]
    records = [(b"%08d" % (i % 100_000), values[i % VALUE_POOL]) for i in range(count)]
    ledger = Ledger()
    with MetadataClient(url, token=TOKEN) as admin:
        admin.create_topic(VC, TOPIC, "kafka", SHARDS)
    asyncio.run(produce(url, records[: count // 2], ledger))
    with MetadataClient(url, token=TOKEN) as admin:
        metadata = admin.add_epoch(VC, TOPIC, "northguard")
    asyncio.run(produce(url, records[count // 2 :], ledger))
    if {epoch for epoch, _ in ledger.ends} != {0, 1}:
        raise AssertionError(f"the records landed in epochs {sorted(ledger.ends)}, not 0 and 1")
    sealed = metadata.epochs[0].end_offsets or {}
    if {(0, s): e for s, e in sealed.items() if e} != {
        k: v for k, v in ledger.ends.items() if k[0] == 0
    }:
        raise AssertionError(f"epoch 0 sealed at {sealed}, the ledger says {ledger.ends}")
    return ledger


def start_spark() -> Any:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    import clients.spark

    session = (
        SparkSession.builder.master(SPARK_MASTER)
        .appName("xinfra-bench-spark")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.driver.host", "127.0.0.1")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    clients.spark.register(session)
    return session


def spark_read(spark: Any, url: str, ledger: Ledger) -> float:
    from pyspark.sql import functions as F

    with frozen_heap():
        started = time.perf_counter()
        df = (
            spark.read.format("xinfra")
            .option("metadata.url", url)
            .option("token", TOKEN)
            .option("virtualCluster", VC)
            .option("topics", TOPIC)
            .load()
        )
        rows = (
            df.groupBy("epoch", "shard")
            .agg(
                F.count("*").alias("n"),
                F.sum(F.crc32("value")).alias("crc"),
                F.min("offset").alias("lo"),
                F.max("offset").alias("hi"),
            )
            .collect()
        )
        elapsed_s = time.perf_counter() - started
    count = sum(r.n for r in rows)
    checksum = sum(r.crc for r in rows)
    ends = {(r.epoch, r.shard): r.hi + 1 for r in rows}
    gaps = sum(1 for r in rows if r.lo != 0 or r.hi - r.lo + 1 != r.n)
    ledger.verify("Spark", count, checksum, ends, gaps)
    return ledger.count / elapsed_s


async def sdk_read(url: str, ledger: Ledger) -> float:
    consumer = await open_consumer(url, TOKEN, VC, options=XinfraConsumerOptions(), topics=[TOPIC])
    check = ReadCheck()
    crc32 = zlib.crc32
    try:
        with frozen_heap():
            started = time.perf_counter()
            await consumer.assign(TOPIC)
            while check.count < ledger.count:
                records = await consumer.poll(POLL_RECORDS, 5.0)
                if not records:
                    raise AssertionError(f"SDK read stalled at {check.count}/{ledger.count}")
                total = 0
                for record in records:
                    check.shard_run((record.epoch, record.shard), record.offset, record.offset)  # type: ignore[arg-type]
                    total += crc32(record.value)
                check.checksum += total
                check.count += len(records)
            elapsed_s = time.perf_counter() - started
    finally:
        await consumer.close()
    ends: Ends = dict(check.next_offset)  # type: ignore[arg-type]
    ledger.verify("SDK", check.count, check.checksum, ends, check.gaps)
    return ledger.count / elapsed_s


def main() -> None:
    parser = bench_parser(__doc__, rounds_default=4)  # even: each side goes first as often
    parser.add_argument("--records", type=int, default=0, help="records in the topic")
    args = parser.parse_args()
    rounds_n = rounds_of(args)
    count = args.records or (100_000 if args.quick else 1_000_000)
    rounds = Rounds()
    rounds.set("records", count)
    rounds.set("rounds", rounds_n)
    facts: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="xinfra-bench-spark-") as tmp, ExitStack() as stack:
        run_dir = Path(tmp)
        kafka = start_kafka(run_dir / "kafka")
        stack.callback(kafka.stop)
        service = Service(run_dir / "service")
        stack.callback(service.stop)
        ng_data = run_dir / "northguard" / "data"
        northguard = start_northguard_broker(ng_data, log_path=run_dir / "northguard.log")
        stack.callback(northguard.stop)
        facts = {f"northguard_{k}": v for k, v in storage_facts(ng_data).items()}
        with MetadataClient(service.url, token=TOKEN) as admin:
            admin.register_cluster(
                PhysicalCluster(name="kafka", kind=ClusterKind.KAFKA, bootstrap=kafka.url)
            )
            admin.register_cluster(
                PhysicalCluster(
                    name="northguard", kind=ClusterKind.NORTHGUARD, bootstrap=northguard.url
                )
            )
        log(f"producing {count:,} records (half on Kafka, half on Northguard)")
        ledger = prepare(service.url, count)
        log(f"ledger: {ledger.ends}")
        spark = start_spark()
        stack.callback(spark.stop)
        spark_read(spark, service.url, ledger)  # warm: Python workers, code paths
        asyncio.run(sdk_read(service.url, ledger))
        for number, order in enumerate(alternating(rounds_n, list(SIDES))):
            got: dict[str, float] = {}
            for side in order:
                if side == "spark":
                    got["spark"] = spark_read(spark, service.url, ledger)
                else:
                    got["sdk"] = asyncio.run(sdk_read(service.url, ledger))
            rounds.update(
                {
                    "spark_read_records_per_s": got["spark"],
                    "sdk_read_records_per_s": got["sdk"],
                    "spark_over_sdk_ratio": got["spark"] / got["sdk"],
                }
            )
            log(
                f"round {number} ({' first, '.join(order)} second): Spark {got['spark']:,.0f}/s, "
                f"SDK {got['sdk']:,.0f}/s ({got['spark'] / got['sdk']:.3f}x)"
            )
        parallelism = spark.sparkContext.defaultParallelism
    figures = rounds.figures()
    targets = {
        "spark_over_sdk_ratio": target(figures["spark_over_sdk_ratio"], TARGET_RATIO),
    }
    finish(
        "spark",
        figures,
        targets,
        no_fail=args.no_fail,
        spread=rounds.spread(),
        config={
            "shards": SHARDS,
            "epochs": "0 on Kafka (tansu, sealed), 1 on Northguard, half the records each",
            "key_bytes": KEY_BYTES,
            "value_bytes": VALUE_BYTES,
            "value_pool": VALUE_POOL,
            "spark": {
                "master": SPARK_MASTER,
                "default_parallelism": parallelism,
                "job": "read + groupBy(epoch, shard): count, sum(crc32(value)), min/max offset",
                "session": "started once before the rounds; one warm-up read",
            },
            "sdk": {
                "consumer": "one XinfraConsumer in this process, assign(topic), poll",
                "poll_records": POLL_RECORDS,
                "fetch_bytes_max": XinfraConsumerOptions().fetch_bytes_max,
            },
            "metadata_service": "in-process, SQLite",
        },
        peer="the SDK consumer in one process, same brokers: tansu (memory) and Northguard (fps)",
        quick=args.quick,
        **facts,
    )


if __name__ == "__main__":
    guard("spark", main)
