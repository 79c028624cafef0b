"""A producer or a consumer of a virtual topic as a real process, for the migration fault tests.

Usage: python migration_client.py producer|consumer URL TOKEN VC TOPIC CLIENT_ID OUT LEASE_S

``producer`` sends keyed records (``k<key>:<seq>``) without pause and appends
one line per acknowledged record to OUT (``value epoch shard offset``,
flushed at once), so what was acknowledged survives a SIGKILL.  ``consumer``
reads the topic from the beginning and appends each value to OUT.  Both write
``ready`` to OUT once registered, then run until killed.
"""

from __future__ import annotations

import asyncio
import sys
from typing import IO

from clients import XinfraProducerOptions, open_consumer, open_producer
from xinfra.model import Position

KEYS = 7


async def produce(
    url: str, token: str, vc: str, topic: str, client_id: str, out: IO[str], lease_s: float
) -> None:
    producer = await open_producer(
        url, token, vc, XinfraProducerOptions(linger_ms=2), [topic], client_id, lease_s
    )
    out.write("ready\n")
    out.flush()

    def done(value: bytes, future: asyncio.Future[Position]) -> None:
        if future.exception() is None:
            p = future.result()
            out.write(f"{value.decode()} {p.epoch} {p.shard} {p.offset}\n")
            out.flush()

    seq = 0
    while True:
        key = seq % KEYS
        value = f"k{key}:{seq}".encode()
        future = await producer.send(topic, value, key=b"%d" % key)
        future.add_done_callback(lambda f, v=value: done(v, f))  # type: ignore[misc]
        seq += 1
        if seq % 10 == 0:
            await asyncio.sleep(0.005)  # a steady rate, not synchronisation


async def consume(
    url: str, token: str, vc: str, topic: str, client_id: str, out: IO[str], lease_s: float
) -> None:
    consumer = await open_consumer(
        url, token, vc, topics=[topic], client_id=client_id, lease_s=lease_s
    )
    await consumer.assign(topic)
    out.write("ready\n")
    out.flush()
    while True:
        for record in await consumer.poll(500, timeout_s=0.5):
            out.write(f"{record.value.decode()}\n")
        out.flush()


def main() -> None:
    role, url, token, vc, topic, client_id, path, lease_s = sys.argv[1:9]
    with open(path, "a", encoding="utf-8") as out:
        run = produce if role == "producer" else consume
        asyncio.run(run(url, token, vc, topic, client_id, out, float(lease_s)))


if __name__ == "__main__":
    main()
