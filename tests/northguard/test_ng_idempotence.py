"""Idempotent producers across broker restarts: a real broker process, SIGKILL or SIGTERM, raw Appends.

A batch carries its producer id, epoch and per-range sequence in its header,
stored with it; the broker rebuilds its duplicate table from the log, so the
same batch bytes resent after a restart are answered with their ORIGINAL
offsets and stored once.  A sequence gap and an older epoch are clear errors.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from ng_harness import RawClient

from backends.northguard import protocol
from backends.northguard.batch import encode_batch
from backends.northguard.launcher import NorthguardProcess, start_northguard_broker
from backends.northguard.protocol import MsgType
from xinfra.errors import OutOfOrderSequence, ProducerFenced, error_from_code
from xinfra.model import Record

PRODUCER = 0x1234_5678_9ABC


def batch(seq: int, count: int, *, epoch: int = 0, producer_id: int = PRODUCER) -> bytes:
    records = [Record(value=b"seq %d record %d" % (seq, n)) for n in range(count)]
    return encode_batch(records, 1_000, producer_id=producer_id, producer_epoch=epoch, sequence=seq)


def open_produce(client: RawClient, topic: str, stream_id: int) -> None:
    range_id = client.request("topic_metadata", name=topic)["result"]["ranges"][0]["range_id"]
    payload = {"topic": topic, "range_id": range_id, "producer_id": 7, "window_bytes": 1 << 20}
    client.send(protocol.encode_json(MsgType.PRODUCE_OPEN, stream_id, payload))
    item = client.receive()
    assert item is not None and item.type is MsgType.PRODUCE_OPENED, item


def append(client: RawClient, stream_id: int, seq: int, data: bytes) -> int:
    """Send one Append and return the base offset its Ack reports (raises the stream's error)."""
    client.send(protocol.encode_append(stream_id, seq, data))
    item = client.receive()
    assert item is not None, "connection closed"
    if item.type is MsgType.STREAM_ERROR:
        error = protocol.decode_json(item.body)[1]["error"]
        raise error_from_code(error["code"], error["message"])
    assert item.type is MsgType.ACK, item
    [(_, first_seq, offsets, _)] = protocol.decode_acks(item.body)
    assert first_seq == seq and len(offsets) == 1
    return offsets[0]


def range_end(client: RawClient, topic: str) -> int:
    """The range's log end as the broker reports it (records stored, not acknowledgements)."""
    rid = client.request("topic_metadata", name=topic)["result"]["ranges"][0]["range_id"]
    segments = client.request("segment_metadata", name=topic, range_id=rid)["result"]["segments"]
    return int(segments[-1]["end_offset"])


@pytest.mark.parametrize("stop", ["sigkill", "sigterm"])
def test_a_batch_resent_after_a_restart_gets_its_original_offsets(
    tmp_path: Path, stop: str
) -> None:
    broker: NorthguardProcess = start_northguard_broker(tmp_path / "data")
    try:
        client = RawClient(broker.url)
        assert "result" in client.request("create_topic", name="idem", count=1)
        open_produce(client, "idem", 1)
        first, second = batch(0, 2), batch(1, 3)
        assert append(client, 1, 0, first) == 0
        assert append(client, 1, 1, second) == 2  # acknowledged: durable before the ack
        client.close()
        if stop == "sigkill":
            broker.kill()
        broker.restart()

        client = RawClient(broker.url)
        open_produce(client, "idem", 2)
        assert append(client, 2, 1, second) == 2  # the same bytes: original offsets, not 5
        assert append(client, 2, 0, first) == 0
        assert range_end(client, "idem") == 5  # stored once
        assert append(client, 2, 2, batch(2, 1)) == 5  # the sequence continues
        assert range_end(client, "idem") == 6

        open_produce(client, "idem", 3)
        with pytest.raises(OutOfOrderSequence, match="skips 3"):
            append(client, 3, 9, batch(9, 1))
        open_produce(client, "idem", 4)
        assert append(client, 4, 0, batch(0, 1, epoch=1)) == 6  # a new epoch starts afresh
        open_produce(client, "idem", 5)
        with pytest.raises(ProducerFenced):
            append(client, 5, 3, batch(3, 1, epoch=0))
        assert range_end(client, "idem") == 7
        client.close()
    finally:
        broker.stop()
