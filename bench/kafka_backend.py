"""Throughput of the Kafka backend against a tuned bare confluent-kafka loop, same broker, same run.

Starts a memory-only tansu broker on a free port and measures, on topics of
``--shards`` partitions with records of ``--record-bytes``, in paired rounds
whose order alternates (``bench/report.py``; 4 by default, so each side goes
first as often, 1 with ``--quick``):

* produce, ours: the application builds a ``Record`` per value (timed: the
  backend's API needs one) and calls ``ShardProducer.send`` with ``--batch``
  records, shard after shard, every shard in flight at once, awaiting the
  oldest send only when the producer raises ``Backpressure``;
* produce, bare: ``Producer.produce`` per value (plain bytes, what its API
  takes), the same partitions in the same runs, a positional delivery
  callback, ``poll(0)`` every 1000 records, ``flush`` at the end: as many
  records in flight as librdkafka allows, with the same linger, batch size
  and durability (``acks=all``, idempotence) as ours;
* read, ours: ``ShardReader.poll`` of up to 10k records from every shard
  until the topic's records are back;
* read, bare: ``Consumer.consume`` of up to 10k the same way, with the
  consumer tuned as its experts would (``fetch.queue.backoff.ms``, queue
  bounds; the whole configuration is in the JSON ``config``).

Both read loops read the same topic (written and verified once, before the
rounds), read every field an application gets of each record (shard, offset,
timestamp, key, value, headers: accessor calls on a bare ``Message``,
attributes of our ``ConsumedRecord``, which the backend filled) and keep what
they read; after the timed region, both are checked the same way: count, a
checksum of the values, offset continuity per shard and each shard's end
offset.  Every send's outcome is checked on both sides
(offsets of every ``send``; every delivery report).

Figures are medians over the rounds with their min-max ``spread``; a ratio
is the median of the per-round ratios of a pair measured back to back.
Targets: produce and read at >= 0.9x of bare.  Exit status 1 when a target
is missed, 2 when the bench could not run, 0 otherwise (``--no-fail``: 0).

    .venv/bin/python bench/kafka_backend.py --quick
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Any

import confluent_kafka
from confluent_kafka import Consumer, KafkaError, Message, Producer, TopicPartition
from report import (  # bench/report.py: what every bench shares
    ReadCheck,
    Rounds,
    alternating,
    bench_parser,
    finish,
    frozen_heap,
    guard,
    rounds_of,
    target,
    values_checksum,
)

from backends.kafka.backend import KafkaBackend
from backends.kafka.config import producer_config, reader_config
from xinfra.backend import ProducerOptions, ReaderOptions, ShardProducer
from xinfra.errors import Backpressure
from xinfra.keyspace import shard_ranges
from xinfra.model import ClusterKind, PhysicalCluster, Record
from xinfra.services.kafka import start_kafka, tansu_binary

BENCH = "kafka_backend"
RATIO_TARGET = 0.9
POLL_RECORDS = 10_000
"""Records one read call may return, on both sides."""
POLL_TIMEOUT_S = 1.0
PRODUCER_OPTIONS = ProducerOptions(
    linger_ms=5.0, batch_bytes_max=1 << 20, buffer_bytes_max=64 << 20
)
READER_OPTIONS = ReaderOptions()
"""The backend's default prefetch bound (``fetch_bytes_max``), which the bare consumer gets too."""


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def bare_producer_config(bootstrap: str) -> dict[str, Any]:
    """librdkafka's producer as a Kafka engineer runs it for throughput with our promises.

    The same durability (``acks=all``, idempotence), linger and batch size as
    the backend's producer, and queues large enough that the loop never
    waits on them: as many records in flight as librdkafka allows.
    """
    return {
        "bootstrap.servers": bootstrap,
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": PRODUCER_OPTIONS.linger_ms,
        "batch.size": PRODUCER_OPTIONS.batch_bytes_max,
        "queue.buffering.max.messages": 2_000_000,
        "queue.buffering.max.kbytes": 1 << 20,
        "compression.type": "none",
    }


