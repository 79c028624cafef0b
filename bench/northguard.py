"""Northguard beside tansu, same machine, same run: produce and consume throughput, produce latency.

Starts a Northguard broker (fps store: WAL + fsync on every group commit) and
a tansu broker (memory storage, no fsync), both on free ports.  Every round
(4 by default: an even count, so each side goes first as often) measures, on fresh topics of ``--shards`` shards, with the side that goes
first alternating from round to round:

* produce, 100 B and 1 KiB values: both sides start from the same raw values
  (bytes) and build what their API takes inside the timed loop: Northguard a
  ``Record`` per value, sent ``--batch`` at a time with
  ``NorthguardBackend``'s ``ShardProducer.send`` (as many calls in flight as
  its buffer allows); tansu gets the bytes through a confluent-kafka producer
  (``produce`` per record, partition named).  Same linger (5 ms), same batch
  limit (1 MiB), same shard of each record.  Every send's outcome is checked
  (offsets returned / delivery reports without error);
* consume of the 100 B topic just written: ``ShardReader.poll`` against
  ``Consumer.consume`` (prefetch bound 32 MiB both), each checking the count,
  a checksum of the values and offset continuity per shard, inside the timed
  loop;
* produce latency, open-loop: ``--rate`` records/s scheduled for
  ``--latency-s``; each record's latency counts from its scheduled time
  (``report.OpenLoop``), so a stall shows in every record due during it.
  Same linger (1 ms) both sides.  Like every timed loop here, it runs under
  ``frozen_heap``: what the bench process holds from other phases is not
  rescanned by the collector; what the clients allocate is collected as usual;
* the cost of TLS and credentials: a second Northguard broker, same
  settings, its client port TLS (``--tls-cert``, a P-256 test certificate;
  TLS 1.3 negotiated) and a cluster secret (every connection authenticates
  with a signed credential, every request is authorized against it), and
  the same 100 B produce to both brokers back to back, the first
  alternating from round to round; ``tls_produce_ratio`` is secured over
  plain per round (target >= 0.8, hard).  Both sides pay the handshakes only
  when a producer connects: the timed loop measures the record path;
* replication: three more brokers as one cluster (``start_northguard_cluster``,
  replication factor 3: a record is acknowledged once all three replicas
  have fsynced it), the same 100 B produce beside tansu's (each side going
  first as in the rest of the round, tansu on a fresh topic), and the same
  open-loop latency run at ``--rate``.  ``rf3_produce_100b_ratio`` is the
  replicated cluster over tansu per round (target >= 0.3, hard), its p99 at
  10k records/s < 50 ms (hard).  The three brokers share this machine's two
  cores and one disk with everything else, which a real cluster would not.

The peer is tuned as its experts would run it (its configuration is in the
JSON ``config``): idempotent ``acks=all`` producer with the same linger and
batch limit, consumer with ``fetch.queue.backoff.ms`` low, a large prefetch
and a short ``fetch.wait.max.ms``.  Tansu keeps data in memory (no fsync):
the comparison favours it, ``machine.peer`` says so.  The Northguard broker's
own counters (flushes, fsyncs, read-cache hits) for the run, the data
directory's filesystem and whether O_DIRECT was granted are in ``machine``.

Targets: Northguard produce p99 at 10k records/s < 20 ms (hard), TLS and
credentials produce >= 0.8x plain (hard), replication factor 3: produce >= 0.3x
tansu and p99 at 10k records/s < 50 ms (hard); the ratios against tansu are reported (``"hard": false``): leading tansu is a later issue.

    .venv/bin/python bench/northguard.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import confluent_kafka
from confluent_kafka import Consumer, KafkaError, Message, Producer, TopicPartition
from report import (  # bench/report.py: what every bench shares
    OpenLoop,
    Rounds,
    alternating,
    bench_parser,
    delta,
    finish,
    frozen_heap,
    guard,
    latency_figures,
    prometheus_counters,
    report_only,
    rounds_of,
    storage_facts,
    target,
)

from backends.northguard.backend import NorthguardBackend
from backends.northguard.credentials import SECRET_ATTRIBUTE
from backends.northguard.launcher import start_northguard_broker, start_northguard_cluster
from backends.northguard.tls import CA_ATTRIBUTE, TLS_ATTRIBUTE, make_test_certificates
from xinfra.backend import ProducerOptions, ReaderOptions, ShardProducer
from xinfra.errors import Backpressure
from xinfra.keyspace import shard_ranges
from xinfra.model import ClusterKind, PhysicalCluster, Record
from xinfra.services.kafka import start_kafka

POLL_RECORDS = 10_000
VALUE_POOL = 4096  # distinct values cycled through; the checksum covers every record read
LINGER_MS = 5.0
LATENCY_LINGER_MS = 1.0
BATCH_BYTES_MAX = 1 << 20
BUFFER_BYTES_MAX = 64 << 20
FETCH_BYTES_MAX = 32 << 20
SIDES = ("northguard", "tansu")
REPLICATION_FACTOR = 3
TLS_VARIANTS = ("plain", "tls")


def progress(message: str) -> None:
    print(f"[bench northguard] {message}", file=sys.stderr, flush=True)


def ng_options(linger_ms: float) -> ProducerOptions:
    return ProducerOptions(
        linger_ms=linger_ms, batch_bytes_max=BATCH_BYTES_MAX, buffer_bytes_max=BUFFER_BYTES_MAX
    )


def kafka_producer_config(bootstrap: str, linger_ms: float) -> dict[str, Any]:
    """What a Kafka engineer runs for throughput with acks=all: same linger and batch limit as ours."""
    return {
        "bootstrap.servers": bootstrap,
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": linger_ms,
        "batch.size": BATCH_BYTES_MAX,
        "queue.buffering.max.kbytes": BUFFER_BYTES_MAX >> 10,
        "queue.buffering.max.messages": 1_000_000,
        "compression.type": "none",
    }


def kafka_consumer_config(bootstrap: str) -> dict[str, Any]:
    """An assign-only reader tuned for throughput: no 1 s backoff on a full prefetch queue."""
    return {
        "bootstrap.servers": bootstrap,
        "group.id": "bench-northguard-peer",
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "enable.partition.eof": False,
        "auto.offset.reset": "earliest",
        "fetch.queue.backoff.ms": 1,
        "queued.max.messages.kbytes": FETCH_BYTES_MAX >> 10,
        "queued.min.messages": 1_000_000,
        "fetch.max.bytes": FETCH_BYTES_MAX,
        "max.partition.fetch.bytes": 8 << 20,
        "fetch.wait.max.ms": 10,
    }


def make_values(size: int) -> list[bytes]:
    return [os.urandom(size) for _ in range(VALUE_POOL)]


def expected_checksum(values: list[bytes], count: int) -> int:
    """Sum of CRC32s of the ``count`` values the produce loops sent (``values[i % pool]``)."""
    crcs = [zlib.crc32(v) for v in values]
    full, rest = divmod(count, len(values))
    return (full * sum(crcs) + sum(crcs[:rest])) & 0xFFFFFFFFFFFFFFFF


def shard_ends(count: int, batch: int, shards: int) -> dict[int, int]:
    """Records per shard when record ``n`` goes to shard ``(n // batch) % shards``."""
    ends = dict.fromkeys(range(shards), 0)
    for start in range(0, count, batch):
        ends[(start // batch) % shards] += min(batch, count - start)
    return ends


# -- Northguard ------------------------------------------------------------------------------------


async def ng_produce(
    producer: ShardProducer, values: list[bytes], count: int, args: argparse.Namespace
) -> float:
    """Records/s; ``Record`` objects are built inside the timed loop, every send's offsets checked."""
    pool = len(values)
    batch_n = args.batch
    shards = args.shards
    acked = [0]
    failures: list[BaseException] = []
    pending: set[asyncio.Future[list[int]]] = set()

    def on_done(future: asyncio.Future[list[int]]) -> None:
        pending.discard(future)
        error = future.exception()
        if error is not None:
            failures.append(error)
        else:
            acked[0] += len(future.result())

    with frozen_heap():
        started = time.perf_counter()
        n = 0
        while n < count:
            end = min(n + batch_n, count)
            records = [Record(values[i % pool]) for i in range(n, end)]
            shard = (n // batch_n) % shards
            while True:
                try:
                    future = producer.send(shard, records)
                    break
                except Backpressure:
                    await asyncio.wait(set(pending), return_when=asyncio.FIRST_COMPLETED)
            pending.add(future)
            future.add_done_callback(on_done)
            n = end
        await producer.flush()
        elapsed = time.perf_counter() - started
    if failures or acked[0] != count:
        raise AssertionError(f"northguard produce: {acked[0]}/{count} acked, {failures[:3]}")
    return count / elapsed


async def ng_consume(
    backend: NorthguardBackend,
    topic: str,
    count: int,
    checksum: int,
    ends: dict[int, int],
    args: argparse.Namespace,
) -> float:
    """Records/s reading ``topic`` from the start, checking count, checksum and offsets inline."""
    reader = backend.reader(topic, ReaderOptions(fetch_bytes_max=FETCH_BYTES_MAX))
    crc32 = zlib.crc32
    got = 0
    total = 0
    next_offset = dict.fromkeys(range(args.shards), 0)
    gaps = 0
    try:
        with frozen_heap():
            started = time.perf_counter()
            reader.assign(dict.fromkeys(range(args.shards), 0))
            while got < count:
                records = await reader.poll(max_records=POLL_RECORDS, timeout_s=5.0)
                if not records:
                    raise AssertionError(f"northguard consume stalled at {got}/{count}")
                for record in records:
                    shard = record.shard
                    if record.offset != next_offset[shard]:
                        gaps += 1
                    next_offset[shard] = record.offset + 1
                    total += crc32(record.value)
                got += len(records)
            elapsed = time.perf_counter() - started
    finally:
        await reader.close()
    check_read("northguard", got, count, total, checksum, gaps, next_offset, ends)
    return count / elapsed


async def ng_latency(producer: ShardProducer, args: argparse.Namespace) -> list[float]:
    """Open-loop at ``args.rate``: latency of each record from its scheduled time, in ms.

    Like the tansu side, nothing of a send outlives its acknowledgement (the
    outcome is checked in its callback): a list of every future would only
    grow the heap the collector scans during the run.
    """
    with frozen_heap():
        return await _ng_latency(producer, args)


async def _ng_latency(producer: ShardProducer, args: argparse.Namespace) -> list[float]:
    value = os.urandom(100)
    schedule = OpenLoop(args.rate, args.latency_s)
    latencies: list[float] = []
    failures: list[BaseException] = []
    pending: set[asyncio.Future[list[int]]] = set()
    shards = args.shards

    def acked(first: int, future: asyncio.Future[list[int]]) -> None:
        pending.discard(future)
        if future.exception() is not None:
            failures.append(future.exception())  # type: ignore[arg-type]
            return
        now = time.perf_counter()
        for i in range(first, first + len(future.result()) * shards, shards):
            latencies.append((now - schedule.scheduled(i)) * 1000)

    schedule.begin()
    while not schedule.done:
        wait = schedule.wait_s()
        if wait > 0:
            await asyncio.sleep(wait)
        due = schedule.due()
        for shard in range(shards):
            first = due.start + (shard - due.start) % shards
            indices = range(first, due.stop, shards)
            if not indices:
                continue
            future = producer.send(indices[0] % shards, [Record(value) for _ in indices])
            future.add_done_callback(lambda f, first=indices[0]: acked(first, f))
            pending.add(future)
    if pending:
        await asyncio.wait(set(pending))
    if failures or len(latencies) != schedule.total:
        raise AssertionError(f"northguard latency: {len(latencies)} acked, {failures[:3]}")
    return latencies


# -- tansu through confluent-kafka ----------------------------------------------------------------


def kafka_produce(
    bootstrap: str, topic: str, values: list[bytes], count: int, args: argparse.Namespace
) -> float:
    producer = Producer(kafka_producer_config(bootstrap, LINGER_MS))
    acked = [0]
    errors: list[KafkaError] = []

    def on_delivery(error: KafkaError | None, message: Message) -> None:
        if error is not None:
            errors.append(error)
        else:
            acked[0] += 1

    producer.produce(topic, b"warm", None, 0, on_delivery)  # connection, producer id
    producer.flush(30)
    acked[0] = 0
    produce, poll = producer.produce, producer.poll
    pool = len(values)
    batch_n = args.batch
    shards = args.shards
    with frozen_heap():
        started = time.perf_counter()
        for n in range(count):
            value = values[n % pool]
            partition = (n // batch_n) % shards
            while True:
                try:
                    produce(topic, value, None, partition, on_delivery)
                    break
                except BufferError:
                    poll(0.005)
            if n % 1000 == 999:
                poll(0)
        producer.flush(120)
        elapsed = time.perf_counter() - started
    if errors or acked[0] != count:
        raise AssertionError(f"tansu produce: {acked[0]}/{count} acked, {errors[:3]}")
    return count / elapsed


def kafka_consume(
    bootstrap: str,
    topic: str,
    count: int,
    checksum: int,
    ends: dict[int, int],
    args: argparse.Namespace,
) -> float:
    consumer = Consumer(kafka_consumer_config(bootstrap))
    crc32 = zlib.crc32
    got = 0
    total = 0
    # the warm-up record sits at offset 0 of partition 0
    next_offset = {shard: 1 if shard == 0 else 0 for shard in range(args.shards)}
    gaps = 0
    try:
        with frozen_heap():
            started = time.perf_counter()
            consumer.assign(
                [TopicPartition(topic, shard, next_offset[shard]) for shard in range(args.shards)]
            )
            while got < count:
                messages = consumer.consume(POLL_RECORDS, 5.0)
                if not messages:
                    raise AssertionError(f"tansu consume stalled at {got}/{count}")
                for message in messages:
                    if message.error() is not None:
                        raise AssertionError(f"tansu consume: {message.error()}")
                    shard = message.partition()
                    offset = message.offset()
                    if offset != next_offset[shard]:
                        gaps += 1
                    next_offset[shard] = offset + 1
                    total += crc32(message.value())
                got += len(messages)
            elapsed = time.perf_counter() - started
    finally:
        consumer.close()
    ends = {shard: end + (1 if shard == 0 else 0) for shard, end in ends.items()}
    check_read("tansu", got, count, total, checksum, gaps, next_offset, ends)
    return count / elapsed


def kafka_latency(bootstrap: str, topic: str, args: argparse.Namespace) -> list[float]:
    with frozen_heap():
        return _kafka_latency(bootstrap, topic, args)


def _kafka_latency(bootstrap: str, topic: str, args: argparse.Namespace) -> list[float]:
    producer = Producer(kafka_producer_config(bootstrap, LATENCY_LINGER_MS))
    value = os.urandom(100)
    latencies: list[float] = []
    errors: list[KafkaError] = []
    schedule = OpenLoop(args.rate, args.latency_s)
    shards = args.shards

    def delivered(index: int, error: KafkaError | None, message: Message) -> None:
        if error is not None:
            errors.append(error)
        else:
            latencies.append((time.perf_counter() - schedule.scheduled(index)) * 1000)

    producer.produce(topic, value, None, 0)
    producer.flush(30)
    produce, poll = producer.produce, producer.poll
    schedule.begin()
    while not schedule.done:
        wait = schedule.wait_s()
        if wait > 0:
            poll(wait)
        for i in schedule.due():
            produce(
                topic,
                value,
                None,
                i % shards,
                lambda error, message, i=i: delivered(i, error, message),
            )
        poll(0)
    producer.flush(60)
    if errors or len(latencies) != schedule.total:
        raise AssertionError(f"tansu latency: {len(latencies)} acked, {errors[:3]}")
    return latencies


def check_read(
    side: str,
    got: int,
    count: int,
    total: int,
    checksum: int,
    gaps: int,
    next_offset: dict[int, int],
    ends: dict[int, int],
) -> None:
    problems = []
    if got != count:
        problems.append(f"read {got} records, expected {count}")
    if total & 0xFFFFFFFFFFFFFFFF != checksum:
        problems.append("value checksum differs")
    if gaps:
        problems.append(f"{gaps} offset gaps")
    if next_offset != ends:
        problems.append(f"shard ends {next_offset}, expected {ends}")
    if problems:
        raise AssertionError(f"{side} consume: " + "; ".join(problems))


# -- the run -----------------------------------------------------------------------------------------


async def one_round(
    number: int,
    order: list[str],
    ng: NorthguardBackend,
    ng_tls: NorthguardBackend,
    ng_rf3: NorthguardBackend,
    kafka_url: str,
    values: dict[int, list[bytes]],
    args: argparse.Namespace,
    rounds: Rounds,
) -> None:
    """Produce 100 B, produce 1 KiB, consume, latency; each step runs both sides in ``order``.
    Then the 100 B produce again to the plain and the TLS Northguard broker, back to back;
    then the replicated cluster's 100 B produce beside tansu's, and its latency."""
    from backends.kafka.backend import KafkaBackend

    kafka = KafkaBackend(PhysicalCluster(name="k", kind=ClusterKind.KAFKA, bootstrap=kafka_url))
    topics = {kind: f"r{number}-{kind}" for kind in ("p100", "p1k", "lat")}
    for name in topics.values():
        await kafka.create_topic(name, shard_ranges(args.shards))
        await ng.create_topic(name, shard_ranges(args.shards))
    await kafka.close()

    for label, size, count in (("100b", 100, args.records), ("1k", 1024, args.records // 4)):
        topic = topics["p100" if size == 100 else "p1k"]
        for side in order:
            if side == "northguard":
                producer = ng.producer(topic, ng_options(LINGER_MS))
                rate = await ng_produce(producer, values[size], count, args)
                await producer.close()
            else:
                rate = await asyncio.to_thread(
                    kafka_produce, kafka_url, topic, values[size], count, args
                )
            rounds.add(f"{side}_produce_{label}_records_per_s", rate)
            rounds.add(f"{side}_produce_{label}_mb_per_s", rate * size / 1e6)
        progress(
            f"round {number} produce {label}: "
            + ", ".join(
                f"{side} {rounds.values[f'{side}_produce_{label}_records_per_s'][-1]:,.0f}/s"
                for side in SIDES
            )
        )

    count = args.records
    checksum = expected_checksum(values[100], count)
    ends = shard_ends(count, args.batch, args.shards)
    for side in order:
        if side == "northguard":
            rate = await ng_consume(ng, topics["p100"], count, checksum, ends, args)
        else:
            rate = await asyncio.to_thread(
                kafka_consume, kafka_url, topics["p100"], count, checksum, ends, args
            )
        rounds.add(f"{side}_consume_100b_records_per_s", rate)
    progress(
        f"round {number} consume 100b: "
        + ", ".join(
            f"{side} {rounds.values[f'{side}_consume_100b_records_per_s'][-1]:,.0f}/s"
            for side in SIDES
        )
    )

    for side in order:
        if side == "northguard":
            producer = ng.producer(topics["lat"], ng_options(LATENCY_LINGER_MS))
            await producer.send(0, [Record(b"warm")])
            latencies = await ng_latency(producer, args)
            await producer.close()
        else:
            latencies = await asyncio.to_thread(kafka_latency, kafka_url, topics["lat"], args)
        rounds.update(latency_figures(f"{side}_produce_latency_ms", latencies))
    progress(
        f"round {number} open-loop latency at {args.rate}/s: "
        + ", ".join(
            f"{side} p50 {rounds.values[f'{side}_produce_latency_ms_p50'][-1]} "
            f"p99 {rounds.values[f'{side}_produce_latency_ms_p99'][-1]} ms"
            for side in SIDES
        )
    )

    # The cost of TLS: plain and TLS brokers, same work, back to back, first alternating.
    tls_order = TLS_VARIANTS if number % 2 == 0 else TLS_VARIANTS[::-1]
    for variant in tls_order:
        backend = ng if variant == "plain" else ng_tls
        topic = f"r{number}-{variant}-p100"
        await backend.create_topic(topic, shard_ranges(args.shards))
        producer = backend.producer(topic, ng_options(LINGER_MS))
        rate = await ng_produce(producer, values[100], args.records, args)
        await producer.close()
        rounds.add(f"northguard_{variant}_produce_100b_records_per_s", rate)
    progress(
        f"round {number} produce 100b plain vs TLS: "
        + ", ".join(
            f"{variant} {rounds.values[f'northguard_{variant}_produce_100b_records_per_s'][-1]:,.0f}/s"
            for variant in TLS_VARIANTS
        )
    )

    await replicated_round(number, order, ng_rf3, kafka_url, values, args, rounds)


async def replicated_round(
    number: int,
    order: list[str],
    ng_rf3: NorthguardBackend,
    kafka_url: str,
    values: dict[int, list[bytes]],
    args: argparse.Namespace,
    rounds: Rounds,
) -> None:
    """100 B produce to the replicated cluster and to tansu (fresh topics, ``order``), then the
    replicated cluster's open-loop latency."""
    from backends.kafka.backend import KafkaBackend

    topic = f"r{number}-rf3-p100"
    kafka = KafkaBackend(PhysicalCluster(name="k", kind=ClusterKind.KAFKA, bootstrap=kafka_url))
    await kafka.create_topic(topic, shard_ranges(args.shards))
    await kafka.close()
    await ng_rf3.create_topic(topic, shard_ranges(args.shards))
    for side in order:
        if side == "northguard":
            producer = ng_rf3.producer(topic, ng_options(LINGER_MS))
            rate = await ng_produce(producer, values[100], args.records, args)
            await producer.close()
            rounds.add("northguard_rf3_produce_100b_records_per_s", rate)
        else:
            rate = await asyncio.to_thread(
                kafka_produce, kafka_url, topic, values[100], args.records, args
            )
            rounds.add("tansu_rf3_pair_produce_100b_records_per_s", rate)
    latency_topic = f"r{number}-rf3-lat"
    await ng_rf3.create_topic(latency_topic, shard_ranges(args.shards))
    producer = ng_rf3.producer(latency_topic, ng_options(LATENCY_LINGER_MS))
    await producer.send(0, [Record(b"warm")])
    latencies = await ng_latency(producer, args)
    await producer.close()
    rounds.update(latency_figures("northguard_rf3_produce_latency_ms", latencies))
    progress(
        f"round {number} replication factor {REPLICATION_FACTOR}: produce 100b "
        f"{rounds.values['northguard_rf3_produce_100b_records_per_s'][-1]:,.0f}/s against tansu "
        f"{rounds.values['tansu_rf3_pair_produce_100b_records_per_s'][-1]:,.0f}/s; open-loop "
        f"p50 {rounds.values['northguard_rf3_produce_latency_ms_p50'][-1]} "
        f"p99 {rounds.values['northguard_rf3_produce_latency_ms_p99'][-1]} ms"
    )


async def run(args: argparse.Namespace) -> tuple[Rounds, dict[str, Any]]:
    rounds = Rounds()
    facts: dict[str, Any] = {}
    values = {100: make_values(100), 1024: make_values(1024)}
    with tempfile.TemporaryDirectory(prefix="bench-northguard-") as run_dir:
        data_dir = Path(run_dir) / "ng-data"
        tansu = start_kafka(Path(run_dir))
        northguard = start_northguard_broker(data_dir, log_path=Path(run_dir) / "ng.log")
        certificates = make_test_certificates(Path(run_dir) / "tls")
        secret = secrets.token_hex(32)
        northguard_tls = start_northguard_broker(
            Path(run_dir) / "ng-tls-data",
            broker_id="2",
            log_path=Path(run_dir) / "ng-tls.log",
            tls=certificates,
            secret=secret,
        )
        cluster = start_northguard_cluster(
            Path(run_dir) / "ng-rf3", REPLICATION_FACTOR, replication_factor=REPLICATION_FACTOR
        )
        metrics_url = f"http://127.0.0.1:{northguard.http_port}/metrics"
        cluster_metrics = [f"http://127.0.0.1:{b.http_port}/metrics" for b in cluster]
        try:
            ng = NorthguardBackend(
                PhysicalCluster(name="ng", kind=ClusterKind.NORTHGUARD, bootstrap=northguard.url)
            )
            ng_tls = NorthguardBackend(
                PhysicalCluster(
                    name="ng-tls",
                    kind=ClusterKind.NORTHGUARD,
                    bootstrap=northguard_tls.url,
                    attributes={
                        TLS_ATTRIBUTE: "true",
                        CA_ATTRIBUTE: str(certificates.ca),
                        SECRET_ATTRIBUTE: secret,  # the backend signs its own credential with it
                    },
                )
            )
            ng_rf3 = NorthguardBackend(
                PhysicalCluster(
                    name="ng-rf3",
                    kind=ClusterKind.NORTHGUARD,
                    bootstrap=",".join(b.url for b in cluster),
                )
            )
            progress(
                f"northguard at {northguard.url}, tansu at {tansu.url}, "
                f"replicated cluster at {','.join(b.url for b in cluster)}"
            )
            # warm both sides (connections, code paths) on a topic of their own
            await ng.create_topic("warm", shard_ranges(args.shards))
            producer = ng.producer("warm", ng_options(LINGER_MS))
            await ng_produce(producer, values[100], args.batch * args.shards * 4, args)
            await producer.close()
            await ng_tls.create_topic("warm", shard_ranges(args.shards))
            producer = ng_tls.producer("warm", ng_options(LINGER_MS))
            await ng_produce(producer, values[100], args.batch * args.shards * 4, args)
            await producer.close()
            await ng_rf3.create_topic("warm", shard_ranges(args.shards))
            producer = ng_rf3.producer("warm", ng_options(LINGER_MS))
            await ng_produce(producer, values[100], args.batch * args.shards * 4, args)
            await producer.close()
            before = prometheus_counters(metrics_url, "northguard_")
            cluster_before = [prometheus_counters(url, "northguard_") for url in cluster_metrics]
            for number, order in enumerate(alternating(args.rounds, list(SIDES))):
                await one_round(number, order, ng, ng_tls, ng_rf3, tansu.url, values, args, rounds)
            after = prometheus_counters(metrics_url, "northguard_")
            cluster_after = [prometheus_counters(url, "northguard_") for url in cluster_metrics]
            await ng.close()
            await ng_tls.close()
            await ng_rf3.close()
            facts = broker_facts(delta(before, after), after, data_dir)
            facts["northguard_rf3_fsyncs_per_broker"] = [
                int(delta(b, a).get("northguard_store_fsyncs_total", 0.0))
                for b, a in zip(cluster_before, cluster_after, strict=True)
            ]
            facts["northguard_rf3_records_made_durable_per_broker"] = [
                int(delta(b, a).get("northguard_store_flushed_records_total", 0.0))
                for b, a in zip(cluster_before, cluster_after, strict=True)
            ]
        finally:
            for broker in reversed(cluster):
                broker.stop()
            northguard.stop()
            northguard_tls.stop()
            tansu.stop()
    for kind in ("produce_100b", "produce_1k", "consume_100b"):
        rounds.ratio(
            f"{kind}_ratio", f"northguard_{kind}_records_per_s", f"tansu_{kind}_records_per_s"
        )
    rounds.ratio(
        "rf3_produce_100b_ratio",
        "northguard_rf3_produce_100b_records_per_s",
        "tansu_rf3_pair_produce_100b_records_per_s",
    )
    rounds.ratio(
        "tls_produce_ratio",
        "northguard_tls_produce_100b_records_per_s",
        "northguard_plain_produce_100b_records_per_s",
    )
    return rounds, facts


def broker_facts(counts: dict[str, float], now: dict[str, float], data_dir: Path) -> dict[str, Any]:
    """The Northguard broker's own counters over the measured rounds, and where its data lives."""
    flushes = counts.get("northguard_store_flushes_total", 0.0)
    fsyncs = counts.get("northguard_store_fsyncs_total", 0.0)
    records = counts.get("northguard_store_flushed_records_total", 0.0)
    flush_s = counts.get("northguard_store_flush_seconds_total", 0.0)
    hits = counts.get("northguard_store_cache_hits_total", 0.0)
    misses = counts.get("northguard_store_cache_misses_total", 0.0)
    return {
        **storage_facts(data_dir),
        "northguard_flushes": int(flushes),
        "northguard_fsyncs": int(fsyncs),
        "northguard_records_made_durable": int(records),
        "northguard_records_per_fsync": round(records / fsyncs, 1) if fsyncs else None,
        "northguard_flush_ms_mean": round(flush_s / flushes * 1000, 2) if flushes else None,
        "northguard_read_cache_hit_rate": round(hits / (hits + misses), 3)
        if hits + misses
        else None,
        "northguard_segments_direct_io": [
            int(now.get("northguard_store_segments_direct_io", 0)),
            int(now.get("northguard_store_segments", 0)),
        ],
    }


def main() -> None:
    parser = bench_parser(__doc__, rounds_default=4)  # even: each side goes first as often
    parser.add_argument("--records", type=int, default=0, help="100-byte records per produce run")
    parser.add_argument("--batch", type=int, default=1000, help="records per send call / shard run")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--rate", type=int, default=10_000, help="records/s of the latency run")
    parser.add_argument("--latency-s", type=float, default=0.0, help="seconds of the latency run")
    args = parser.parse_args()
    args.rounds = rounds_of(args)
    args.records = args.records or (200_000 if args.quick else 1_000_000)
    args.latency_s = args.latency_s or (3.0 if args.quick else 10.0)
    rounds, facts = asyncio.run(run(args))
    figures = rounds.figures()
    figures["rounds"] = args.rounds
    targets = {
        "produce_latency_ms_p99_at_10k": target(
            figures["northguard_produce_latency_ms_p99"], 20.0, "<="
        ),
        "produce_100b_ratio_vs_tansu": report_only(figures["produce_100b_ratio"], 1.0),
        "produce_1k_ratio_vs_tansu": report_only(figures["produce_1k_ratio"], 1.0),
        "consume_100b_ratio_vs_tansu": report_only(figures["consume_100b_ratio"], 1.0),
        "tls_produce_ratio": target(figures["tls_produce_ratio"], 0.8, ">="),
        "rf3_produce_100b_ratio_vs_tansu": target(figures["rf3_produce_100b_ratio"], 0.3, ">="),
        "rf3_produce_latency_ms_p99_at_10k": target(
            figures["northguard_rf3_produce_latency_ms_p99"], 50.0, "<="
        ),
    }
    finish(
        "northguard",
        figures,
        targets,
        no_fail=args.no_fail,
        spread=rounds.spread(),
        config={
            "records_100b": args.records,
            "records_1k": args.records // 4,
            "shards": args.shards,
            "batch_records": args.batch,
            "latency_rate_per_s": args.rate,
            "latency_s": args.latency_s,
            "value_pool": VALUE_POOL,
            "northguard_producer": {
                "linger_ms": LINGER_MS,
                "batch_bytes_max": BATCH_BYTES_MAX,
                "buffer_bytes_max": BUFFER_BYTES_MAX,
                "latency_linger_ms": LATENCY_LINGER_MS,
            },
            "northguard_reader": {"fetch_bytes_max": FETCH_BYTES_MAX, "poll_records": POLL_RECORDS},
            "northguard_broker": "fps store, defaults (self-clocking group commit, flushes at least 5 ms "
            "apart), fsync per group commit",
            "northguard_tls": "a second broker, same settings and disk, client port TLS 1.2+ "
            "(P-256 test certificate, TLS 1.3 negotiated) and a cluster secret (signed credential "
            "per connection, every request authorized); 100 B produce to the plain and the "
            "secured broker back to back per round, first alternating; machine facts are the "
            "plain one's",
            "northguard_rf3": f"{REPLICATION_FACTOR} brokers as one cluster on this machine, "
            f"replication factor {REPLICATION_FACTOR} (broker 1 coordinates and leads; an append "
            "is acknowledged once every replica's store has fsynced it), same producer settings",
            "tansu_producer": kafka_producer_config("<tansu>", LINGER_MS),
            "tansu_latency_producer": kafka_producer_config("<tansu>", LATENCY_LINGER_MS),
            "tansu_consumer": kafka_consumer_config("<tansu>"),
        },
        confluent_kafka=confluent_kafka.version()[0],
        librdkafka=confluent_kafka.libversion()[0],
        peer="tansu 0.6.0, memory storage (no fsync, data in memory) via confluent-kafka acks=all",
        quick=args.quick,
        **facts,
    )


if __name__ == "__main__":
    guard("northguard", main)
