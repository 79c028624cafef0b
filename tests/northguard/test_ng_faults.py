"""A real broker process under faults: stopped (SIGSTOP) past the request timeout, and a full disk.

Every wait has a bound that fires: a send to a hung broker fails with
``Timeout`` after ``request_timeout_s`` and ``close`` returns, while the
connection stays usable for when the broker wakes up.  A full data
directory is a clear ``StorageError`` with the errno text, a bounded rate of
stream reopens and log lines (no busy loop), and service again once space
returns, without a restart.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ng_harness import WAIT_S, backend_for, mounted_tmpfs, read_until

from backends.northguard.launcher import NorthguardProcess, start_northguard_broker
from xinfra.backend import ProducerOptions
from xinfra.errors import StorageError, Timeout
from xinfra.keyspace import shard_ranges
from xinfra.model import Record

REQUEST_TIMEOUT_S = 1.5
BOUND_S = 30.0
"""How long the test waits for what must happen within ``REQUEST_TIMEOUT_S``: a hang fails it."""


@contextmanager
def stopped(process: NorthguardProcess) -> Iterator[None]:
    """The broker frozen by SIGSTOP (it holds its sockets open but answers nothing)."""
    os.kill(process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(process.pid, signal.SIGCONT)


async def test_a_stopped_broker_times_sends_out_then_serves_them_after_sigcont(
    private_broker: NorthguardProcess, topic_name: str
) -> None:
    backend = backend_for(private_broker.url, request_timeout_s=str(REQUEST_TIMEOUT_S))
    await backend.create_topic(topic_name, shard_ranges(1))
    options = ProducerOptions(linger_ms=0, request_timeout_s=REQUEST_TIMEOUT_S)
    producer = backend.producer(topic_name, options)
    closing = backend.producer(topic_name, options)
    try:
        acknowledged = {
            offset: b"before" for offset in await producer.send(0, [Record(value=b"before")] * 10)
        }
        await closing.send(0, [Record(value=b"closing")])
        with stopped(private_broker):
            started = time.monotonic()
            doomed = producer.send(0, [Record(value=b"during")])
            try:
                await asyncio.wait_for(doomed, BOUND_S)
                raise AssertionError("a send to a stopped broker was acknowledged")
            except Timeout as error:
                assert "1.5 s" in error.message, error
            assert time.monotonic() - started < BOUND_S
            try:
                await asyncio.wait_for(backend.describe_topic(topic_name), BOUND_S)
                raise AssertionError("a request to a stopped broker was answered")
            except Timeout:
                pass
            pending = closing.send(0, [Record(value=b"unanswered")])
            await asyncio.wait_for(closing.close(), BOUND_S)  # close has a bound
            assert pending.done() and isinstance(pending.exception(), Timeout)
        # The broker wakes: the same producer (and its connection) serves new sends.
        after = await asyncio.wait_for(producer.send(0, [Record(value=b"after")] * 5), BOUND_S)
        acknowledged.update({offset: b"after" for offset in after})
    finally:
        await producer.close()
        await closing.close()
        await backend.close()
    reading = backend_for(private_broker.url)
    reader = reading.reader(topic_name)
    try:
        reader.assign({0: 0})
        records = await read_until(reader, max(acknowledged) + 1)
    finally:
        await reader.close()
        await reading.close()
    stored = {record.offset: record.value for record in records}
    for offset, value in acknowledged.items():
        assert stored.get(offset) == value, f"acknowledged offset {offset} lost or changed"


def health(process: NorthguardProcess) -> dict[str, Any]:
    url = f"http://127.0.0.1:{process.http_port}/health"
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            body: dict[str, Any] = json.load(response)
    except urllib.error.HTTPError as error:  # 503 while failing, with the same JSON body
        body = json.load(error)
    return body


def metric(process: NorthguardProcess, name: str) -> float:
    """The sum of every sample of ``name`` on ``/metrics`` (0 when absent)."""
    url = f"http://127.0.0.1:{process.http_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", re.MULTILINE)
    return sum(float(value) for value in pattern.findall(text))


def fill(directory: Path) -> Path:
    """Take every free byte of ``directory``'s filesystem with one file; return it."""
    ballast = directory / "ballast"
    with ballast.open("wb", buffering=0) as handle:
        try:
            while True:
                handle.write(b"\0" * 65536)
        except OSError:
            pass
        try:
            while True:
                handle.write(b"\0" * 512)
        except OSError:
            pass
    return ballast