def bare_consumer_config(bootstrap: str) -> dict[str, Any]:
    """librdkafka's consumer tuned for throughput, with the backend's prefetch memory bound.

    ``fetch.queue.backoff.ms``: its 1000 ms default idles a reader whenever
    the prefetch queue fills.  ``queued.min.messages`` high so the byte bound
    decides; large fetches so one round trip brings a lot.
    """
    return {
        "bootstrap.servers": bootstrap,
        "group.id": f"bench-bare-{uuid.uuid4().hex}",
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "enable.partition.eof": False,
        "auto.offset.reset": "error",
        "fetch.queue.backoff.ms": 1,
        "queued.min.messages": 1_000_000,
        "queued.max.messages.kbytes": READER_OPTIONS.fetch_bytes_max // 1024,
        "fetch.max.bytes": 50 << 20,
        "max.partition.fetch.bytes": 8 << 20,
        "fetch.wait.max.ms": 100,
    }


def printable(config: dict[str, Any]) -> dict[str, Any]:
    """A librdkafka config for the JSON: objects (loggers, callbacks) by name, group ids dropped."""
    return {
        key: value if isinstance(value, (str, int, float, bool)) else type(value).__name__
        for key, value in config.items()
        if key != "group.id"
    }


def runs(total: int, batch: int, shards: int) -> list[tuple[int, int, int]]:
    """(shard, start, end) of each ``batch`` of values, shard after shard: the same on both sides."""
    return [
        (index % shards, start, min(start + batch, total))
        for index, start in enumerate(range(0, total, batch))
    ]


# -- produce -------------------------------------------------------------------------------------


async def ours_produce(
    producer: ShardProducer, values: list[bytes], plan: list[tuple[int, int, int]]
) -> tuple[float, int]:
    """Build the records and send them; (elapsed, records acknowledged), every send checked."""
    in_flight: deque[tuple[asyncio.Future[list[int]], int]] = deque()
    acked = 0

    def settle(future: asyncio.Future[list[int]], count: int) -> int:
        offsets = future.result()  # raises the send's error
        assert len(offsets) == count and offsets == sorted(offsets), "a send lost or reordered"
        return count

    with frozen_heap():
        started = time.perf_counter()
        for shard, start, end in plan:
            records = [Record(value=value) for value in values[start:end]]
            while True:
                try:
                    in_flight.append((producer.send(shard, records), end - start))
                    break
                except Backpressure:
                    future, count = in_flight.popleft()
                    await asyncio.wait([future])
                    acked += settle(future, count)
            while in_flight and in_flight[0][0].done():
                acked += settle(*in_flight.popleft())
            await asyncio.sleep(0)  # an application yields to its loop between calls
        for future, count in in_flight:
            await asyncio.wait([future])
            acked += settle(future, count)
        elapsed = time.perf_counter() - started
    return elapsed, acked


def bare_produce(
    producer: Producer, topic: str, values: list[bytes], plan: list[tuple[int, int, int]]
) -> tuple[float, int]:
    """Produce the values as plain bytes; (elapsed, records acknowledged), every report checked."""
    acked = [0]
    errors: list[KafkaError] = []

    def on_delivery(error: KafkaError | None, _message: Message) -> None:
        if error is None:
            acked[0] += 1
        else:
            errors.append(error)

    produce, poll = producer.produce, producer.poll
    with frozen_heap():
        started = time.perf_counter()
        sent = 0
        for shard, start, end in plan:
            for value in values[start:end]:
                while True:
                    try:
                        # (topic, value, key, partition, on_delivery): positional, the fastest call
                        produce(topic, value, None, shard, on_delivery)
                        break
                    except BufferError:
                        poll(0.001)
                sent += 1
                if sent % 1000 == 0:
                    poll(0)
        left = producer.flush(120)
        elapsed = time.perf_counter() - started
    assert left == 0 and not errors, (left, errors[:3])
    return elapsed, acked[0]


# -- read ----------------------------------------------------------------------------------------


