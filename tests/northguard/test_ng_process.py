"""A real broker process: bad input closes one connection or fails one stream, health, metrics, SIGTERM."""

from __future__ import annotations

import json
import signal
import struct
import urllib.request
from pathlib import Path

import pytest
from ng_harness import RawClient

from backends.northguard import protocol
from backends.northguard.batch import encode_batch
from backends.northguard.launcher import NorthguardProcess, start_northguard_broker
from backends.northguard.protocol import MsgType
from xinfra.model import Record


def still_serving(address: str) -> None:
    """The broker answers a fresh connection: one bad client never takes it down."""
    client = RawClient(address)
    try:
        assert client.request("ping")["result"]["broker_id"] == "1"
    finally:
        client.close()


def connection_error(client: RawClient) -> dict[str, str]:
    """The ERROR frame the broker sends before it closes this connection."""
    item = client.receive()
    assert item is not None and item.type is MsgType.ERROR, item
    error: dict[str, str] = protocol.decode_json(item.body)[1]["error"]
    assert client.receive() is None  # then the connection is closed
    return error


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (struct.pack("<IBB", 1 << 30, protocol.PROTOCOL_VERSION, MsgType.APPEND), "protocol_error"),
        (struct.pack("<IBB", 2, 7, MsgType.REQUEST), "unsupported_version"),
        (struct.pack("<IBB", 2, protocol.PROTOCOL_VERSION, 250), "protocol_error"),
        (struct.pack("<IBB", 1, protocol.PROTOCOL_VERSION, 1), "protocol_error"),
        (protocol.frame(MsgType.REQUEST, b"\x00\x00\x00\x01{not json"), "protocol_error"),
        (protocol.frame(MsgType.APPEND, b"\x01"), "protocol_error"),
        (protocol.frame(MsgType.ACK, b"\x00" * 20), "protocol_error"),
        (protocol.frame(MsgType.READ, b"\x00" * 3), "protocol_error"),
    ],
    ids=["oversized", "version", "type", "short", "json", "append", "client-ack", "read"],
)
def test_malformed_frames_close_that_connection_only(
    ng_address: str, data: bytes, code: str
) -> None:
    bystander = RawClient(ng_address)
    client = RawClient(ng_address)
    client.send(data)
    assert connection_error(client)["code"] == code
    assert bystander.request("ping")["result"]["broker_id"] == "1"
    bystander.close()
    still_serving(ng_address)


def test_unknown_topics_and_ops_are_clear_errors_on_a_live_connection(
    ng_address: str, topic_name: str
) -> None:
    client = RawClient(ng_address)
    response = client.request("topic_metadata", name=topic_name)
    assert (
        response["error"]["code"] == "topic_not_found"
        and topic_name in response["error"]["message"]
    )
    assert client.request("frobnicate")["error"]["code"] == "invalid_request"
    assert (
        client.request("create_topic", name=topic_name, count="x")["error"]["code"]
        == "invalid_request"
    )
    assert (
        client.request("create_topic", name="bad name!", count=1)["error"]["code"]
        == "invalid_request"
    )
    client.send(
        protocol.encode_json(
            MsgType.PRODUCE_OPEN, 1, {"topic": topic_name, "range_id": 1, "producer_id": 1}
        )
    )
    item = client.receive()
    assert item is not None and item.type is MsgType.STREAM_ERROR
    assert protocol.decode_json(item.body)[1]["error"]["code"] == "topic_not_found"
    assert client.request("ping")["result"]["broker_id"] == "1"
    client.close()


def open_produce(client: RawClient, topic: str, stream_id: int, window: int = 1 << 20) -> int:
    range_id = client.request("topic_metadata", name=topic)["result"]["ranges"][0]["range_id"]
    client.send(
        protocol.encode_json(
            MsgType.PRODUCE_OPEN,
            stream_id,
            {
                "topic": topic,
                "range_id": range_id,
                "producer_id": stream_id,
                "window_bytes": window,
            },
        )
    )
    item = client.receive()
    assert item is not None and item.type is MsgType.PRODUCE_OPENED, item
    return int(range_id)


def stream_error(client: RawClient) -> dict[str, str]:
    item = client.receive()
    assert item is not None and item.type is MsgType.STREAM_ERROR, item
    error: dict[str, str] = protocol.decode_json(item.body)[1]["error"]
    return error


def test_bad_appends_fail_their_stream_not_the_connection(ng_address: str, topic_name: str) -> None:
    client = RawClient(ng_address)
    assert "result" in client.request("create_topic", name=topic_name, count=1)
    batch = encode_batch([Record(value=b"v" * 100)], 0)

    open_produce(client, topic_name, 1)
    damaged = bytearray(batch)
    damaged[-1] ^= 1
    client.send(protocol.encode_append(1, 0, bytes(damaged)))
    assert stream_error(client)["code"] == "corrupt_data"

    open_produce(client, topic_name, 2, window=200)
    client.send(protocol.encode_append(2, 0, batch) + protocol.encode_append(2, 1, batch))
    assert stream_error(client)["code"] == "backpressure"  # the second overran the 200-byte window

    open_produce(client, topic_name, 3)
    client.send(protocol.encode_append(3, 5, batch) + protocol.encode_append(3, 7, batch))
    error = stream_error(client)  # sequence 7 skips 6 (the stream fails before 5 is acknowledged)
    assert error["code"] == "invalid_request" and "skips 6" in error["message"]

    assert "result" in client.request("seal_topic", name=topic_name)
    open_produce(client, topic_name, 4)
    client.send(protocol.encode_append(4, 0, batch))
    assert stream_error(client)["code"] == "sealed"
    assert client.request("ping")["result"]["broker_id"] == "1"
    client.close()


def test_health_metrics_and_a_clean_sigterm(tmp_path: Path) -> None:
    process: NorthguardProcess = start_northguard_broker(tmp_path / "data")
    try:
        base = f"http://127.0.0.1:{process.http_port}"
        with urllib.request.urlopen(base + "/health", timeout=10) as response:
            health = json.load(response)
        assert response.status == 200 and health["status"] == "ok" and health["broker_id"] == "1"
        client = RawClient(process.url)
        client.request("create_topic", name="m", count=2)
        client.close()
        with urllib.request.urlopen(base + "/metrics", timeout=10) as response:
            metrics = response.read().decode()
        assert 'northguard_requests_total{op="create_topic"} 1.0' in metrics
        assert "northguard_appends_total" in metrics
        assert process.popen is not None
        process.popen.send_signal(signal.SIGTERM)
        assert process.popen.wait(timeout=30) == 0
        assert "stopped" in process.log_tail(5)
    finally:
        process.stop()
