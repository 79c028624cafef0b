"""A real broker process: bad input closes one connection or fails one stream, health, metrics, SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
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
    assert error["code"] == "out_of_order_sequence" and "skips 6" in error["message"]

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
        open_produce(client, "m", 1)
        client.send(protocol.encode_append(1, 0, encode_batch([Record(value=b"v")], 0)))
        ack = client.receive()  # sent once the append is durable
        assert ack is not None and ack.type is MsgType.ACK, ack
        client.close()
        with urllib.request.urlopen(base + "/metrics", timeout=10) as response:
            metrics = response.read().decode()
        assert 'northguard_requests_total{op="create_topic"} 1.0' in metrics
        assert "northguard_appends_total 1.0" in metrics
        samples = dict(
            line.rsplit(" ", 1)
            for line in metrics.splitlines()
            if line.startswith("northguard_store")
        )
        # The store's own counters: one group commit, whose fsync is the WAL's (segment files are
        # synced by the store's checkpoints, off the acknowledgement path).
        assert float(samples["northguard_store_flushes_total"]) >= 1
        assert float(samples["northguard_store_fsyncs_total"]) >= 1
        assert float(samples["northguard_store_flushed_records_total"]) == 1
        assert float(samples["northguard_store_segments"]) >= 1
        assert float(samples["northguard_store_unwritten_bytes"]) >= 0
        assert float(samples["northguard_store_wal_bytes"]) >= 0  # 0 once a checkpoint ran
        assert process.popen is not None
        process.popen.send_signal(signal.SIGTERM)
        assert process.popen.wait(timeout=30) == 0
        assert "stopped" in process.log_tail(5)
    finally:
        process.stop()


@pytest.mark.parametrize(
    "count",
    [3e6, 10**12, 1e308, float("inf"), float("-inf"), float("nan"), 2.5, 0, -1, 4097, True, "7"],
    ids=repr,
)
def test_create_topic_checks_its_count_before_allocating(
    ng_address: str, topic_name: str, count: object
) -> None:
    """A huge, infinite or NaN count is answered at once (the socket gives 10 s), connection kept."""
    client = RawClient(ng_address, timeout_s=10.0)
    try:
        error = client.request("create_topic", name=topic_name, count=count)["error"]
        assert error["code"] == "invalid_request", error
        assert client.request("ping")["result"]["broker_id"] == "1"
    finally:
        client.close()


def test_create_topic_checks_its_range_list_before_reading_it(
    ng_address: str, topic_name: str
) -> None:
    client = RawClient(ng_address, timeout_s=10.0)
    try:
        bounds = {"start": 0, "end": 1}
        for ranges in ([bounds] * 5000, "abc", [float("inf")], [{"start": float("nan")}]):
            error = client.request("create_topic", name=topic_name, ranges=ranges)["error"]
            assert error["code"] == "invalid_request", (ranges, error)
        assert client.request("ping")["result"]["broker_id"] == "1"
    finally:
        client.close()


BAD_NUMBERS = [float("inf"), float("-inf"), float("nan"), 1e30, 2.5, 2**80, -(2**70), True, "1"]


@pytest.mark.parametrize(
    ("op", "field"),
    [
        ("segment_metadata", "range_id"),
        ("split_range", "range_id"),
        ("offset_for_timestamp", "timestamp_ms"),
        ("merge_ranges", "other_range_id"),
    ],
)
def test_unary_requests_answer_bad_numbers_with_invalid_request(
    ng_address: str, topic_name: str, op: str, field: str
) -> None:
    client = RawClient(ng_address, timeout_s=10.0)
    try:
        assert "result" in client.request("create_topic", name=topic_name, count=2)
        for value in BAD_NUMBERS:
            arguments: dict[str, object] = {
                "name": topic_name,
                "range_id": 1,
                "other_range_id": 2,
                "timestamp_ms": 0,
                field: value,
            }
            error = client.request(op, **arguments)["error"]
            assert error["code"] == "invalid_request", (value, error)
        assert client.request("ping")["result"]["broker_id"] == "1"
    finally:
        client.close()


@pytest.mark.parametrize("kind", [MsgType.PRODUCE_OPEN, MsgType.CONSUME_OPEN])
@pytest.mark.parametrize("field", ["range_id", "producer_id", "window_bytes", "offset"])
def test_a_stream_open_with_a_bad_number_fails_that_stream_only(
    ng_address: str, topic_name: str, kind: MsgType, field: str
) -> None:
    """``Infinity`` once raised OverflowError and dropped the connection with all its streams."""
    client = RawClient(ng_address, timeout_s=10.0)
    try:
        created = client.request("create_topic", name=topic_name, count=1)["result"]
        range_id = int(created["ranges"][0]["range_id"])
        open_produce(client, topic_name, 1)  # a healthy stream on the same connection
        read_by_kind = {
            MsgType.PRODUCE_OPEN: {"range_id", "producer_id", "window_bytes"},
            MsgType.CONSUME_OPEN: {"range_id", "window_bytes", "offset"},
        }
        for stream_id, value in enumerate(BAD_NUMBERS, start=2):
            payload: dict[str, object] = {
                "topic": topic_name,
                "range_id": range_id,
                "producer_id": 9,
                "window_bytes": 1 << 20,
                "offset": 0,
                field: value,
            }
            client.send(protocol.encode_json(kind, stream_id, payload))
            item = client.receive()
            assert item is not None, f"the broker dropped the connection on {field}={value!r}"
            if field in read_by_kind[kind]:
                assert item.type is MsgType.STREAM_ERROR, (value, item)
                ident, body = protocol.decode_json(item.body)
                assert ident == stream_id and body["error"]["code"] == "invalid_request", body
            else:
                assert item.type in (MsgType.PRODUCE_OPENED, MsgType.CONSUME_OPENED), item
                client.send(protocol.encode_stream_close(stream_id))
        batch = encode_batch([Record(value=b"still here")], 0)
        client.send(protocol.encode_append(1, 0, batch))
        while (ack := client.receive()) is not None and ack.type is not MsgType.ACK:
            pass
        assert ack is not None, "the healthy stream died with the bad ones"
        assert client.request("ping")["result"]["broker_id"] == "1"
    finally:
        client.close()


def test_a_broker_takes_its_store_options_from_xinfra_variables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``XINFRA_SEGMENT_BYTES_MAX`` reaches the broker's command (as ``xinfra up``'s environment
    does): ten 1-record batches to a range roll its segment at that size."""
    monkeypatch.setenv("XINFRA_SEGMENT_BYTES_MAX", "300")
    process = start_northguard_broker(tmp_path / "data")  # inherits this environment
    try:
        client = RawClient(process.url)
        client.request("create_topic", name="small", count=1)
        open_produce(client, "small", 1)
        for seq in range(10):
            batch = encode_batch([Record(value=b"v" * 50)], 0, producer_id=1, sequence=seq)
            client.send(protocol.encode_append(1, seq, batch))
            ack = client.receive()
            assert ack is not None and ack.type is MsgType.ACK, ack
        range_id = client.request("topic_metadata", name="small")["result"]["ranges"][0]["range_id"]
        segments = client.request("segment_metadata", name="small", range_id=range_id)["result"]
        assert len(segments["segments"]) > 2  # 300 bytes hold at most three such batches
        client.close()
    finally:
        process.stop()


