"""No exhaustion without a token (issue 17): a live service under uvicorn with the settings of
``metadata_service.server``, reached over raw sockets so that a test can stop mid-request.

Stated bounds: a connection that has not finished its request head within
``header_timeout_s`` is closed (checked here within that plus ``SLACK_S``); a
connection beyond ``connections_max`` is closed on accept; a refused request
is answered before its body is read and its connection closed.
"""

from __future__ import annotations

import contextlib
import gc
import selectors
import socket
import threading
import time
import tracemalloc
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

import pytest
import uvicorn
from ms_harness import ADMIN_TOKEN, running
from test_ms_api import assert_problem

from metadata_service import ServiceConfig, create_app
from metadata_service.server import uvicorn_config
from xinfra.services.ports import free_port

SLACK_S = 10.0
"""How much later than its bound a cut may be observed on a shared 2-core machine."""


@contextmanager
def live(config: ServiceConfig, http: str = "auto") -> Iterator[tuple[str, int]]:
    port = free_port()
    server = uvicorn.Server(uvicorn_config(create_app(config), "127.0.0.1", port, http=http))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield "127.0.0.1", port
    finally:
        server.should_exit = True
        thread.join(15)


def connect(address: tuple[str, int], stack: ExitStack) -> socket.socket:
    sock = stack.enter_context(socket.create_connection(address, timeout=SLACK_S))
    return sock


