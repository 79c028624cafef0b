"""One unary request over a plain blocking socket, for the few synchronous entry points.

``Backend.producer`` is synchronous yet must know a topic's shard count so
``send`` can refuse a shard out of range at once (the Kafka backend reads its
partition count the same way).  This is that one round trip, bounded by a
timeout; it never runs on a hot path.
"""

from __future__ import annotations

import socket
from typing import Any

from backends.northguard import protocol
from backends.northguard.client.connection import error_of
from backends.northguard.protocol import MsgType
from xinfra.errors import BackendUnavailable, ProtocolError, Timeout


def request_blocking(address: str, op: str, timeout_s: float, **arguments: Any) -> dict[str, Any]:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
            sock.sendall(protocol.encode_json(MsgType.REQUEST, 1, {"op": op, **arguments}))
            decoder = protocol.FrameDecoder()
            while True:
                data = sock.recv(1 << 16)
                if not data:
                    raise BackendUnavailable(f"Northguard broker {address} closed the connection")
                for item in decoder.feed(data):
                    if item.type not in (MsgType.RESPONSE, MsgType.ERROR):
                        raise ProtocolError(f"unexpected {item.type.name} answering a request")
                    _, payload = protocol.decode_json(item.body)
                    if "error" in payload:
                        raise error_of(payload)
                    result: dict[str, Any] = payload.get("result") or {}
                    return result
    except TimeoutError as error:
        raise Timeout(
            f"{op} to Northguard broker {address} got no answer in {timeout_s:g} s"
        ) from error
    except OSError as error:
        raise BackendUnavailable(f"cannot reach Northguard broker {address}: {error}") from error
