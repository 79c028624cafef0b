"""The SDK's cost over the bare backend: produce and consume records/s, same run, same broker.

Set-up (started here): tansu (``start_kafka``), a Northguard broker, and a
metadata service in-process (uvicorn in a thread, SQLite) with both clusters
registered.

For each backend, on a topic of ``SHARDS`` shards, ``records`` records of a
``KEY_BYTES``-byte key and a ``VALUE_BYTES``-byte value (prepared as raw
``(key, value)`` bytes, values cycled from a pool of distinct ones):

* bare produce: the best loop a competent user writes with ``xinfra.backend``:
  in the timed loop, ``Record`` objects are built and routed by key
  (``shard_of_key``: a keyed topic needs it with or without the SDK),
  ``BATCH_RECORDS`` input records at a time, and each shard's part is sent at
  once (all shards in flight together), as many calls in flight as the
  producer's buffer allows (``Backpressure`` is the only brake).  The backend
  producer gets the same linger, batch and buffer limits as the SDK gives
  its own (``XinfraProducerOptions().backend_options()``);
* SDK produce: ``XinfraProducer.send_batch`` of ``BATCH_RECORDS`` records per
  call, the ``Record`` objects built in the timed loop too (key routing,
  batching, back-pressure, positions all included), then ``flush``;
* SDK produce per record: ``XinfraProducer.send`` one record at a time, a
  future each (Kafka-client style); reported beside, no target;
* bare consume / SDK consume: a ``ShardReader`` over every shard, and an
  ``XinfraConsumer`` assigned the virtual topic, each reading the topic the
  SDK wrote from the start until every record is back, each checking count,
  a checksum of the values and offset continuity per shard in the timed loop.

Every send's outcome is checked on both sides.  Rounds are paired and
alternate which side goes first (4 by default: an even count, so each side goes
first as often; the side that goes second measured slower here); figures are medians with the min-max spread,
ratios the median of the per-round paired ratios.  Each timed loop runs under
``frozen_heap`` (bench/report.py): the prepared inputs are kept out of the
collector's full scans, while garbage the timed code makes is collected as
usual.

Targets: SDK / bare >= 0.8 for produce and consume on every backend.

    .venv/bin/python bench/sdk.py --quick
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import uvicorn  # noqa: E402
from report import (  # noqa: E402  (bench/report.py: what every bench shares)
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

from backends.northguard.launcher import start_northguard_broker  # noqa: E402
from clients import (  # noqa: E402
    XinfraConsumerOptions,
    XinfraProducerOptions,
    open_consumer,
    open_producer,
)
from metadata_service import ServiceConfig, create_app  # noqa: E402
from xinfra.backend import Backend, ShardProducer, ShardReader, open_backend  # noqa: E402
from xinfra.errors import Backpressure  # noqa: E402
from xinfra.keyspace import shard_of_key, shard_ranges  # noqa: E402
from xinfra.model import ClusterKind, ConsumedRecord, PhysicalCluster, Record  # noqa: E402
from xinfra.rest import MetadataClient  # noqa: E402
from xinfra.services.kafka import start_kafka  # noqa: E402
from xinfra.services.ports import free_port  # noqa: E402

TOKEN = "bench-" + uuid.uuid4().hex
VC = "default"
SHARDS = 4
KEY_BYTES = 8
VALUE_BYTES = 100
VALUE_POOL = 4096
BATCH_RECORDS = 1000
POLL_RECORDS = 5000
TARGET_RATIO = 0.8
SIDES = ("bare", "sdk")


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
        self.app = create_app(config)
        self.server = uvicorn.Server(
            uvicorn.Config(
                self.app,
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
        # As SIGTERM does in ``metadata_service.server``: the clients' long-polls are answered
        # first, not cancelled by uvicorn's graceful-shutdown timeout (a traceback each).
        self.app.state.services.begin_shutdown()
        self.server.should_exit = True
        self.thread.join(15)


class Inputs:
    """The prepared raw inputs and what a reader of them must find."""

    def __init__(self, count: int) -> None:
        values = [os.urandom(VALUE_BYTES) for _ in range(VALUE_POOL)]
        self.records = [(b"%08d" % (i % 100_000), values[i % VALUE_POOL]) for i in range(count)]
        self.checksum = sum(zlib.crc32(value) for _, value in self.records)
        self.ends = dict.fromkeys(range(SHARDS), 0)
        for key, _ in self.records:
            self.ends[shard_of_key(key, SHARDS)] += 1


async def bare_produce(backend: Backend, topic: str, inputs: Inputs) -> float:
    await backend.create_topic(topic, shard_ranges(SHARDS))
    producer = backend.producer(topic, XinfraProducerOptions().backend_options())
    try:
        with frozen_heap():
            return await _bare_produce(producer, inputs.records)
    finally:
        await producer.close()


async def _bare_produce(producer: ShardProducer, records: list[tuple[bytes, bytes]]) -> float:
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

    send = producer.send
    started = time.perf_counter()
    for i in range(0, len(records), BATCH_RECORDS):
        per_shard: list[list[Record]] = [[] for _ in range(SHARDS)]
        for key, value in records[i : i + BATCH_RECORDS]:
            per_shard[shard_of_key(key, SHARDS)].append(Record(value, key))
        for shard, batch in enumerate(per_shard):
            if not batch:
                continue
            while True:
                try:
                    future = send(shard, batch)
                    break
                except Backpressure:
                    await asyncio.wait(set(pending), return_when=asyncio.FIRST_COMPLETED)
            pending.add(future)
            future.add_done_callback(on_done)
    await producer.flush()
    elapsed_s = time.perf_counter() - started
    if failures or acked[0] != len(records):
        raise AssertionError(f"bare produce: {acked[0]}/{len(records)} acked, {failures[:3]}")
    return len(records) / elapsed_s


async def sdk_produce(url: str, topic: str, inputs: Inputs, per_record: bool) -> float:
    records = inputs.records
    producer = await open_producer(url, TOKEN, VC, topics=[topic])
    try:
        futures: list[asyncio.Future[Any]] = []
        with frozen_heap():
            started = time.perf_counter()
            if per_record:
                send = producer.send
                for key, value in records:
                    futures.append(await send(topic, value, key=key))
            else:
                send_batch = producer.send_batch
                for i in range(0, len(records), BATCH_RECORDS):
                    batch = [Record(value, key) for key, value in records[i : i + BATCH_RECORDS]]
                    futures.append(await send_batch(topic, batch))
            await producer.flush()
            elapsed_s = time.perf_counter() - started
        failed = [f for f in futures if not f.done() or f.exception() is not None]
        if failed:
            raise AssertionError(f"SDK produce: {len(failed)} sends failed: {failed[0]}")
        acked = len(futures) if per_record else sum(len(f.result()) for f in futures)
        if acked != len(records):
            raise AssertionError(f"SDK produce: {acked}/{len(records)} positions")
        return len(records) / elapsed_s
    finally:
        await producer.close()


class ReadCheck:
    """Count, value checksum and per-shard offset continuity, fed a poll's records at a time."""

    def __init__(self) -> None:
        self.count = 0
        self.checksum = 0
        self.gaps = 0
        self.next_offset = dict.fromkeys(range(SHARDS), 0)

    def feed(self, records: Sequence[Any]) -> None:
        crc32 = zlib.crc32
        next_offset = self.next_offset
        total = 0
        gaps = 0
        for record in records:
            shard = record.shard
            if record.offset != next_offset[shard]:
                gaps += 1
            next_offset[shard] = record.offset + 1
            total += crc32(record.value)
        self.checksum += total
        self.gaps += gaps
        self.count += len(records)

    def verify(self, side: str, inputs: Inputs) -> None:
        problems = []
        if self.count != len(inputs.records):
            problems.append(f"read {self.count} records, expected {len(inputs.records)}")
        if self.checksum != inputs.checksum:
            problems.append("value checksum differs")
        if self.gaps:
            problems.append(f"{self.gaps} offset gaps")
        if self.next_offset != inputs.ends:
            problems.append(f"shard ends {self.next_offset}, expected {inputs.ends}")
        if problems:
            raise AssertionError(f"{side} consume: " + "; ".join(problems))


