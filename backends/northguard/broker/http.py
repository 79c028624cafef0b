"""A minimal HTTP endpoint on its own port: ``/health`` (JSON) and ``/metrics`` (Prometheus).

Deliberately tiny: one request per connection, request line and headers
bounded (``REQUEST_BYTES_MAX``), nothing else served.  It runs on the broker's
event loop, so a health probe that answers proves the loop is alive.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from backends.northguard.runtime import close_writer

REQUEST_BYTES_MAX = 8192
REQUEST_TIMEOUT_S = 5.0


class HealthServer:
    def __init__(
        self, health: Callable[[], tuple[bool, dict[str, Any]]], registry: CollectorRegistry
    ) -> None:
        self._health = health
        self._registry = registry

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT_S)
            if len(head) > REQUEST_BYTES_MAX:
                raise ValueError("request too large")
            parts = head.split(b"\r\n", 1)[0].split()
            path = parts[1].decode() if len(parts) >= 2 else "/"
            if path == "/health":
                ok, details = self._health()
                body = json.dumps({"status": "ok" if ok else "failing", **details}).encode()
                status, content_type = (
                    ("200 OK" if ok else "503 Service Unavailable"),
                    "application/json",
                )
            elif path == "/metrics":
                body = generate_latest(self._registry)
                status, content_type = "200 OK", CONTENT_TYPE_LATEST
            else:
                body, status, content_type = b"not found\n", "404 Not Found", "text/plain"
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                + body
            )
        except (
            TimeoutError,
            ValueError,
            ConnectionError,
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
        ):
            pass
        finally:
            # The answer leaves as the transport closes, bounded: a scraper that stops reading
            # is aborted, never waited on (an unbounded drain or wait_closed held it forever).
            await close_writer(writer)
