"""Throughput of the Kafka backend against a bare confluent-kafka loop, same broker, same run.

Starts a memory-only tansu broker on a free port, then measures four loops on
topics of ``--shards`` partitions with records of ``--record-bytes``:

* backend produce: ``ShardProducer.send`` of ``--batch`` records per call,
  round-robin over shards, awaiting the oldest future when the buffer is full;
* bare produce: ``Producer.produce`` per record with a counting delivery
  callback, the same librdkafka settings (``backends.kafka.config``);
* backend read: ``ShardReader.poll`` until every record is back;
* bare read: ``Consumer.consume`` in bulk.

Both read loops read every field an application gets of a record
(partition/shard, offset, timestamp, key, value, headers), so the read ratio
is the cost of delivering the same data through the backend.

Both producers are warmed up first (connection, idempotent producer id),
then bare and backend loops alternate for ``--rounds`` rounds.  Rates are the
median round; both read loops read the same topic (the backend's), so the
batches they fetch are the same; a ratio is the median of the per-round paired ratios, which
damps the noise of a shared machine.  Read
figures are per record over everything the topic holds.

The ratios (backend / bare) are the figures that matter: the broker and the
machine cancel out.  Prints progress on stderr and one JSON object as the
last line of stdout: {"bench", "machine", "figures", "targets"}.

    .venv/bin/python bench/kafka_backend.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

import confluent_kafka
from confluent_kafka import Consumer, KafkaError, Message, Producer, TopicPartition
from report import machine, target  # bench/report.py: the shape every bench prints

from backends.kafka.backend import KafkaBackend
from backends.kafka.config import producer_config, reader_config
from xinfra.backend import ProducerOptions, ReaderOptions, ShardProducer
from xinfra.errors import Backpressure
from xinfra.keyspace import shard_ranges
from xinfra.model import ClusterKind, PhysicalCluster, Record
from xinfra.services.kafka import start_kafka, tansu_binary

RATIO_TARGET = 0.8
POLL_RECORDS = 10_000


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def producer_options(args: argparse.Namespace) -> ProducerOptions:
    return ProducerOptions(linger_ms=5.0, batch_bytes_max=1 << 20, buffer_bytes_max=64 << 20)


async def backend_produce(producer: ShardProducer, count: int, args: argparse.Namespace) -> float:
    value = os.urandom(args.record_bytes)
    batch = [Record(value=value) for _ in range(args.batch)]  # built once: the app's cost
    in_flight: deque[asyncio.Future[list[int]]] = deque()
    sent = 0
    shard = 0
    started = time.perf_counter()
    while sent < count:
        try:
            in_flight.append(producer.send(shard, batch))
        except Backpressure:
            await in_flight.popleft()
            continue
        sent += len(batch)
        shard = (shard + 1) % args.shards
        while in_flight and in_flight[0].done():
            in_flight.popleft().result()
        if len(in_flight) > 1:
            await asyncio.sleep(0)  # let acknowledgements in, as an application would
    for future in in_flight:
        await future
    return time.perf_counter() - started


def bare_produce(producer: Producer, topic: str, count: int, args: argparse.Namespace) -> float:
    value = os.urandom(args.record_bytes)
    acked = [0]
    errors: list[KafkaError] = []

    def on_delivery(error: KafkaError | None, message: Message) -> None:
        if error is not None:
            errors.append(error)
        acked[0] += 1

    started = time.perf_counter()
    produce, poll = producer.produce, producer.poll
    for n in range(count):
        while True:
            try:
                # Positional callback, as the backend passes it: keywords cost ~250 ns a call.
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


async def backend_read(
    backend: KafkaBackend, topic: str, total: int, args: argparse.Namespace
) -> float:
    reader = backend.reader(topic, ReaderOptions())
    got = 0
    size = 0
    started = time.perf_counter()
    reader.assign(dict.fromkeys(range(args.shards), 0))
    while got < total:
        for record in await reader.poll(max_records=POLL_RECORDS, timeout_s=1.0):
            # What an application reads of a record, the same fields the bare loop reads.
            _ = (record.shard, record.offset, record.timestamp_ms, record.key, record.headers)
            size += len(record.value or b"")
            got += 1
    elapsed = time.perf_counter() - started
    await reader.close()
    assert got == total, got
    return elapsed


def bare_read(bootstrap: str, topic: str, total: int, args: argparse.Namespace) -> float:
    consumer = Consumer(reader_config(bootstrap, ReaderOptions()))
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
    assert got == total, got
    return elapsed


def peers() -> dict[str, Any]:
    """Versions of what ran beside the backend, for the report's machine block."""
    try:
        tansu = subprocess.run(
            [str(tansu_binary()), "--version"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except Exception as error:
        tansu = f"unknown ({error})"
    return {
        "confluent_kafka": confluent_kafka.__version__,
        "librdkafka": confluent_kafka.libversion()[0],
        "broker": f"{tansu} (memory storage)",
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Warm both producers up (connection, producer id), then alternate the loops, medians of rounds."""
    timings: dict[str, list[float]] = {
        "produce": [],
        "bare_produce": [],
        "read": [],
        "bare_read": [],
    }
    with tempfile.TemporaryDirectory(prefix="bench-kafka-") as run_dir:
        broker = start_kafka(Path(run_dir))
        try:
            bootstrap = broker.url
            cluster = PhysicalCluster(name="bench", kind=ClusterKind.KAFKA, bootstrap=bootstrap)
            backend = KafkaBackend(cluster)
            for name in ("bench-backend", "bench-bare"):
                await backend.create_topic(name, shard_ranges(args.shards))
            progress(
                f"tansu at {bootstrap}; {args.rounds} rounds of {args.records} records "
                f"of {args.record_bytes} B"
            )
            producer = backend.producer("bench-backend", producer_options(args))
            bare = Producer(producer_config(bootstrap, producer_options(args)))
            warmup = args.batch * args.shards
            await backend_produce(producer, warmup, args)
            await asyncio.to_thread(bare_produce, bare, "bench-bare", warmup, args)
            for round_ in range(args.rounds):
                elapsed = await asyncio.to_thread(
                    bare_produce, bare, "bench-bare", args.records, args
                )
                timings["bare_produce"].append(elapsed)
                timings["produce"].append(await backend_produce(producer, args.records, args))
                progress(
                    f"round {round_}: produce bare {args.records / elapsed:10,.0f}/s, "
                    f"backend {args.records / timings['produce'][-1]:10,.0f}/s"
                )
            await producer.close()
            total = warmup + args.rounds * args.records
            for round_ in range(args.rounds):
                elapsed = await asyncio.to_thread(
                    bare_read, bootstrap, "bench-backend", total, args
                )
                timings["bare_read"].append(elapsed)
                timings["read"].append(await backend_read(backend, "bench-backend", total, args))
                progress(
                    f"round {round_}: read bare {total / elapsed:10,.0f}/s, "
                    f"backend {total / timings['read'][-1]:10,.0f}/s"
                )
            await backend.close()
        finally:
            broker.stop()
    median = statistics.median
    produce_s, bare_produce_s = median(timings["produce"]), median(timings["bare_produce"])
    read_s, bare_read_s = median(timings["read"]), median(timings["bare_read"])
    read_s, bare_read_s = read_s / total * args.records, bare_read_s / total * args.records
    # Each round pairs a bare and a backend loop run back to back: the median of the
    # paired ratios is robust to a neighbour's burst of load hitting one loop.
    produce_ratio = median(
        b / o for b, o in zip(timings["bare_produce"], timings["produce"], strict=True)
    )
    read_ratio = median(b / o for b, o in zip(timings["bare_read"], timings["read"], strict=True))
    megabytes = args.records * args.record_bytes / 1e6
    figures = {
        "records": args.records,
        "rounds": args.rounds,
        "record_bytes": args.record_bytes,
        "produce_records_per_s": round(args.records / produce_s),
        "produce_mb_per_s": round(megabytes / produce_s, 2),
        "read_records_per_s": round(args.records / read_s),
        "read_mb_per_s": round(megabytes / read_s, 2),
        "bare_produce_records_per_s": round(args.records / bare_produce_s),
        "bare_read_records_per_s": round(args.records / bare_read_s),
        "produce_ratio": round(produce_ratio, 3),
        "read_ratio": round(read_ratio, 3),
    }
    targets = {
        name: target(figures[name], RATIO_TARGET) for name in ("produce_ratio", "read_ratio")
    }
    return {
        "bench": "kafka_backend",
        "machine": machine(**peers()),
        "figures": figures,
        "targets": targets,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a reduced size, under a minute")
    parser.add_argument(
        "--records", type=int, default=None, help="records per round (default 300k, --quick 100k)"
    )
    parser.add_argument("--record-bytes", type=int, default=100)
    parser.add_argument("--batch", type=int, default=1000, help="records per send()")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument(
        "--rounds", type=int, default=3, help="alternating rounds; medians are kept"
    )
    args = parser.parse_args()
    if args.records is None:
        args.records = 100_000 if args.quick else 300_000
    with contextlib.suppress(KeyboardInterrupt):
        result = asyncio.run(run(args))
        print(json.dumps(result))


if __name__ == "__main__":
    main()
