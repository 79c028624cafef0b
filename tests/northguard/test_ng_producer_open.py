"""A produce stream's first batch goes right behind its open, not after the broker's answer.

With 4,096 new ranges a round trip per range before its first Append (and a
task waiting for it) was a large part of the first write.  A scripted broker
here holds back its answer to the open: the Append must arrive anyway, and
only one (the next waits for the window the answer grants).
"""

from __future__ import annotations

import asyncio
import socket

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


async def scripted_broker(
    sock: socket.socket | None = None,
) -> tuple[asyncio.Server, list[asyncio.StreamWriter], asyncio.Queue[protocol.Frame]]:
    """A broker that answers every produce open and acknowledges every Append at offset 0."""
    frames: asyncio.Queue[protocol.Frame] = asyncio.Queue()
    writers: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        decoder = protocol.FrameDecoder()
        while data := await reader.read(1 << 16):
            for item in decoder.feed(data):
                frames.put_nowait(item)
                if item.type is MsgType.PRODUCE_OPEN:
                    stream_id, _ = protocol.decode_json(item.body)
                    answer = {"window_bytes": 1 << 20}
                    writer.write(protocol.encode_json(MsgType.PRODUCE_OPENED, stream_id, answer))
                elif item.type is MsgType.APPEND:
                    stream_id, seq, _ = protocol.decode_append(item.body)
                    writer.write(protocol.encode_ack(stream_id, seq, [0], 1 << 20))

    if sock is None:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
    else:
        server = await asyncio.start_server(serve, sock=sock)
    return server, writers, frames


def topic_of(ranges: int) -> TopicView:
    keys = shard_ranges(ranges)
    return TopicView("t", False, {}, [RangeView(i, keys[i], False, 0, 0) for i in range(ranges)])


async def test_new_shards_waiting_for_the_connection_share_one_task_and_all_open_on_it() -> None:
    shards = 64
    server, writers, _ = await scripted_broker()
    port = server.sockets[0].getsockname()[1]
    producer = NorthguardProducer(
        RealRuntime(), f"127.0.0.1:{port}", topic_of(shards), ProducerOptions(linger_ms=0.0)
    )
    try:
        before = len(asyncio.all_tasks())
        sends = [producer.send(shard, [Record(b"%d" % shard)]) for shard in range(shards)]
        await asyncio.sleep(0)  # the turn ends: every shard seals and finds no connection yet
        # The connect and the one task that opens the shards' streams once it is done.
        assert len(asyncio.all_tasks()) - before <= 2, "a task per shard waits for the connection"
        assert await asyncio.wait_for(asyncio.gather(*sends), WAIT_S) == [[0]] * shards
        assert len(writers) == 1, "the shards' streams share one connection"
    finally:
        await producer.close()
        server.close()


async def test_a_refused_first_connect_is_retried_and_every_send_delivered() -> None:
    shards = 4
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound, not listening: connects are refused
    port = sock.getsockname()[1]
    producer = NorthguardProducer(
        RealRuntime(),
        f"127.0.0.1:{port}",
        topic_of(shards),
        ProducerOptions(linger_ms=0.0, request_timeout_s=WAIT_S),
    )
    server: asyncio.Server | None = None
    try:
        sends = [producer.send(shard, [Record(b"x")]) for shard in range(shards)]
        deadline = asyncio.get_running_loop().time() + WAIT_S
        while not all(state.failures for state in producer._shards):  # each saw the refusal
            assert asyncio.get_running_loop().time() < deadline, "the first connect never failed"
            await asyncio.sleep(0.01)
        assert not any(send.done() for send in sends), "a refused connect failed a retriable send"
        server, _, _ = await scripted_broker(sock)  # listening now
        assert await asyncio.wait_for(asyncio.gather(*sends), WAIT_S) == [[0]] * shards
    finally:
        await producer.close()
        if server is not None:
            server.close()
        sock.close()
