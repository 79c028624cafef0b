"""An append's outcome callback (``RangeLog.append``'s ``on_done``): called by the commit itself.

The range log calls a committed append's callback as it commits it, in
offset order (not as a done-callback, a handle per append), never inside
``append``; an append refused at once has it run at a later turn.  (The
producer's session only marks itself due there: its connection has it build
one Ack for the turn's commits.)  A real broker and store.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from ng_harness import in_process_broker

from backends.northguard.batch import encode_batch
from xinfra.errors import Sealed
from xinfra.keyspace import shard_ranges
from xinfra.model import Record

APPENDS = 16


async def test_a_commit_calls_each_callback_once_all_its_appends_are_resolved(
    tmp_path: Path,
) -> None:
    broker = await in_process_broker(tmp_path / "data")
    try:
        await broker.coordinator.create_topic("t", shard_ranges(1), {})
        [range_id] = broker.coordinator.topic("t").ranges
        range_log = broker.coordinator.range_log("t", range_id)
        await range_log.append(encode_batch([Record(b"first")], 0), 1)  # its segment exists
        futures: list[asyncio.Future[int]] = []
        seen: list[int] = []

        def on_done(future: asyncio.Future[int]) -> None:
            seen.append(future.result())  # resolved when called

        for n in range(APPENDS):
            futures.append(range_log.append(encode_batch([Record(b"%d" % n)], 0), 1, on_done))
        assert seen == []  # never inside append
        assert await asyncio.gather(*futures) == list(range(1, APPENDS + 1))
        assert seen == list(range(1, APPENDS + 1))  # once each, in offset order

        await range_log.seal_active()
        range_log.closing = True  # refused at once from here
        refused: list[asyncio.Future[int]] = []
        late = range_log.append(encode_batch([Record(b"late")], 0), 1, refused.append)
        assert late.done() and refused == []
        await asyncio.sleep(0)  # one turn: the callback of a refused append runs then
        assert refused == [late] and isinstance(late.exception(), Sealed)
    finally:
        await broker.stop()
