"""Connections from this broker to other brokers: one per peer address, opened on first use.

A broker talks to its peers with the client protocol (``ClientConnection``):
unary requests (``register_broker``, ``replica_create``, ``replica_fence``,
``replica_seal``, a proxied metadata request) and replica streams.  With a
cluster secret, a broker signs itself an admin credential with it (peers are
brokers of the same cluster).  When the brokers' client port speaks TLS,
peer connections do too, verifying the peer's certificate against the
broker's ``peer_tls_ca`` (else the system's trust store).

A failed connection is replaced at the next use; ``close`` ends them all.
Bounds: one connection per address, ``PEERS_MAX`` addresses.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from typing import Any

from backends.northguard.client.connection import ClientConnection
from backends.northguard.credentials import ALL_TOPICS, OPERATIONS, sign
from backends.northguard.runtime import Runtime
from xinfra.errors import Backpressure

PEERS_MAX = 1024
PEER_CREDENTIAL_TTL_S = 900.0


class PeerPool:
    def __init__(
        self,
        runtime: Runtime,
        broker_id: str,
        secret: bytes | None,
        timeout_s: float,
        tls_context: ssl.SSLContext | None = None,
    ) -> None:
        self._runtime = runtime
        self._tls_context = tls_context
        self._broker_id = broker_id
        self._secret = secret
        self.timeout_s = timeout_s
        self._connections: dict[str, ClientConnection] = {}
        self._opening: dict[str, asyncio.Future[ClientConnection]] = {}
        self._credential: str | None = None
        self._signed_s = 0.0

    def _credential_source(self) -> str | None:
        if self._secret is None:
            return None
        if self._credential is None or time.time() - self._signed_s > PEER_CREDENTIAL_TTL_S / 2:
            self._signed_s = time.time()
            self._credential = sign(
                self._secret,
                f"broker:{self._broker_id}",
                ALL_TOPICS,
                OPERATIONS,
                PEER_CREDENTIAL_TTL_S,
            )
        return self._credential

    async def connection(self, address: str) -> ClientConnection:
        existing = self._connections.get(address)
        if existing is not None and not existing.closed:
            return existing
        opening = self._opening.get(address)
        if opening is None:
            if len(self._connections) >= PEERS_MAX and address not in self._connections:
                raise Backpressure(f"more than {PEERS_MAX} peer brokers")
            opening = asyncio.ensure_future(
                ClientConnection.open(
                    self._runtime,
                    address,
                    self.timeout_s,
                    credential_source=self._credential_source,
                    tls_context=self._tls_context,
                )
            )
            self._opening[address] = opening
        try:
            connection = await asyncio.shield(opening)
        finally:
            if opening.done():
                self._opening.pop(address, None)
        self._connections[address] = connection
        return connection

    async def request(self, address: str, op: str, /, **arguments: Any) -> dict[str, Any]:
        connection = await self.connection(address)
        return await connection.request(op, self.timeout_s, **arguments)

    async def request_with_timeout(
        self, address: str, op: str, timeout_s: float, /, **arguments: Any
    ) -> dict[str, Any]:
        """``request`` with its own bound (a long step: a segment copy)."""
        connection = await self.connection(address)
        return await connection.request(op, timeout_s, **arguments)

    async def close(self) -> None:
        for opening in list(self._opening.values()):
            opening.cancel()
        for connection in list(self._connections.values()):
            await connection.close()
        self._connections.clear()