async def test_a_full_disk_is_a_clear_error_without_a_busy_loop_and_recovers(
    tmp_path: Path, topic_name: str
) -> None:
    with mounted_tmpfs(tmp_path / "disk", 16 << 20) as disk:
        process = start_northguard_broker(disk / "data", log_path=tmp_path / "broker.log")
        try:
            await _full_disk_scenario(process, disk, tmp_path / "broker.log", topic_name)
        finally:
            process.stop()


async def _full_disk_scenario(
    process: NorthguardProcess, disk: Path, log_path: Path, topic: str
) -> None:
    backend = backend_for(process.url, request_timeout_s="10")
    await backend.create_topic(topic, shard_ranges(2))
    producer = backend.producer(topic, ProducerOptions(linger_ms=0, request_timeout_s=3.0))
    acknowledged: dict[tuple[int, int], bytes] = {}
    try:
        for shard in (0, 1):
            for offset in await producer.send(shard, [Record(value=b"before")] * 10):
                acknowledged[(shard, offset)] = b"before"
        ballast = fill(disk)
        log_lines_before = len(log_path.read_text().splitlines())
        opens_refused_before = metric(process, "northguard_errors_total")
        failed_at = time.monotonic()
        failures: list[BaseException] = []
        for round_ in range(2):  # two rounds of sends through the failure: ~6 s of refusals
            sends = [producer.send(shard, [Record(value=b"x" * 50_000)]) for shard in (0, 1)]
            results = await asyncio.gather(*sends, return_exceptions=True)
            failures += [r for r in results if isinstance(r, BaseException)]
            del round_
        assert len(failures) == 4, failures
        for failure in failures:
            assert isinstance(failure, StorageError), failure
            assert "No space left on device" in failure.message, failure
        status = health(process)
        assert status["status"] == "failing" and status["store_failed"], status
        assert "No space left on device" in status["store_error"], status
        # Bounded: the client backs off, the broker refuses streams and limits its log.
        failing_s = time.monotonic() - failed_at
        refusals = metric(process, "northguard_errors_total") - opens_refused_before
        reopens = metric(process, "northguard_store_reopens_total")
        log_lines = len(log_path.read_text().splitlines()) - log_lines_before
        print(
            f"{failing_s:.1f} s failing: {refusals} errors sent, {reopens} reopens, {log_lines} log lines"
        )
        assert refusals <= 2 * (failing_s / 0.025 + 4), refusals  # 2 shards, backoff >= 25 ms
        assert reopens <= failing_s / 0.25 + 1, reopens  # the keeper waits >= 0.25 s
        assert log_lines <= 4 * failing_s + 20, log_path.read_text()[-3000:]

        ballast.unlink()  # space returns: the broker reopens its store without a restart
        deadline = time.monotonic() + WAIT_S
        while health(process)["status"] != "ok":
            assert time.monotonic() < deadline, "the store never returned to service"
            await asyncio.sleep(0.1)
        assert metric(process, "northguard_store_reopens_total") >= 1
        for shard in (0, 1):
            for offset in await producer.send(shard, [Record(value=b"after")] * 5):
                acknowledged[(shard, offset)] = b"after"
    finally:
        await producer.close()
        await backend.close()
    reading = backend_for(process.url)
    try:
        for shard in (0, 1):
            reader = reading.reader(topic)
            try:
                reader.assign({shard: 0})
                last = max(offset for s, offset in acknowledged if s == shard)
                stored = {r.offset: r.value for r in await read_until(reader, last + 1)}
            finally:
                await reader.close()
            for (s, offset), value in acknowledged.items():
                if s == shard:
                    assert stored.get(offset) == value, f"acknowledged {shard}/{offset} lost"
    finally:
        await reading.close()