async def _consume(
    side: str, poll: Callable[[int, float], Any], inputs: Inputs, start: Callable[[], Any]
) -> float:
    check = ReadCheck()
    expected = len(inputs.records)
    with frozen_heap():
        started = time.perf_counter()
        await start()
        while check.count < expected:
            records = await poll(POLL_RECORDS, 5.0)
            if not records:
                raise AssertionError(f"{side} consume stalled at {check.count}/{expected}")
            check.feed(records)
        elapsed_s = time.perf_counter() - started
    check.verify(side, inputs)
    return expected / elapsed_s


async def bare_consume(backend: Backend, physical: str, inputs: Inputs) -> float:
    """A reader made, and every shard assigned from its first retained offset, in the timed part.

    What ``XinfraConsumer.assign(topic)`` does on the SDK side (its reader is
    made and the start offsets asked at its first poll): same work both sides.
    """
    readers: list[ShardReader] = []

    async def poll(max_records: int, timeout_s: float) -> list[ConsumedRecord]:
        return await readers[0].poll(max_records, timeout_s)

    async def start() -> None:
        reader = backend.reader(physical)
        readers.append(reader)
        reader.assign(await reader.start_offsets(range(SHARDS)))

    try:
        return await _consume("bare", poll, inputs, start)
    finally:
        for reader in readers:
            await reader.close()


