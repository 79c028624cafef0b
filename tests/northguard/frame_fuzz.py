"""A fuzzer of a live broker's frames: seeded, bounded by frames and seconds, runnable alone.

``test_ng_codec`` fuzzes the decoder in isolation; this drives a real broker
process through its socket with frames that are *mostly* well formed (valid
prefixes, JSON objects shaped like real requests and stream opens, Appends
with real batches) so they reach the handlers, with one field at a time
replaced by something hostile (``Infinity``, ``NaN``, 2**80, a string, a
list of 5000 items), plus some bit-flipped, truncated and plain garbage
frames that must close only their own connection.

The broker passes when it never answers ``internal`` (an unhandled
exception), never logs a traceback, keeps answering a bystander connection
throughout, and is alive at the end.  Run a long one with::

    .venv/bin/python tests/northguard/frame_fuzz.py --frames 100000 --seed 1
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backends.northguard import protocol
from backends.northguard.batch import encode_batch
from backends.northguard.broker.requests import OPS
from backends.northguard.protocol import MsgType
from xinfra.model import Record

CONNECTIONS = 4
PING_EVERY_FRAMES = 500
PING_TIMEOUT_S = 10.0
TOPICS = ("fuzz", "fuzz-2")

HOSTILE: list[Any] = [
    float("inf"),
    float("-inf"),
    float("nan"),
    1e308,
    2.5,
    -1,
    0,
    2**63,
    2**64,
    2**80,
    -(2**70),
    True,
    None,
    "1",
    "",
    "x" * 300,
    [],
    [1, 2],
    [{"start": 0}] * 5000,
    {},
    {"a": {"b": [None]}},
]


@dataclass
class FuzzReport:
    seed: int
    frames: int = 0
    reconnects: int = 0
    responses: dict[str, int] = field(default_factory=dict)  # frame kind or error code -> count
    internal_errors: list[str] = field(default_factory=list)
    pings: int = 0
    seconds: float = 0.0

    def count(self, key: str) -> None:
        self.responses[key] = self.responses.get(key, 0) + 1


class _Connection:
    def __init__(self, address: tuple[str, int]) -> None:
        self.sock = socket.create_connection(address, timeout=PING_TIMEOUT_S)
        self.sock.setblocking(False)
        self.decoder = protocol.FrameDecoder()
        self.closed = False

    def send(self, data: bytes) -> None:
        try:
            self.sock.setblocking(True)
            self.sock.sendall(data)
        except OSError:
            self.closed = True
        finally:
            self.sock.setblocking(False)

    def drain(self, report: FuzzReport) -> None:
        """Read whatever the broker sent so far; note internal errors and closure."""
        while not self.closed:
            try:
                data = self.sock.recv(1 << 20)
            except BlockingIOError:
                return
            except OSError:
                self.closed = True
                return
            if not data:
                self.closed = True
                return
            try:
                frames = self.decoder.feed(data)
            except Exception as error:  # the broker sent a bad frame: a bug on its side
                report.internal_errors.append(f"undecodable frame from the broker: {error!r}")
                self.closed = True
                return
            for item in frames:
                _note(item, report)

    def close(self) -> None:
        self.sock.close()


def _note(item: protocol.Frame, report: FuzzReport) -> None:
    report.count(item.type.name)
    if item.type in (MsgType.RESPONSE, MsgType.STREAM_ERROR, MsgType.ERROR):
        payload = protocol.decode_json(item.body)[1]
        error = payload.get("error")
        if error:
            report.count(str(error.get("code")))
            if error.get("code") == "internal":
                report.internal_errors.append(str(error.get("message"))[:300])


class FrameMaker:
    """Seeded frames: a valid template per kind, one field (or the bytes) made hostile."""

    def __init__(self, rng: random.Random, range_ids: list[int]) -> None:
        self.rng = rng
        self.range_ids = range_ids or [1]

    def value(self, good: Any) -> Any:
        return good if self.rng.random() < 0.6 else self.rng.choice(HOSTILE)

    def _json(self, kind: MsgType, payload: dict[str, Any]) -> bytes:
        rng = self.rng
        if rng.random() < 0.5 and payload:  # make one field hostile
            key = rng.choice(sorted(payload))
            payload[key] = rng.choice(HOSTILE)
        ident = rng.choice([1, 2, 3, 4, 5, rng.getrandbits(32)])
        return protocol.encode_json(kind, ident, payload)

    def request(self) -> bytes:
        rng = self.rng
        destructive = ("delete_topic", "seal_topic", "split_range", "merge_ranges")
        if rng.random() < 0.03:  # rare, or the fuzzed topics would be gone most of the time
            op = rng.choice(destructive)
        else:
            op = rng.choice([*sorted(OPS.difference(destructive)), "bogus", ""])
        payload: dict[str, Any] = {
            "op": op,
            "name": rng.choice([*TOPICS, "bad name!", "t" * 300]),
            "range_id": rng.choice(self.range_ids),
            "other_range_id": rng.choice(self.range_ids),
            "timestamp_ms": rng.choice([0, int(time.time() * 1000), -5]),
        }
        if op == "create_topic":
            if rng.random() < 0.5:
                payload["count"] = rng.choice([1, 2, 4, 4096, 4097, 3_000_000])
            else:
                payload["ranges"] = [["0", str(1 << 64)]]
            payload["config"] = rng.choice([{}, {"retention.ms": "x"}, {"policy": "nope"}, []])
        return self._json(MsgType.REQUEST, payload)

    def produce_open(self) -> bytes:
        rng = self.rng
        payload: dict[str, Any] = {
            "topic": rng.choice(TOPICS),
            "range_id": rng.choice(self.range_ids),
            "producer_id": rng.getrandbits(63),
            "window_bytes": rng.choice([1 << 20, 100, 1]),
        }
        return self._json(MsgType.PRODUCE_OPEN, payload)

    def consume_open(self) -> bytes:
        rng = self.rng
        payload: dict[str, Any] = {
            "topic": rng.choice(TOPICS),
            "range_id": rng.choice(self.range_ids),
            "offset": rng.choice([0, 0, 1, 10**6]),
            "window_bytes": rng.choice([1 << 16, 1, protocol.CONSUME_WINDOW_BYTES_MAX + 1]),
        }
        return self._json(MsgType.CONSUME_OPEN, payload)

    def append(self) -> bytes:
        rng = self.rng
        records = [
            Record(value=rng.randbytes(rng.randint(0, 200))) for _ in range(rng.randint(1, 3))
        ]
        batch = bytearray(encode_batch(records, int(time.time() * 1000)))
        if rng.random() < 0.2:
            batch[rng.randrange(len(batch))] ^= 1 << rng.randrange(8)
        if rng.random() < 0.05:
            batch = batch[: rng.randrange(len(batch))]
        return protocol.encode_append(
            rng.randint(1, 5), rng.choice([0, 0, 1, 2, 7, 2**63]), bytes(batch)
        )

    def read(self) -> bytes:
        rng = self.rng
        return protocol.encode_read(
            rng.randint(1, 5), rng.choice([0, 10, 2**63]), rng.choice([1 << 16, 0, 2**32 - 1])
        )

    def garbage(self) -> bytes:
        """Frames that must close this connection (and only it)."""
        rng = self.rng
        kind = rng.random()
        if kind < 0.3:
            return rng.randbytes(rng.randint(1, 64))
        if kind < 0.5:  # a type only a broker sends
            server = rng.choice([MsgType.RESPONSE, MsgType.ACK, MsgType.PUSH, MsgType.ERROR])
            return protocol.frame(server, rng.randbytes(rng.randint(0, 32)))
        if kind < 0.7:  # not JSON in a control frame
            return protocol.frame(MsgType.REQUEST, b"\x01\x00\x00\x00" + rng.randbytes(16))
        valid = bytearray(self.request())  # a bit flipped anywhere, prefix included
        valid[rng.randrange(len(valid))] ^= 1 << rng.randrange(8)
        return bytes(valid)

    def frame(self) -> bytes:
        roll = self.rng.random()
        if roll < 0.06:
            return self.garbage()
        if roll < 0.30:
            return self.request()
        if roll < 0.42:
            return self.produce_open()
        if roll < 0.52:
            return self.consume_open()
        if roll < 0.85:
            return self.append()
        if roll < 0.93:
            return self.read()
        return protocol.encode_stream_close(self.rng.randint(1, 5))


def _ping(address: tuple[str, int]) -> None:
    """A fresh connection must be answered: one hostile client never stalls the others."""
    with socket.create_connection(address, timeout=PING_TIMEOUT_S) as sock:
        sock.sendall(protocol.encode_json(MsgType.REQUEST, 99, {"op": "ping"}))
        decoder = protocol.FrameDecoder()
        while True:
            data = sock.recv(1 << 16)
            assert data, "the broker closed a bystander's connection"
            for item in decoder.feed(data):
                if item.type is MsgType.RESPONSE and protocol.decode_json(item.body)[0] == 99:
                    return


def _setup(address: tuple[str, int]) -> list[int]:
    """Create the fuzzed topics (if absent); return their range ids."""
    range_ids: list[int] = []
    with socket.create_connection(address, timeout=PING_TIMEOUT_S) as sock:
        decoder = protocol.FrameDecoder()
        for correlation, (op, name) in enumerate(
            [(op, name) for name in TOPICS for op in ("create_topic", "topic_metadata")], 1
        ):
            arguments: dict[str, Any] = {"op": op, "name": name}
            if op == "create_topic":
                arguments["count"] = 2
            sock.sendall(protocol.encode_json(MsgType.REQUEST, correlation, arguments))
            frames: list[protocol.Frame] = []
            while not frames:
                frames = decoder.feed(sock.recv(1 << 16))
            payload = protocol.decode_json(frames[0].body)[1]
            if op == "topic_metadata" and "result" in payload:
                range_ids += [r["range_id"] for r in payload["result"]["ranges"]]
    return range_ids


def run_fuzz(address: str, *, seed: int, frames_max: int, seconds_max: float) -> FuzzReport:
    """Send up to ``frames_max`` frames (stopping after ``seconds_max``) over a few connections."""
    host, _, port = address.rpartition(":")
    target = (host, int(port))
    rng = random.Random(seed)
    maker = FrameMaker(rng, _setup(target))
    report = FuzzReport(seed=seed)
    connections = [_Connection(target) for _ in range(CONNECTIONS)]
    started = time.monotonic()
    try:
        while report.frames < frames_max and time.monotonic() - started < seconds_max:
            index = rng.randrange(CONNECTIONS)
            connection = connections[index]
            if connection.closed:
                connection.close()
                connection = connections[index] = _Connection(target)
                report.reconnects += 1
            connection.send(maker.frame())
            report.frames += 1
            connection.drain(report)
            if report.frames % PING_EVERY_FRAMES == 0:
                _ping(target)
                report.pings += 1
                maker.range_ids = _setup(target) or maker.range_ids  # topics deleted or split
        for connection in connections:
            connection.drain(report)
        _ping(target)
        report.pings += 1
    finally:
        for connection in connections:
            connection.close()
        report.seconds = time.monotonic() - started
    return report


def first_traceback(log_text: str) -> str:
    at = log_text.find("Traceback")
    return "" if at < 0 else log_text[max(0, at - 300) : at + 3000]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=3600.0)
    parser.add_argument("--address", help="an existing broker (default: start one)")
    arguments = parser.parse_args()
    import tempfile

    from backends.northguard.launcher import start_northguard_broker

    with tempfile.TemporaryDirectory() as directory:
        process = None
        address = arguments.address
        if address is None:
            process = start_northguard_broker(Path(directory) / "data")
            address = process.url
        try:
            report = run_fuzz(
                address,
                seed=arguments.seed,
                frames_max=arguments.frames,
                seconds_max=arguments.seconds,
            )
            alive = process is None or process.popen is None or process.popen.poll() is None
            log_text = "" if process is None else process.log_tail(10**6)
            tracebacks = log_text.count("Traceback")
            error_lines = [
                line for line in log_text.splitlines() if line.split(" ", 3)[2:3] == ["ERROR"]
            ]
        finally:
            if process is not None:
                process.stop()
    print(
        json.dumps(
            {
                "seed": report.seed,
                "frames": report.frames,
                "seconds": round(report.seconds, 1),
                "reconnects": report.reconnects,
                "pings": report.pings,
                "internal_errors": len(report.internal_errors),
                "broker_tracebacks": tracebacks,
                "broker_alive": alive,
                "broker_error_lines": len(error_lines),
                "first_error_lines": error_lines[:5],
                "responses": dict(sorted(report.responses.items())),
                "first_internal_errors": report.internal_errors[:5],
                "first_traceback": first_traceback(log_text),
            },
            indent=2,
        )
    )
    clean = alive and not report.internal_errors and not tracebacks and not error_lines
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