async def ours_read(
    backend: KafkaBackend, topic: str, shards: int, total: int
) -> tuple[float, ReadCheck]:
    held: list[list[Any]] = []
    got = size = 0
    with frozen_heap():
        started = time.perf_counter()
        reader = backend.reader(topic, READER_OPTIONS)
        reader.assign(dict.fromkeys(range(shards), 0))
        while got < total:
            records = await reader.poll(max_records=POLL_RECORDS, timeout_s=POLL_TIMEOUT_S)
            for record in records:  # what an application reads of a record
                _ = (record.shard, record.offset, record.timestamp_ms, record.key, record.headers)
                size += len(record.value or b"")
            got += len(records)
            held.append(records)
        elapsed = time.perf_counter() - started
        await reader.close()
    check = ReadCheck()
    for records in held:
        for record in records:
            check.count += 1
            check.checksum += values_checksum([record.value])
            check.shard_run(record.shard, record.offset, record.offset)
    return elapsed, check


def bare_read(bootstrap: str, topic: str, shards: int, total: int) -> tuple[float, ReadCheck]:
    held: list[list[Message]] = []
    got = size = 0
    with frozen_heap():
        started = time.perf_counter()
        consumer = Consumer(bare_consumer_config(bootstrap))
        consumer.assign([TopicPartition(topic, shard, 0) for shard in range(shards)])
        while got < total:
            messages = consumer.consume(POLL_RECORDS, POLL_TIMEOUT_S)
            for message in messages:  # the same fields, through Message's accessors
                if message.error() is not None:
                    raise RuntimeError(f"bare read: {message.error()}")
                _ = (message.partition(), message.offset(), message.timestamp())
                _ = (message.key(), message.headers())
                size += len(message.value() or b"")
            got += len(messages)
            held.append(messages)
        elapsed = time.perf_counter() - started
        consumer.close()
    check = ReadCheck()
    for messages in held:
        for message in messages:
            check.count += 1
            check.checksum += values_checksum([message.value() or b""])
            offset = message.offset()
            check.shard_run(message.partition(), offset, offset)  # type: ignore[arg-type]
    return elapsed, check


# -- the run -------------------------------------------------------------------------------------


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
        "peer": f"bare confluent-kafka on the same broker: {tansu} (memory storage, no fsync)",
    }