async def sdk_consume(url: str, topic: str, inputs: Inputs) -> float:
    consumer = await open_consumer(url, TOKEN, VC, options=XinfraConsumerOptions(), topics=[topic])

    async def start() -> None:
        await consumer.assign(topic)

    try:
        return await _consume("SDK", consumer.poll, inputs, start)
    finally:
        await consumer.close()


async def measure(
    name: str, cluster: PhysicalCluster, url: str, inputs: Inputs, rounds_n: int, rounds: Rounds
) -> None:
    """Bare and SDK loops, the first side alternating round by round; every figure per round."""
    backend = open_backend(cluster)
    try:
        # Warm both paths (connections, metadata, code) on a few records first.
        warm = Inputs(2000)
        await bare_produce(backend, f"bench-warm-{uuid.uuid4().hex[:8]}", warm)
        with MetadataClient(url, token=TOKEN) as admin:
            admin.create_topic(VC, f"warm-{name}", cluster.name, SHARDS)
        await sdk_produce(url, f"warm-{name}", warm, per_record=False)
        for number, order in enumerate(alternating(rounds_n, list(SIDES))):
            bare_topic = f"bench-bare-{uuid.uuid4().hex[:8]}"
            virtual = f"bench-sdk-{uuid.uuid4().hex[:8]}"
            per_record_topic = f"bench-sdk-send-{uuid.uuid4().hex[:8]}"
            with MetadataClient(url, token=TOKEN) as admin:
                metadata = admin.create_topic(VC, virtual, cluster.name, SHARDS)
                admin.create_topic(VC, per_record_topic, cluster.name, SHARDS)
            physical = metadata.current_epoch.physical_topic
            got: dict[str, float] = {}
            for side in order:
                if side == "bare":
                    got["bare_p"] = await bare_produce(backend, bare_topic, inputs)
                else:
                    got["sdk_p"] = await sdk_produce(url, virtual, inputs, per_record=False)
            got["sdk_r"] = await sdk_produce(url, per_record_topic, inputs, per_record=True)
            for side in order:
                if side == "bare":
                    got["bare_c"] = await bare_consume(backend, physical, inputs)
                else:
                    got["sdk_c"] = await sdk_consume(url, virtual, inputs)
            rounds.update(
                {
                    f"{name}_bare_produce_records_per_s": got["bare_p"],
                    f"{name}_sdk_produce_records_per_s": got["sdk_p"],
                    f"{name}_sdk_send_per_record_records_per_s": got["sdk_r"],
                    f"{name}_bare_consume_records_per_s": got["bare_c"],
                    f"{name}_sdk_consume_records_per_s": got["sdk_c"],
                    f"{name}_produce_ratio": got["sdk_p"] / got["bare_p"],
                    f"{name}_send_per_record_ratio": got["sdk_r"] / got["bare_p"],
                    f"{name}_consume_ratio": got["sdk_c"] / got["bare_c"],
                }
            )
            log(
                f"{name} round {number} ({' first, '.join(order)} second): produce bare "
                f"{got['bare_p']:,.0f}/s, SDK send_batch {got['sdk_p']:,.0f}/s "
                f"({got['sdk_p'] / got['bare_p']:.3f}x), SDK send {got['sdk_r']:,.0f}/s; "
                f"consume bare {got['bare_c']:,.0f}/s, SDK {got['sdk_c']:,.0f}/s "
                f"({got['sdk_c'] / got['bare_c']:.3f}x)"
            )
    finally:
        await backend.close()


