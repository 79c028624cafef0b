"""A broker with many ranges and segments: bounded descriptors, and crashes during wide flushes.

Real broker processes.  The descriptor test lowers the broker's own
``RLIMIT_NOFILE`` (``preexec_fn``) and makes it hold ten times more segments
than that limit, across a restart; the crash test SIGKILLs a broker while a
producer writes hundreds of ranges at once (each flush touches all of them,
and segment files are synced only at checkpoints) and checks that every
acknowledged record is still there.
"""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from ng_harness import backend_for, read_until

from backends.northguard.launcher import NorthguardProcess
from xinfra.backend import ProducerOptions
from xinfra.keyspace import shard_ranges
from xinfra.model import Record
from xinfra.services.ports import free_port, port_open

FILE_LIMIT = 512
RANGES = 2600  # two topics of a segment per range: 5,200 segments, 10x the limit
WIDE_RANGES = 512


class LimitedBroker:
    """A broker process whose open-file limit is ``FILE_LIMIT``, with its own start/stop."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        self.http_port = free_port()
        self.popen: subprocess.Popen[bytes] | None = None
        self.log_path = data_dir.parent / "broker.log"

    def start(self) -> None:
        def limit() -> None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (FILE_LIMIT, FILE_LIMIT))

        argv = [sys.executable, "-m", "backends.northguard.broker", "--port", str(self.port)]
        argv += ["--http-port", str(self.http_port), "--data-dir", str(self.data_dir)]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.popen = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=limit,
                start_new_session=True,
                cwd=Path(__file__).resolve().parents[2],
            )
        deadline = time.monotonic() + 60
        while not port_open("127.0.0.1", self.port):  # open once recovery is done
            assert self.popen.poll() is None, self.log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "the broker did not start"
            time.sleep(0.05)

    def metrics(self) -> dict[str, float]:
        url = f"http://127.0.0.1:{self.http_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        return values

    def open_descriptors(self) -> int:
        assert self.popen is not None
        return len(os.listdir(f"/proc/{self.popen.pid}/fd"))

    def stop(self) -> None:
        if self.popen is None:
            return
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()
        self.popen = None


@pytest.fixture
def limited_broker(tmp_path: Path) -> Iterator[LimitedBroker]:
    broker = LimitedBroker(tmp_path / "data")
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


async def _write_every_range(address: str, generation: int, topic: str = "wide") -> None:
    backend = backend_for(address)
    producer = backend.producer(topic, ProducerOptions(linger_ms=5))
    try:
        await asyncio.gather(
            *(
                producer.send(shard, [Record(value=b"%d/%d" % (generation, shard))])
                for shard in range(RANGES)
            )
        )
        await producer.flush()
    finally:
        await producer.close()
        await backend.close()


async def test_a_broker_serves_ten_times_more_segments_than_its_file_limit(
    limited_broker: LimitedBroker,
) -> None:
    address = f"127.0.0.1:{limited_broker.port}"
    admin = backend_for(address)
    await admin.create_topic("wide", shard_ranges(RANGES))
    await admin.close()
    await _write_every_range(address, 1)
    admin = backend_for(address)
    await admin.seal_topic("wide")  # every segment sealed: read back through the pool
    await admin.create_topic("wide-2", shard_ranges(RANGES))
    await admin.close()
    await asyncio.to_thread(limited_broker.stop)
    await asyncio.to_thread(limited_broker.start)
    await _write_every_range(address, 2, "wide-2")  # a new segment in every range

    metrics = limited_broker.metrics()
    assert metrics["northguard_store_segments"] == 2 * RANGES >= 10 * FILE_LIMIT
    bound = metrics["northguard_store_pool_descriptors_max"]
    assert metrics["northguard_store_pool_descriptors"] <= bound < FILE_LIMIT
    assert limited_broker.open_descriptors() < FILE_LIMIT

    backend = backend_for(address)
    by_shard: dict[int, list[bytes | None]] = {}
    for topic in ("wide", "wide-2"):
        reader = backend.reader(topic)
        try:
            reader.assign(dict.fromkeys(range(RANGES), 0))
            records = await read_until(reader, RANGES, timeout_s=120)
        finally:
            await reader.close()
        for record in records:
            by_shard.setdefault(record.shard, []).append(record.value)
    await backend.close()
    assert by_shard == {s: [b"1/%d" % s, b"2/%d" % s] for s in range(RANGES)}
    assert limited_broker.metrics()["northguard_store_pool_descriptors"] <= bound


async def test_a_crash_during_wide_flushes_loses_nothing_acknowledged(
    private_broker: NorthguardProcess,
) -> None:
    address = private_broker.url
    admin = backend_for(address)
    await admin.create_topic("crash-wide", shard_ranges(WIDE_RANGES))
    await admin.close()
    backend = backend_for(address, request_timeout_s="5")
    producer = backend.producer("crash-wide", ProducerOptions(linger_ms=2, request_timeout_s=5))
    acknowledged: dict[tuple[int, int], bytes] = {}
    in_flight: set[asyncio.Future[list[int]]] = set()

    def send(shard: int, number: int) -> None:
        value = b"%d:%d" % (shard, number)
        future = producer.send(shard, [Record(value=value)])

        def settle(done: asyncio.Future[list[int]]) -> None:
            if not done.cancelled() and done.exception() is None:
                acknowledged[(shard, done.result()[0])] = value

        future.add_done_callback(settle)
        in_flight.add(future)
        future.add_done_callback(in_flight.discard)

    try:
        number = 0
        while len(acknowledged) < 4 * WIDE_RANGES:  # every round touches every range
            for shard in range(WIDE_RANGES):
                send(shard, number)
            number += 1
            await asyncio.wait(in_flight)
        for shard in range(WIDE_RANGES):  # a round in flight when the broker dies
            send(shard, number)
        await asyncio.to_thread(private_broker.kill)  # the sends in flight are never acknowledged
    finally:
        await producer.close()
        await backend.close()
    await asyncio.to_thread(private_broker.restart)

    backend = backend_for(address)
    reader = backend.reader("crash-wide")
    try:
        reader.assign(dict.fromkeys(range(WIDE_RANGES), 0))
        got = await read_until(reader, len(acknowledged), timeout_s=120)
        got += await reader.poll(max_records=WIDE_RANGES, timeout_s=1)
    finally:
        await reader.close()
        await backend.close()
    stored = {(record.shard, record.offset): record.value for record in got}
    for key, value in acknowledged.items():
        assert stored.get(key) == value, f"acknowledged record {key} lost or changed"
