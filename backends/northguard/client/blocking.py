"""One unary request over a plain blocking socket, for the few synchronous entry points.

``Backend.producer`` is synchronous yet must know a topic's shard count so
``send`` can refuse a shard out of range at once (the Kafka backend reads its
partition count the same way).  This is that one round trip, bounded by a
timeout; it never runs on a hot path.  With a TLS context it is a TLS
connection like every other (``backends.northguard.tls``), its handshake
bounded by the same timeout.
"""

from __future__ import annotations

import socket
import ssl
from typing import Any

from backends.northguard import protocol, tls
from backends.northguard.client.connection import error_of
from backends.northguard.protocol import MsgType
from xinfra.errors import BackendTimeout, BackendUnavailable, ProtocolError


def request_blocking(
    address: str,
    op: str,
    timeout_s: float,
    credential: str | None = None,
    tls_context: ssl.SSLContext | None = None,
    **arguments: Any,
) -> dict[str, Any]:
    """``op``'s result; with ``credential``, an ``authenticate`` is pipelined before it (its
    answer is skipped: a refusal shows as the request's own ``unauthorized`` answer)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as raw:
            sock = raw if tls_context is None else _handshake(tls_context, raw, host, address)
            with sock:  # the TLS socket took the descriptor over: close that one
                hello = b""
                if credential is not None:
                    hello = protocol.encode_json(
                        MsgType.REQUEST, 0, {"op": "authenticate", "credential": credential}
                    )
                sock.sendall(
                    hello + protocol.encode_json(MsgType.REQUEST, 1, {"op": op, **arguments})
                )
                decoder = protocol.FrameDecoder()
                while True:
                    data = sock.recv(1 << 16)
                    if not data:
                        hint = "" if tls_context is not None else f" ({tls.PLAINTEXT_HINT})"
                        raise BackendUnavailable(
                            f"Northguard broker {address} closed the connection{hint}"
                        )
                    for item in decoder.feed(data):
                        if item.type not in (MsgType.RESPONSE, MsgType.ERROR):
                            raise ProtocolError(f"unexpected {item.type.name} answering a request")
                        correlation, payload = protocol.decode_json(item.body)
                        if item.type is MsgType.RESPONSE and correlation == 0:
                            continue  # the authenticate answer
                        if "error" in payload:
                            raise error_of(payload)
                        result: dict[str, Any] = payload.get("result") or {}
                        return result
    except TimeoutError as error:
        raise BackendTimeout(
            f"{op} to Northguard broker {address} got no answer in {timeout_s:g} s"
        ) from error
    except OSError as error:
        hint = "" if tls_context is not None else f" ({tls.PLAINTEXT_HINT})"
        if isinstance(error, ConnectionRefusedError | socket.gaierror):
            hint = ""
        raise BackendUnavailable(
            f"cannot reach Northguard broker {address}: {error}{hint}"
        ) from error


def _handshake(
    context: ssl.SSLContext, sock: socket.socket, host: str, address: str
) -> ssl.SSLSocket:
    """``sock`` after a completed TLS handshake (bounded by its timeout), or a
    ``BackendUnavailable`` naming TLS."""
    try:
        return context.wrap_socket(sock, server_hostname=host)
    except (OSError, TimeoutError) as error:  # ssl.SSLError is an OSError
        if isinstance(error, TimeoutError):
            detail: BaseException = TimeoutError(f"no TLS answer in {sock.gettimeout():g} s")
        else:
            detail = error
        raise BackendUnavailable(tls.describe_failure(address, detail)) from error
