"""The service's front door: no body is read and no database is asked for a caller without a token.

``RequestGate`` is the ASGI layer under the fast path: every ``/v1`` request is
authenticated from its headers alone, before a byte of its body is read (and
outside ``/v1``, where every route is a read, a request with a body is refused
unread); a
refused one is answered at once and its connection closed, so a client
without a token can neither make the service buffer a body nor keep a
connection busy.  An accepted request's body is bounded while it streams:
a declared Content-Length over the limit is refused up front, a chunked body
is read up to the limit (never past it) and replayed to the app.

``TokenBucket``/``PeerBuckets`` bound unknown-token attempts per peer address
and token creations (``metadata_service.auth``).  Connection counts and header
timeouts live in the HTTP protocol (``metadata_service.server``).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

from metadata_service.auth import TokenService
from metadata_service.problems import PROBLEM_MEDIA_TYPE, error_response, problem
from xinfra.errors import XinfraError

PRINCIPAL_SCOPE_KEY = "xinfra.principal"
"""Where the gate leaves the authenticated ``Principal`` in the ASGI scope for ``deps``."""

_BODYLESS = ("GET", "HEAD", "OPTIONS")


class TokenBucket:
    """``burst`` tokens, refilled at ``rate_per_s``; ``take`` spends one if there is one."""

    def __init__(self, rate_per_s: float, burst: int) -> None:
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._tokens = float(burst)
        self._at = time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate_per_s)
        self._at = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True

    def give_back(self) -> None:
        self._tokens = min(self.burst, self._tokens + 1)


class PeerBuckets:
    """One ``TokenBucket`` per peer, the ``peers_max`` most recent kept (a forgotten peer starts
    full again: the bound is on memory, and an attacker needs that many addresses)."""

    def __init__(self, rate_per_s: float, burst: int, peers_max: int = 10_000) -> None:
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.peers_max = peers_max
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()

    def get(self, peer: str) -> TokenBucket:
        bucket = self._buckets.get(peer)
        if bucket is None:
            bucket = self._buckets[peer] = TokenBucket(self.rate_per_s, self.burst)
            while len(self._buckets) > self.peers_max:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(peer)
        return bucket


def peer_of(scope: Any) -> str:
    client = scope.get("client")
    return str(client[0]) if client else "-"


async def _send_closing(response: Any, scope: Any, receive: Any, send: Any) -> None:
    """Send ``response`` with ``Connection: close``: the rest of the request is never read."""
    response.headers["connection"] = "close"
    await response(scope, receive, send)


class RequestGate:
    def __init__(self, app: Any, tokens: TokenService, limit: int) -> None:
        self.app = app
        self.tokens = tokens
        self.limit = limit

    async def _too_large(self, send: Any) -> None:
        body = (
            b'{"type":"https://xinfra.dev/problems/invalid_request","title":"Request too large",'
            b'"status":413,"detail":"the request body exceeds '
            + str(self.limit).encode()
            + b' bytes","code":"invalid_request"}'
        )
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", PROBLEM_MEDIA_TYPE.encode()),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        if path == "/v1" or path.startswith("/v1/"):
            authorization = None
            for name, value in scope["headers"]:
                if name == b"authorization":
                    authorization = value.decode("latin-1")
                    break
            try:
                principal = await self.tokens.authenticate(authorization, peer_of(scope))
            except XinfraError as error:
                await _send_closing(error_response(error, path), scope, receive, send)
                return
            scope[PRINCIPAL_SCOPE_KEY] = principal
        elif scope["method"] not in _BODYLESS:
            # Outside /v1 every route is a read (health, metrics, docs): a body there is never
            # read, so nobody can make the service buffer one without a token.
            refused = problem(
                405,
                "method_not_allowed",
                "Method not allowed",
                f"{scope['method']} {path}: only /v1 takes a request body",
                path,
                {"allow": "GET, HEAD"},
            )
            await _send_closing(refused, scope, receive, send)
            return
        if scope["method"] in _BODYLESS:
            await self.app(scope, receive, send)
            return
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None:
            if not declared.isdigit() or int(declared) > self.limit:
                await self._too_large(send)
                return
            await self.app(scope, receive, send)  # h11 never delivers more than declared
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, receive, send)
                return
            size += len(message.get("body", b""))
            if size > self.limit:
                await self._too_large(send)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
