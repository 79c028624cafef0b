"""A broker bounds its client connections, in total and per peer address (issue 17).

Real broker process, real sockets; the peers are distinct loopback addresses
(127.0.0.x), so the per-peer and the total bound are told apart.  A refused
connection is closed as it is accepted; the connections already held keep
working, and a slot freed is taken again.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from backends.northguard import protocol
from backends.northguard.launcher import NorthguardProcess, start_northguard_broker
from backends.northguard.protocol import MsgType

TIMEOUT_S = 10.0


@pytest.fixture
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NorthguardProcess]:
    process = start_northguard_broker(
        tmp_path_factory.mktemp("ng-limits") / "data",
        extra_args=["--connections-max", "3", "--connections-per-peer-max", "2"],
    )
    yield process
    process.stop()


def connect(process: NorthguardProcess, peer: str, stack: ExitStack) -> socket.socket:
    host, _, port = process.url.rpartition(":")
    sock = socket.create_connection((host, int(port)), TIMEOUT_S, source_address=(peer, 0))
    return stack.enter_context(sock)


def ping(sock: socket.socket) -> dict[str, Any] | None:
    """The broker's answer to a ping on ``sock``; None when it closed the connection."""
    try:
        sock.sendall(protocol.encode_json(MsgType.REQUEST, 1, {"op": "ping"}))
        decoder = protocol.FrameDecoder()
        while True:
            data = sock.recv(1 << 16)
            if not data:
                return None
            for item in decoder.feed(data):
                return protocol.decode_json(item.body)[1]
    except (ConnectionResetError, BrokenPipeError):
        return None


def open_connections(process: NorthguardProcess) -> int:
    """The client connections the broker holds, from its health endpoint."""
    health = httpx.get(f"http://127.0.0.1:{process.http_port}/health", timeout=TIMEOUT_S).json()
    return int(health["connections"])


def refused_count(process: NorthguardProcess) -> float:
    text = httpx.get(f"http://127.0.0.1:{process.http_port}/metrics", timeout=TIMEOUT_S).text
    for line in text.splitlines():
        if line.startswith("northguard_connections_refused_total "):
            return float(line.split()[1])
    raise AssertionError("no northguard_connections_refused_total in /metrics")


def test_connections_past_the_per_peer_and_total_bounds_are_closed_on_accept(
    limited: NorthguardProcess,
) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while open_connections(limited) > 0:  # the launcher's readiness probe, until seen closed
        assert time.monotonic() < deadline, "the broker kept the readiness probe's connection"
    with ExitStack() as stack:
        first, second = (connect(limited, "127.0.0.1", stack) for _ in range(2))
        assert ping(first) is not None and ping(second) is not None
        assert ping(connect(limited, "127.0.0.1", stack)) is None  # a third from one peer
        other = connect(limited, "127.0.0.2", stack)
        assert ping(other) is not None  # another peer: 3 in total
        assert ping(connect(limited, "127.0.0.3", stack)) is None  # a fourth in total
        assert ping(first) is not None and ping(other) is not None  # the held ones still work
        assert refused_count(limited) == 2
        first.close()  # a slot freed is taken again, by the same peer
        deadline = time.monotonic() + TIMEOUT_S
        while open_connections(limited) > 2:  # the broker sees the close on its own time
            assert time.monotonic() < deadline, "the broker kept a closed connection"
        assert ping(connect(limited, "127.0.0.1", stack)) is not None