async def run(args: Any, rounds_count: int) -> dict[str, Any]:
    shards, records = args.shards, args.records
    buffer = os.urandom(records + args.record_bytes)
    values = [buffer[i : i + args.record_bytes] for i in range(records)]  # distinct, raw payloads
    expected_checksum = values_checksum(values)
    plan = runs(records, args.batch, shards)
    expected_ends = {
        shard: sum(end - start for s, start, end in plan if s == shard) for shard in range(shards)
    }
    rounds = Rounds()
    with tempfile.TemporaryDirectory(prefix="bench-kafka-") as run_dir:
        broker = start_kafka(Path(run_dir))
        try:
            bootstrap = broker.url
            cluster = PhysicalCluster(name="bench", kind=ClusterKind.KAFKA, bootstrap=bootstrap)
            backend = KafkaBackend(cluster)
            progress(
                f"tansu at {bootstrap}; {rounds_count} rounds of {records} records of "
                f"{args.record_bytes} B over {shards} shards"
            )
            # The topic both read loops read: written once, checked, before any timing.
            await backend.create_topic("bench-read", shard_ranges(shards))
            filler = backend.producer("bench-read", PRODUCER_OPTIONS)
            _, acked = await ours_produce(filler, values, plan)
            await filler.close()
            assert acked == records, acked
            bare = Producer(bare_producer_config(bootstrap))
            for round_, order in enumerate(alternating(rounds_count, ["ours", "bare"])):
                topics = {side: f"bench-{side}-{round_}" for side in order}
                for topic in topics.values():
                    await backend.create_topic(topic, shard_ranges(shards))
                ours = backend.producer(topics["ours"], PRODUCER_OPTIONS)
                warm = plan[:shards]  # connections and producer ids before the clock starts
                await ours_produce(ours, values, warm)
                bare_produce(bare, topics["bare"], values, warm)
                for side in order:
                    if side == "ours":
                        elapsed, acked = await ours_produce(ours, values, plan)
                    else:
                        elapsed, acked = bare_produce(bare, topics["bare"], values, plan)
                    assert acked == records, f"{side}: {acked} of {records} acknowledged"
                    rounds.add(f"{side}_produce_records_per_s", records / elapsed)
                await ours.close()
                for side in order:
                    if side == "ours":
                        elapsed, check = await ours_read(backend, "bench-read", shards, records)
                    else:
                        elapsed, check = bare_read(bootstrap, "bench-read", shards, records)
                    check.verify(records, expected_checksum, expected_ends)
                    rounds.add(f"{side}_read_records_per_s", records / elapsed)
                for topic in topics.values():
                    await backend.delete_topic(topic)
                progress(
                    f"round {round_} ({'/'.join(order)} first): produce ours "
                    f"{rounds.values['ours_produce_records_per_s'][-1]:,.0f}/s bare "
                    f"{rounds.values['bare_produce_records_per_s'][-1]:,.0f}/s; read ours "
                    f"{rounds.values['ours_read_records_per_s'][-1]:,.0f}/s bare "
                    f"{rounds.values['bare_read_records_per_s'][-1]:,.0f}/s"
                )
            bare.flush(10)
            await backend.close()
        finally:
            broker.stop()
    rounds.ratio("produce_ratio", "ours_produce_records_per_s", "bare_produce_records_per_s")
    rounds.ratio("read_ratio", "ours_read_records_per_s", "bare_read_records_per_s")
    megabytes = args.record_bytes / 1e6
    for side in ("ours", "bare"):
        for what in ("produce", "read"):
            rounds.values[f"{side}_{what}_mb_per_s"] = [
                rate * megabytes for rate in rounds.values[f"{side}_{what}_records_per_s"]
            ]
    rounds.set("records", records)
    rounds.set("record_bytes", args.record_bytes)
    rounds.set("shards", shards)
    rounds.set("rounds", rounds_count)
    figures = rounds.figures()
    return {
        "figures": figures,
        "spread": rounds.spread(),
        "targets": {
            name: target(figures[name], RATIO_TARGET) for name in ("produce_ratio", "read_ratio")
        },
        "config": {
            "ours": {
                "producer_options": {
                    "linger_ms": PRODUCER_OPTIONS.linger_ms,
                    "batch_bytes_max": PRODUCER_OPTIONS.batch_bytes_max,
                    "buffer_bytes_max": PRODUCER_OPTIONS.buffer_bytes_max,
                },
                "producer": printable(producer_config("BOOTSTRAP", PRODUCER_OPTIONS)),
                "reader": printable(reader_config("BOOTSTRAP", READER_OPTIONS)),
                "send_batch_records": args.batch,
            },
            "bare": {
                "producer": printable(bare_producer_config("BOOTSTRAP")),
                "consumer": printable(bare_consumer_config("BOOTSTRAP")),
                "poll_every_records": 1000,
            },
            "read_records_per_call": POLL_RECORDS,
        },
    }


def main() -> None:
    parser = bench_parser(__doc__.splitlines()[0] if __doc__ else None, rounds_default=4)
    parser.add_argument(
        "--records", type=int, default=None, help="records per round (default 300k, --quick 100k)"
    )
    parser.add_argument("--record-bytes", type=int, default=100)
    parser.add_argument("--batch", type=int, default=1000, help="records per send()")
    parser.add_argument("--shards", type=int, default=4)
    args = parser.parse_args()
    if args.records is None:
        args.records = 100_000 if args.quick else 300_000
    rounds_count = rounds_of(args)
    result = asyncio.run(run(args, rounds_count))
    finish(
        BENCH,
        result["figures"],
        result["targets"],
        no_fail=args.no_fail,
        spread=result["spread"],
        config=result["config"],
        **peers(),
    )


if __name__ == "__main__":
    guard(BENCH, main)
