"""Real processes under SIGKILL and disk damage: acknowledged records survive, damaged bytes are never served.

The crash loop kills the broker at random moments while a producer streams
(retrying through every restart), then checks after each restart that every
acknowledged record is readable at the offset it was acknowledged with, in
send order.  Failed sends may or may not be stored (at-least-once), so
records without an acknowledgement are allowed to appear, never required.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
from ng_harness import backend_for, read_until

from backends.northguard.launcher import NorthguardProcess
from xinfra.backend import ProducerOptions
from xinfra.errors import CorruptData, XinfraError
from xinfra.keyspace import shard_ranges
from xinfra.model import Record

KILLS = 22
RECORDS_PER_SEND = 20


async def verify(address: str, acknowledged: dict[int, bytes]) -> None:
    """Every acknowledged offset holds its record; acknowledged records are in send order."""
    if not acknowledged:
        return
    last = max(acknowledged)
    backend = backend_for(address)
    reader = backend.reader("crash")
    try:
        reader.assign({0: 0})
        got = await read_until(reader, last + 1, timeout_s=60)
    finally:
        await reader.close()
        await backend.close()
    stored = {record.offset: record.value for record in got}
    assert [r.offset for r in got] == list(range(len(got)))  # offsets dense and in order
    for offset, value in acknowledged.items():
        assert stored.get(offset) == value, f"acknowledged offset {offset} lost or changed"
    numbers = [int(acknowledged[offset]) for offset in sorted(acknowledged)]
    assert numbers == sorted(numbers), "acknowledged records out of send order"


@pytest.mark.slow
async def test_acknowledged_records_survive_repeated_sigkills(
    private_broker: NorthguardProcess,
) -> None:
    address = private_broker.url
    admin = backend_for(address)
    await admin.create_topic("crash", shard_ranges(1))
    await admin.close()
    backend = backend_for(address, request_timeout_s="60")
    producer = backend.producer("crash", ProducerOptions(linger_ms=2, request_timeout_s=60))
    acknowledged: dict[int, bytes] = {}
    failed = 0
    stop = asyncio.Event()

    async def produce() -> None:
        nonlocal failed
        number = 0
        in_flight: set[asyncio.Future[list[int]]] = set()
        while not stop.is_set():
            values = [b"%09d" % (number + i) for i in range(RECORDS_PER_SEND)]
            number += RECORDS_PER_SEND
            future = producer.send(0, [Record(value=v) for v in values])

            def settle(done: asyncio.Future[list[int]], values: list[bytes] = values) -> None:
                nonlocal failed
                if done.exception() is not None:
                    failed += 1
                    return
                for offset, value in zip(done.result(), values, strict=True):
                    assert offset not in acknowledged, f"offset {offset} acknowledged twice"
                    acknowledged[offset] = value

            future.add_done_callback(settle)
            in_flight.add(future)
            future.add_done_callback(in_flight.discard)
            if len(in_flight) >= 20:
                await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
        if in_flight:
            await asyncio.wait(in_flight)

    producing = asyncio.create_task(produce())
    rng = random.Random(20_251_123)
    try:
        for kill in range(KILLS):
            target = len(acknowledged) + 200  # kill only once this run has made progress
            while len(acknowledged) < target:
                assert not producing.done(), producing
                await asyncio.sleep(0.01)
            await asyncio.sleep(rng.uniform(0, 0.3))  # a random moment, not a synchronisation
            await asyncio.to_thread(private_broker.kill)
            await asyncio.to_thread(private_broker.restart)
            await verify(address, dict(acknowledged))
            print(f"kill {kill + 1}: {len(acknowledged)} acknowledged, {failed} failed sends")
    finally:
        stop.set()
        await asyncio.wait_for(producing, 120)
        await producer.close()
        await backend.close()
    await verify(address, acknowledged)
    assert len(acknowledged) >= KILLS * 200


async def test_a_flipped_byte_on_disk_is_detected_and_never_served(
    private_broker: NorthguardProcess, tmp_path: Path
) -> None:
    address = private_broker.url
    backend = backend_for(address)
    await backend.create_topic("damaged", shard_ranges(1))
    producer = backend.producer("damaged", ProducerOptions(linger_ms=0))
    good = await producer.send(0, [Record(value=b"a" * 100) for _ in range(10)])
    await producer.flush()
    bad = await producer.send(0, [Record(value=b"b" * 20_000)])
    await producer.close()
    await backend.close()
    private_broker.stop()

    segments = list((private_broker.data_dir / "store" / "segments").glob("*.seg"))
    assert len(segments) == 1
    data = bytearray(segments[0].read_bytes())
    position = data.rindex(b"b" * 1000) + 500  # inside the second batch
    data[position] ^= 0xFF
    segments[0].write_bytes(bytes(data))
    private_broker.restart()

    backend = backend_for(address)
    reader = backend.reader("damaged")
    reader.assign({0: 0})
    served = []
    with pytest.raises(CorruptData, match="CRC"):
        for _ in range(20):
            served += await reader.poll(max_records=100, timeout_s=1)
    assert [r.offset for r in served] == good  # the good prefix, never the damaged batch
    assert all(r.value == b"a" * 100 for r in served)
    reader.assign({0: bad[0]})
    with pytest.raises(XinfraError, match="CRC"):
        await reader.poll(timeout_s=5)
    await reader.close()
    await backend.close()
    assert "CRC mismatch" in private_broker.log_tail(200)
