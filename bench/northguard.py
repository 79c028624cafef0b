"""Northguard beside tansu, same machine, same run: produce and consume throughput, produce latency.

Starts a Northguard broker (fps store: WAL + fsync on every group commit) and
a tansu broker (memory storage, no fsync), both on free ports, then measures:

* produce throughput, 100-byte and 1 KiB values: Northguard through
  ``NorthguardBackend`` (``send`` of ``--batch`` records per call, round-robin
  over ``--shards`` shards, a bounded number of calls in flight); tansu through
  a bare confluent-kafka producer with ``acks=all`` (``produce`` per record,
  the partition named);
* consume throughput over the 100-byte topic: ``ShardReader.poll`` against
  ``Consumer.consume``, both touching every field of every record;
* produce latency at a fixed rate (``--rate`` records/s, 10k by default):
  a paced loop sends a small batch every millisecond and records send-to-ack
  time of each call (Northguard) or each record (tansu).

Ratios are Northguard / tansu in this run.  Tansu keeps data in memory, so
the comparison favours it: Northguard fsyncs every acknowledged record.
Progress goes to stderr; the last line of stdout is the one JSON object.

    .venv/bin/python bench/northguard.py --quick
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
from typing import Any

import confluent_kafka
from confluent_kafka import Consumer, KafkaError, Message, Producer, TopicPartition
from report import emit, target  # bench/report.py: the shape every bench prints

from backends.kafka.backend import KafkaBackend
from backends.kafka.config import producer_config, reader_config
from backends.northguard.backend import NorthguardBackend
from backends.northguard.launcher import start_northguard_broker
from xinfra.backend import ProducerOptions, ReaderOptions, ShardProducer
from xinfra.errors import Backpressure
from xinfra.keyspace import shard_ranges
from xinfra.model import ClusterKind, PhysicalCluster, Record
from xinfra.services.kafka import start_kafka

POLL_RECORDS = 10_000
IN_FLIGHT_CALLS_MAX = 64


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def options() -> ProducerOptions:
    return ProducerOptions(linger_ms=5.0, batch_bytes_max=1 << 20, buffer_bytes_max=64 << 20)


# -- Northguard ------------------------------------------------------------------------------------


async def ng_produce(
    producer: ShardProducer, count: int, size: int, args: argparse.Namespace
) -> float:
    value = os.urandom(size)
    batch = [Record(value=value) for _ in range(args.batch)]
    in_flight: set[asyncio.Future[list[int]]] = set()
    started = time.perf_counter()
    sent = 0
    shard = 0
    while sent < count:
        try:
            future = producer.send(shard, batch)
        except Backpressure:
            await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
            continue
        in_flight.add(future)
        future.add_done_callback(in_flight.discard)
        sent += len(batch)
        shard = (shard + 1) % args.shards
        if len(in_flight) >= IN_FLIGHT_CALLS_MAX:
            await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
    await producer.flush()
    return time.perf_counter() - started


async def ng_read(
    backend: NorthguardBackend, topic: str, total: int, args: argparse.Namespace
) -> float:
    reader = backend.reader(topic, ReaderOptions(fetch_bytes_max=32 << 20))
    got = 0
    size = 0
    started = time.perf_counter()
    reader.assign(dict.fromkeys(range(args.shards), 0))
    while got < total:
        for record in await reader.poll(max_records=POLL_RECORDS, timeout_s=1.0):
            _ = (record.shard, record.offset, record.timestamp_ms, record.key, record.headers)
            size += len(record.value or b"")
            got += 1
    elapsed = time.perf_counter() - started
    await reader.close()
    assert got == total, got
    return elapsed


async def ng_latency(producer: ShardProducer, args: argparse.Namespace) -> list[float]:
    """Send ``rate/1000`` records every millisecond for ``latency_s``; send-to-ack times in ms."""
    per_tick = max(1, args.rate // 1000)
    value = os.urandom(100)
    latencies: list[float] = []
    loop = asyncio.get_running_loop()
    ticks = int(args.latency_s * 1000)
    started = loop.time()
    futures = []
    for tick in range(ticks):
        delay = started + tick / 1000 - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        sent_at = time.perf_counter()
        future = producer.send(tick % args.shards, [Record(value=value) for _ in range(per_tick)])
        future.add_done_callback(
            lambda _, t=sent_at: latencies.append((time.perf_counter() - t) * 1000)
        )
        futures.append(future)
    await asyncio.gather(*futures)
    return latencies


# -- tansu through confluent-kafka ----------------------------------------------------------------


def kafka_produce(
    bootstrap: str, topic: str, count: int, size: int, args: argparse.Namespace
) -> float:
    producer = Producer(producer_config(bootstrap, options()))
    value = os.urandom(size)
    acked = [0]
    errors: list[KafkaError] = []

    def on_delivery(error: KafkaError | None, message: Message) -> None:
        if error is not None:
            errors.append(error)
        acked[0] += 1

    producer.produce(topic, value, None, 0, on_delivery)  # warm: connection, producer id
    producer.flush(30)
    acked[0] = 0
    produce, poll = producer.produce, producer.poll
    started = time.perf_counter()
    for n in range(count):
        while True:
            try:
                produce(topic, value, None, (n // args.batch) % args.shards, on_delivery)
                break
            except BufferError:
                poll(0.01)
        if n % 1000 == 999:
            poll(0)
    producer.flush(120)
    elapsed = time.perf_counter() - started
    assert not errors and acked[0] == count, (errors[:3], acked[0])
    return elapsed


def kafka_read(bootstrap: str, topic: str, total: int, args: argparse.Namespace) -> float:
    consumer = Consumer(reader_config(bootstrap, ReaderOptions(fetch_bytes_max=32 << 20)))
    got = 0
    size = 0
    started = time.perf_counter()
    consumer.assign([TopicPartition(topic, shard, 0) for shard in range(args.shards)])
    while got < total:
        for message in consumer.consume(POLL_RECORDS, 1.0):
            if message.error() is None:
                _ = (message.partition(), message.offset(), message.timestamp())
                _ = (message.key(), message.headers())
                size += len(message.value() or b"")
                got += 1
    elapsed = time.perf_counter() - started
    consumer.close()
    assert got >= total, got
    return elapsed


def kafka_latency(bootstrap: str, topic: str, args: argparse.Namespace) -> list[float]:
    producer = Producer({**producer_config(bootstrap, options()), "linger.ms": 1})
    value = os.urandom(100)
    latencies: list[float] = []
    per_tick = max(1, args.rate // 1000)
    producer.produce(topic, value, None, 0)
    producer.flush(30)
    started = time.perf_counter()
    for tick in range(int(args.latency_s * 1000)):
        delay = started + tick / 1000 - time.perf_counter()
        if delay > 0:
            producer.poll(delay)
        for _ in range(per_tick):
            sent_at = time.perf_counter()
            producer.produce(
                topic,
                value,
                None,
                tick % args.shards,
                lambda error, message, t=sent_at: latencies.append(
                    (time.perf_counter() - t) * 1000
                ),
            )
        producer.poll(0)
    producer.flush(60)
    return latencies


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


# -- the run -----------------------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-northguard-") as run_dir:
        tansu = start_kafka(Path(run_dir))
        northguard = start_northguard_broker(
            Path(run_dir) / "ng-data", log_path=Path(run_dir) / "ng.log"
        )
        try:
            kafka = KafkaBackend(
                PhysicalCluster(name="k", kind=ClusterKind.KAFKA, bootstrap=tansu.url)
            )
            ng = NorthguardBackend(
                PhysicalCluster(name="ng", kind=ClusterKind.NORTHGUARD, bootstrap=northguard.url)
            )
            for name in ("p100", "p1k", "lat"):
                await kafka.create_topic(name, shard_ranges(args.shards))
                await ng.create_topic(name, shard_ranges(args.shards))
            await kafka.close()
            progress(f"northguard at {northguard.url}, tansu at {tansu.url}")

            for label, size, count in (
                ("100b", 100, args.records),
                ("1k", 1024, args.records // 4),
            ):
                topic = "p100" if size == 100 else "p1k"
                producer = ng.producer(topic, options())
                await ng_produce(producer, args.batch * args.shards, size, args)  # warm up
                ng_s = await ng_produce(producer, count, size, args)
                await producer.close()
                kafka_s = await asyncio.to_thread(
                    kafka_produce, tansu.url, topic, count, size, args
                )
                for peer, seconds in (("northguard", ng_s), ("tansu", kafka_s)):
                    figures[f"{peer}_produce_{label}_records_per_s"] = round(count / seconds)
                    figures[f"{peer}_produce_{label}_mb_per_s"] = round(
                        count * size / seconds / 1e6, 1
                    )
                progress(
                    f"produce {label}: northguard {count / ng_s:,.0f} rec/s, tansu {count / kafka_s:,.0f} rec/s"
                )

            total = args.records + args.batch * args.shards
            ng_read_s = await ng_read(ng, "p100", total, args)
            kafka_read_s = await asyncio.to_thread(
                kafka_read, tansu.url, "p100", args.records, args
            )
            figures["northguard_consume_100b_records_per_s"] = round(total / ng_read_s)
            figures["tansu_consume_100b_records_per_s"] = round(args.records / kafka_read_s)
            progress(
                f"consume: northguard {total / ng_read_s:,.0f} rec/s, "
                f"tansu {args.records / kafka_read_s:,.0f} rec/s"
            )

            producer = ng.producer("lat", ProducerOptions(linger_ms=1.0))
            await producer.send(0, [Record(value=b"warm")])
            ng_lat = await ng_latency(producer, args)
            await producer.close()
            kafka_lat = await asyncio.to_thread(kafka_latency, tansu.url, "lat", args)
            for peer, latencies in (("northguard", ng_lat), ("tansu", kafka_lat)):
                figures[f"{peer}_produce_latency_ms_p50"] = round(statistics.median(latencies), 2)
                figures[f"{peer}_produce_latency_ms_p99"] = round(percentile(latencies, 0.99), 2)
            progress(
                f"latency at {args.rate} rec/s: northguard p50 {figures['northguard_produce_latency_ms_p50']} "
                f"p99 {figures['northguard_produce_latency_ms_p99']} ms; tansu p50 "
                f"{figures['tansu_produce_latency_ms_p50']} p99 {figures['tansu_produce_latency_ms_p99']} ms"
            )
            await ng.close()
        finally:
            northguard.stop()
            tansu.stop()
    figures["produce_100b_ratio"] = round(
        figures["northguard_produce_100b_records_per_s"]
        / figures["tansu_produce_100b_records_per_s"],
        3,
    )
    figures["consume_100b_ratio"] = round(
        figures["northguard_consume_100b_records_per_s"]
        / figures["tansu_consume_100b_records_per_s"],
        3,
    )
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a reduced run, under a minute")
    parser.add_argument("--records", type=int, default=0, help="100-byte records per produce run")
    parser.add_argument("--batch", type=int, default=1000, help="records per send call")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--rate", type=int, default=10_000, help="records/s of the latency run")
    parser.add_argument("--latency-s", type=float, default=0.0, help="seconds of the latency run")
    args = parser.parse_args()
    args.records = args.records or (200_000 if args.quick else 1_000_000)
    args.latency_s = args.latency_s or (3.0 if args.quick else 10.0)
    figures = asyncio.run(run(args))
    targets = {
        "produce_100b_ratio_vs_tansu": target(figures["produce_100b_ratio"], 0.5),
        "consume_100b_ratio_vs_tansu": target(figures["consume_100b_ratio"], 1.0),
        "produce_latency_ms_p99_at_10k": target(
            figures["northguard_produce_latency_ms_p99"], 20.0, "<="
        ),
    }
    emit(
        "northguard",
        figures,
        targets,
        confluent_kafka=confluent_kafka.__version__,
        peer="tansu (memory storage) via confluent-kafka acks=all",
        quick=args.quick,
    )


if __name__ == "__main__":
    main()