def test_a_broker_imports_neither_the_settings_nor_the_model() -> None:
    """The broker's modules stay off ``xinfra.settings`` (pydantic-settings) and ``xinfra.model``:
    with them, a broker took 0.1 s longer to serve at every start, restarts included (typer
    still imports pydantic itself when it parses the command's options)."""
    probe = (
        "import sys, backends.northguard.cli, backends.northguard.broker.server\n"
        "print(sorted(m for m in sys.modules\n"
        "             if m in ('xinfra.settings', 'xinfra.model', 'pydantic_settings')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
        check=True,
    )
    assert result.stdout.strip() == "[]", result.stdout


def test_a_bad_store_option_from_the_environment_is_a_clear_refusal(tmp_path: Path) -> None:
    """A zero segment size (it was 'take the settings' before the variable went to the flag) is
    refused at start, naming the variable, instead of a broker that rolls at every append."""
    result = subprocess.run(
        [sys.executable, "-m", "backends.northguard.broker", "--data-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "XINFRA_SEGMENT_BYTES_MAX": "0", "COLUMNS": "200"},
    )
    assert result.returncode == 2, result
    assert "XINFRA_SEGMENT_BYTES_MAX" in result.stderr and "--segment-bytes-max" in result.stderr
    assert not any(tmp_path.iterdir()), "nothing was made for a broker that did not start"