def read_response(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def wait_closed(socks: list[socket.socket], count: int, within_s: float) -> list[socket.socket]:
    """Wait until ``count`` of ``socks`` see end-of-file (or a reset); returns those."""
    closed: list[socket.socket] = []
    with selectors.DefaultSelector() as selector:
        for sock in socks:
            selector.register(sock, selectors.EVENT_READ)
        deadline = time.monotonic() + within_s
        while len(closed) < count:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"{len(closed)} of {count} connections closed in {within_s} s"
            for key, _ in selector.select(remaining):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    eof = sock.recv(4096) == b""
                except ConnectionResetError:
                    eof = True
                if eof:
                    closed.append(sock)
                    selector.unregister(sock)
    return closed


def chunked_head(path: str, token: str) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
        "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    ).encode()


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


@pytest.fixture
def limited(make_config: Callable[..., ServiceConfig]) -> ServiceConfig:
    return make_config(
        request_bytes_max=4096,
        header_timeout_s=0.5,
        connections_max=12,
        auth_failures_burst=1000,
    )


def test_unauthenticated_body_is_refused_before_it_is_read(limited: ServiceConfig) -> None:
    with live(limited) as address, ExitStack() as stack:
        for token in ("xt_unknown", ""):
            sock = connect(address, stack)
            # A chunked body that never ends: the 401 comes without it, and the connection closes.
            sock.sendall(chunked_head("/v1/tokens", token) + chunk(b"{" * 1000))
            response = read_response(sock)
            assert response.startswith(b"HTTP/1.1 401"), response[:200]
            assert b"connection: close" in response.lower()
        for path in ("/health", "/metrics", "/", "/docs"):
            # Outside /v1 no route takes a body: refused unread, without a token to check.
            sock = connect(address, stack)
            sock.sendall(chunked_head(path, "") + chunk(b"{" * 1000))
            response = read_response(sock)
            assert response.startswith(b"HTTP/1.1 405"), (path, response[:200])
            assert b"connection: close" in response.lower()


@pytest.mark.parametrize("http", ["h11", "httptools"])
def test_oversized_head_is_cut(make_config: Callable[..., ServiceConfig], http: str) -> None:
    config = make_config(header_timeout_s=60.0)  # the size cuts it, not the time
    with live(config, http) as address, ExitStack() as stack:
        sock = connect(address, stack)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        with contextlib.suppress(ConnectionError):  # the server may close while we still send
            for _ in range(40):  # 40 KiB of headers > header_bytes_max (16 KiB)
                sock.sendall(
                    b"X-Filler: " + b"a" * 1000 + b"\r\n" + b"X-More: " + b"b" * 14 + b"\r\n"
                )
        response = read_response_or_reset(sock)
        assert not response.startswith(b"HTTP/1.1 200"), response[:200]


def read_response_or_reset(sock: socket.socket) -> bytes:
    try:
        return read_response(sock)
    except ConnectionResetError:
        return b""


def test_oversized_chunked_body_is_cut_while_streaming(limited: ServiceConfig) -> None:
    with live(limited) as address, ExitStack() as stack:
        sock = connect(address, stack)
        sock.sendall(chunked_head("/v1/vclusters", ADMIN_TOKEN))
        for _ in range(5):  # 5000 bytes > 4096, never the final chunk
            sock.sendall(chunk(b" " * 1000))
        response = read_response(sock)
        assert response.startswith(b"HTTP/1.1 413"), response[:200]


@pytest.mark.parametrize("http", ["h11", "httptools"])
def test_slow_headers_are_cut(limited: ServiceConfig, http: str) -> None:
    with live(limited, http) as address, ExitStack() as stack:
        socks = [connect(address, stack) for _ in range(8)]
        for sock in socks[:4]:
            sock.sendall(b"GET /v1/clusters HTTP/1.1\r\nHost: x\r\n")  # never the blank line
        # Four send part of a head, four send nothing: all are closed after header_timeout_s.
        wait_closed(socks, 8, limited.header_timeout_s + SLACK_S)
        # Between requests on a kept-alive connection, the same bound holds for the next head.
        sock = connect(address, stack)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        wait_closed([sock], 1, limited.header_timeout_s + SLACK_S)


@pytest.mark.parametrize("http", ["h11", "httptools"])
def test_connections_beyond_the_limit_are_closed(
    make_config: Callable[..., ServiceConfig], http: str
) -> None:
    config = make_config(connections_max=6, header_timeout_s=60.0)
    with live(config, http) as address, ExitStack() as stack:
        socks = [connect(address, stack) for _ in range(10)]
        closed = wait_closed(socks, 4, SLACK_S)
        for sock in socks:
            if sock in closed:
                continue
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert read_response(sock).startswith(b"HTTP/1.1 200")


async def test_unknown_token_attempts_are_rate_limited(
    make_config: Callable[..., ServiceConfig],
) -> None:
    config = make_config(auth_failures_burst=5, auth_failures_per_s=0.01)
    async with running(config) as service:
        runtime = service.app.state.services.runtime
        misses_before = runtime.metrics.token_cache_misses._value.get()
        statuses = []
        for _ in range(12):
            headers = {"Authorization": f"Bearer xt_{uuid.uuid4().hex}"}
            statuses.append((await service.http.get("/v1/clusters", headers=headers)).status_code)
        assert statuses[:5] == [401] * 5 and set(statuses[5:]) == {429}
        refused = await service.http.get(
            "/v1/clusters", headers={"Authorization": "Bearer xt_again"}
        )
        body = assert_problem(refused, 429, "backpressure")
        assert "Retry-After" in refused.headers and "unknown tokens" in body["detail"]
        # Only the attempts within the budget cost a database lookup.
        assert runtime.metrics.token_cache_misses._value.get() - misses_before == 5
        # A valid token still works from there.
        await service.ok("GET", "/v1/clusters")


async def test_token_creation_is_rate_limited(
    make_config: Callable[..., ServiceConfig],
) -> None:
    config = make_config(token_creations_burst=3, token_creations_per_s=0.01)
    async with running(config) as service:
        for i in range(3):
            await service.ok(
                "POST", "/v1/tokens", 201, json={"name": f"t{i}", "role": "client", "scope": "*"}
            )
        assert_problem(
            await service.http.post(
                "/v1/tokens", json={"name": "t9", "role": "client", "scope": "*"}
            ),
            429,
            "backpressure",
        )


MEMORY_GROWTH_BYTES_MAX = 1 << 20
"""What a flood of refused requests may leave allocated: far below what it sent (~2.5 MB)."""


def test_memory_returns_to_its_baseline_after_a_flood_without_a_token(
    limited: ServiceConfig,
) -> None:
    """Refused bodies, oversized bodies and stalled heads leave nothing behind in the service.

    Python allocations of this process (the service runs in it) are traced
    from a warmed-up baseline; after the flood and its connections are gone,
    what is still allocated must be within ``MEMORY_GROWTH_BYTES_MAX``.
    """

    def flood(rounds: int) -> None:
        with ExitStack() as stack:
            for _ in range(rounds):
                sock = connect(address, stack)
                sock.sendall(chunked_head("/v1/tokens", "xt_unknown") + chunk(b"{" * 4000))
                assert read_response(sock).startswith(b"HTTP/1.1 401")
                sock = connect(address, stack)
                sock.sendall(chunked_head("/v1/vclusters", ADMIN_TOKEN))
                with contextlib.suppress(ConnectionError):  # cut while we still send
                    for _ in range(5):
                        sock.sendall(chunk(b" " * 1000))
                assert read_response_or_reset(sock)[:12] in (b"HTTP/1.1 413", b"")
            stalled = [connect(address, stack) for _ in range(8)]
            for sock in stalled:
                sock.sendall(b"GET /v1/clusters HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * 8000)
            wait_closed(stalled, 8, limited.header_timeout_s + SLACK_S)

    with live(limited) as address:
        flood(20)  # lazily built state (rate limiter, routes, logging) exists before the baseline
        gc.collect()
        tracemalloc.start()
        try:
            baseline, _ = tracemalloc.get_traced_memory()
            flood(250)
            gc.collect()
            after, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert after - baseline < MEMORY_GROWTH_BYTES_MAX, (
        f"{after - baseline} bytes still allocated after the flood"
    )