def main() -> None:
    parser = bench_parser(__doc__, rounds_default=4)  # even: each side goes first as often
    parser.add_argument("--records", type=int, default=0, help="records per loop")
    args = parser.parse_args()
    rounds_n = rounds_of(args)
    count = args.records or (50_000 if args.quick else 300_000)
    inputs = Inputs(count)
    rounds = Rounds()
    rounds.set("records", count)
    rounds.set("rounds", rounds_n)
    facts: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="xinfra-bench-sdk-") as tmp, ExitStack() as stack:
        run_dir = Path(tmp)
        kafka = start_kafka(run_dir / "kafka")
        stack.callback(kafka.stop)
        service = Service(run_dir / "service")
        stack.callback(service.stop)
        ng_data = run_dir / "northguard" / "data"
        northguard = start_northguard_broker(ng_data, log_path=run_dir / "northguard.log")
        stack.callback(northguard.stop)
        facts = {f"northguard_{k}": v for k, v in storage_facts(ng_data).items()}
        clusters = [
            PhysicalCluster(name="kafka", kind=ClusterKind.KAFKA, bootstrap=kafka.url),
            PhysicalCluster(
                name="northguard", kind=ClusterKind.NORTHGUARD, bootstrap=northguard.url
            ),
        ]
        with MetadataClient(service.url, token=TOKEN) as admin:
            for cluster in clusters:
                admin.register_cluster(cluster)
        for cluster in clusters:
            asyncio.run(measure(cluster.name, cluster, service.url, inputs, rounds_n, rounds))
    figures = rounds.figures()
    targets = {
        f"{cluster}_{op}_ratio": target(figures[f"{cluster}_{op}_ratio"], TARGET_RATIO)
        for cluster in ("kafka", "northguard")
        for op in ("produce", "consume")
    }
    backend_options = XinfraProducerOptions().backend_options()
    finish(
        "sdk",
        figures,
        targets,
        no_fail=args.no_fail,
        spread=rounds.spread(),
        config={
            "shards": SHARDS,
            "key_bytes": KEY_BYTES,
            "value_bytes": VALUE_BYTES,
            "value_pool": VALUE_POOL,
            "records_per_call": BATCH_RECORDS,
            "poll_records": POLL_RECORDS,
            "sdk_producer": {
                k: getattr(XinfraProducerOptions(), k)
                for k in ("linger_ms", "batch_records_max", "batch_bytes_max", "buffer_bytes_max")
            },
            "backend_producer_both_sides": {
                "linger_ms": backend_options.linger_ms,
                "batch_bytes_max": backend_options.batch_bytes_max,
                "buffer_bytes_max": backend_options.buffer_bytes_max,
            },
            "bare_loop": "all shards per call in flight at once, calls until Backpressure",
            "reader_fetch_bytes_max_both_sides": XinfraConsumerOptions().fetch_bytes_max,
            "metadata_service": "in-process, SQLite",
        },
        peer="the bare backend loop (xinfra.backend) on the same brokers: tansu (memory) and Northguard (fps)",
        quick=args.quick,
        **facts,
    )


if __name__ == "__main__":
    guard("sdk", main)
