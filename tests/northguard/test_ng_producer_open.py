"""A produce stream's first batch goes right behind its open, not after the broker's answer.

With 4,096 new ranges a round trip per range before its first Append (and a
task waiting for it) was a large part of the first write.  A scripted broker
here holds back its answer to the open: the Append must arrive anyway, and
only one (the next waits for the window the answer grants).
"""

from __future__ import annotations

import asyncio

from backends.northguard import protocol
from backends.northguard.client.admin import RangeView, TopicView
from backends.northguard.client.producer import NorthguardProducer
from backends.northguard.protocol import MsgType
from backends.northguard.runtime import RealRuntime
from xinfra.backend import ProducerOptions
from xinfra.keyspace import shard_ranges
from xinfra.model import Record

WAIT_S = 30.0


async def test_the_first_batch_goes_behind_the_open_and_more_wait_for_its_answer() -> None:
    frames: asyncio.Queue[protocol.Frame] = asyncio.Queue()
    writers: list[asyncio.StreamWriter] = []

    async def broker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        decoder = protocol.FrameDecoder()
        while data := await reader.read(1 << 16):
            for item in decoder.feed(data):
                frames.put_nowait(item)

    server = await asyncio.start_server(broker, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    topic = TopicView("t", False, {}, [RangeView(0, shard_ranges(1)[0], False, 0, 0)])
    producer = NorthguardProducer(
        RealRuntime(), f"127.0.0.1:{port}", topic, ProducerOptions(linger_ms=0.0)
    )
    try:
        first = producer.send(0, [Record(b"a")])
        opened = await asyncio.wait_for(frames.get(), WAIT_S)
        assert opened.type is MsgType.PRODUCE_OPEN
        stream_id, _ = protocol.decode_json(opened.body)
        append = await asyncio.wait_for(frames.get(), WAIT_S)  # the open is not answered yet
        assert append.type is MsgType.APPEND
        second = producer.send(0, [Record(b"b")])  # sealed now; sent once the window is known
        writers[0].write(
            protocol.encode_json(MsgType.PRODUCE_OPENED, stream_id, {"window_bytes": 1 << 20})
        )
        append2 = await asyncio.wait_for(frames.get(), WAIT_S)
        assert append2.type is MsgType.APPEND
        writers[0].write(protocol.encode_ack(stream_id, 0, [0, 1], 1 << 20))
        assert await asyncio.wait_for(asyncio.gather(first, second), WAIT_S) == [[0], [1]]
    finally:
        await producer.close()
        server.close()
