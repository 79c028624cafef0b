"""The hot routes (``metadata_service.hot_routes``): a plain topic-metadata read (cached or
not) and a commit are answered from the HTTP protocol without the ASGI app, the same bytes
the app answers, a commit only once durable in MySQL, and everything else still through
the app.

A live service under uvicorn with ``metadata_service.server``'s settings, its ASGI app
wrapped to count the requests it sees, reached over raw sockets.
"""

from __future__ import annotations

import gc
import json
import logging
import re
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
import uvicorn
from ms_harness import ADMIN_TOKEN
from ms_memory_backend import memory_cluster
from sqlalchemy.exc import OperationalError

from metadata_service import ServiceConfig, create_app
from metadata_service.hot_routes import _COMMIT_PATH, _READ_PATH
from metadata_service.server import direct_head, prepare_process, uvicorn_config
from xinfra.names import NAME_PATTERN
from xinfra.services.ports import free_port

VC = "default"
TIMEOUT_S = 30.0


class CountingApp:
    """The ASGI app, counting the HTTP requests that reach it."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.requests: list[tuple[str, str]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            self.requests.append((scope["method"], scope["path"]))
        await self.app(scope, receive, send)


@dataclass
class Live:
    url: str
    port: int
    app: Any
    counting: CountingApp
    server: uvicorn.Server

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=TIMEOUT_S)


@contextmanager
def live(config: ServiceConfig) -> Iterator[Live]:
    port = free_port()
    app = create_app(config)
    uv = uvicorn_config(app, "127.0.0.1", port, http="httptools", log_level="warning")
    counting = CountingApp(app)
    uv.app = counting
    server = uvicorn.Server(uv)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + TIMEOUT_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield Live(f"http://127.0.0.1:{port}", port, app, counting, server)
    finally:
        server.should_exit = True
        thread.join(15)


@dataclass
class Response:
    status: int
    headers: dict[bytes, bytes]
    body: bytes


def read_response(sock: socket.socket) -> Response:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a whole head: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get(b"content-length", b"0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "closed inside a body"
        body += chunk
    return Response(int(lines[0].split()[1]), headers, body)


def read_responses(sock: socket.socket, count: int) -> list[Response]:
    """``count`` answers read whole from ``sock`` (``read_response`` drops bytes past its one)."""
    with sock.makefile("rb") as stream:
        answers = []
        for _ in range(count):
            lines = []
            while (line := stream.readline()) not in (b"\r\n", b""):
                lines.append(line.rstrip(b"\r\n"))
            assert lines, "closed before a whole head"
            headers = {}
            for header in lines[1:]:
                name, _, value = header.partition(b":")
                headers[name.strip().lower()] = value.strip()
            body = stream.read(int(headers.get(b"content-length", b"0")))
            answers.append(Response(int(lines[0].split()[1]), headers, body))
        return answers


def request(
    sock: socket.socket,
    method: str,
    path: str,
    token: str,
    body: bytes | None = None,
    extra: str = "",
) -> Response:
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n{extra}"
    if body is not None:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    sock.sendall(head.encode() + b"\r\n" + (body or b""))
    return read_response(sock)


def commit_body(topic: str, shard: int, offset: int = 0) -> bytes:
    return json.dumps(
        {"positions": [{"topic": topic, "epoch": 0, "shard": shard, "offset": offset}]}
    ).encode()


def without_date(response: Response) -> tuple[int, dict[bytes, bytes], bytes]:
    return (
        response.status,
        {k: v for k, v in response.headers.items() if k != b"date"},
        response.body,
    )


@contextmanager
def serving(config: ServiceConfig) -> Iterator[tuple[Live, str, str]]:
    """A live service with a topic of 4 shards; (live, topic, a client token of ``VC``)."""
    with live(config) as service:
        address = f"memory-{uuid.uuid4().hex[:8]}:9092"
        memory_cluster(address)
        topic = f"t-{uuid.uuid4().hex[:6]}"
        with httpx.Client(
            base_url=service.url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30
        ) as admin:
            admin.post(
                "/v1/clusters", json={"name": "k1", "kind": "kafka", "bootstrap": address}
            ).raise_for_status()
            admin.post(
                f"/v1/vclusters/{VC}/topics", json={"name": topic, "cluster": "k1", "shards": 4}
            ).raise_for_status()
            created = admin.post(
                "/v1/tokens",
                json={"name": f"c-{uuid.uuid4().hex[:6]}", "role": "client", "scope": VC},
            )
            created.raise_for_status()
        yield service, topic, created.json()["token"]


@pytest.fixture
def served(make_config: Callable[..., ServiceConfig]) -> Iterator[tuple[Live, str, str]]:
    with serving(make_config()) as service:
        yield service


def checkpoint_rows(service: Live, group: str) -> list[tuple[str, int, int, int]]:
    engine = service.app.state.services.runtime.store.engine
    with engine.connect() as c:
        result = c.execute(
            sa.text(
                "SELECT topic, epoch, shard, position FROM checkpoints "
                "WHERE virtual_cluster = :vc AND group_name = :g ORDER BY shard"
            ),
            {"vc": VC, "g": group},
        )
        return [tuple(r) for r in result]  # type: ignore[misc]


def test_a_read_is_answered_without_the_app_with_the_apps_bytes(
    served: tuple[Live, str, str],
) -> None:
    service, topic, token = served
    path = f"/v1/vclusters/{VC}/topics/{topic}/metadata"
    with service.connect() as sock:
        seen = len(service.counting.requests)
        polled = request(sock, "GET", path + "?after_version=0", token)  # the app's answer
        assert len(service.counting.requests) == seen + 1
        service.app.state.services.runtime.cache.invalidate(None)
        first = request(sock, "GET", path, token)  # a cache miss: a store read
        second = request(sock, "GET", path, token)  # a hit, on the same connection
        third = request(sock, "GET", path, token)
        assert len(service.counting.requests) == seen + 1, "a plain read reached the app"
        missing = request(sock, "GET", f"/v1/vclusters/{VC}/topics/nope/metadata", token)
        assert len(service.counting.requests) == seen + 1
    assert polled.status == 200 and polled.headers[b"etag"] == b'"1"'
    for answer in (first, second, third):
        assert without_date(answer) == without_date(polled)
    assert json.loads(second.body)["topic"]["name"] == topic
    assert missing.status == 404
    assert missing.headers[b"content-type"] == b"application/problem+json"
    problem = json.loads(missing.body)
    assert problem["code"] == "topic_not_found"
    assert problem["instance"] == f"/v1/vclusters/{VC}/topics/nope/metadata"


def test_a_commit_is_answered_without_the_app_once_durable(
    served: tuple[Live, str, str],
) -> None:
    service, topic, token = served
    group = f"g-{uuid.uuid4().hex[:6]}"
    path = f"/v1/vclusters/{VC}/groups/{group}/commit"
    with service.connect() as sock:
        seen = len(service.counting.requests)
        claimed = request(sock, "POST", path, token, commit_body(topic, 0))  # claims the group
        assert claimed.status == 204
        assert len(service.counting.requests) == seen + 1
        answer = request(sock, "POST", path, token, commit_body(topic, 1))
        assert answer.status == 204 and answer.body == b""
        assert len(service.counting.requests) == seen + 1, "a commit reached the app"
        # Durable when acknowledged: MySQL has it now.
        assert checkpoint_rows(service, group) == [(topic, 0, 0, 0), (topic, 0, 1, 0)]

        # Acknowledged only after the flush that holds it: block the flush on a row lock.
        engine = service.app.state.services.runtime.store.engine
        with engine.connect() as blocker:
            transaction = blocker.begin()
            blocker.execute(
                sa.text("SELECT * FROM checkpoints WHERE group_name = :g FOR UPDATE"),
                {"g": group},
            )
            head = (
                f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
                f"Content-Length: {len(commit_body(topic, 1))}\r\n\r\n"
            )
            sock.sendall(head.encode() + commit_body(topic, 1))
            buffer = service.app.state.groups.checkpoints.buffer
            deadline = time.monotonic() + TIMEOUT_S
            while buffer.in_flight == 0:  # the flight has taken the commit and waits on MySQL
                assert time.monotonic() < deadline, "the commit never reached a flush"
                time.sleep(0.01)
            sock.setblocking(False)
            with pytest.raises(BlockingIOError):
                sock.recv(1)  # nothing answered while the upsert waits for the lock
            sock.setblocking(True)
            transaction.rollback()
        assert read_response(sock).status == 204
        assert len(service.counting.requests) == seen + 1


def test_what_the_hot_routes_cannot_answer_goes_to_the_app(
    served: tuple[Live, str, str],
) -> None:
    service, topic, token = served
    group = f"g-{uuid.uuid4().hex[:6]}"
    commit = f"/v1/vclusters/{VC}/groups/{group}/commit"
    read = f"/v1/vclusters/{VC}/topics/{topic}/metadata"
    with service.connect() as sock:
        assert request(sock, "POST", commit, token, commit_body(topic, 0)).status == 204
        assert request(sock, "GET", read, token).status == 200
        seen = len(service.counting.requests)
        bad = request(sock, "POST", commit, token, commit_body(topic, 0, offset=-1))
        assert bad.status == 422 and bad.headers[b"content-type"] == b"application/problem+json"
        assert json.loads(bad.body)["code"] == "invalid_request"
        out_of_range = request(sock, "POST", commit, token, commit_body(topic, 9))
        assert out_of_range.status == 400, out_of_range.body
        assert json.loads(out_of_range.body)["code"] == "shard_out_of_range"
        polled = request(sock, "GET", read + "?after_version=0", token)
        assert polled.status == 200
        assert len(service.counting.requests) == seen + 3
    with service.connect() as sock:
        refused = request(sock, "POST", commit, "xt_unknown", commit_body(topic, 0))
        assert refused.status == 401 and refused.headers[b"connection"] == b"close"
        assert sock.recv(1) == b""  # refused unread, connection closed: the gate's answer
    with service.connect() as sock:
        other = request(sock, "GET", read.replace(f"/{VC}/", "/other/"), token)
        assert other.status in (403, 404)  # out of the token's scope: the app's answer


def test_a_failed_flush_is_the_commits_problem(
    served: tuple[Live, str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    service, topic, token = served
    group = f"g-{uuid.uuid4().hex[:6]}"
    path = f"/v1/vclusters/{VC}/groups/{group}/commit"
    store = service.app.state.groups.checkpoints.store
    with service.connect() as sock:
        assert request(sock, "POST", path, token, commit_body(topic, 0)).status == 204
        seen = len(service.counting.requests)

        def down(_rows: Any) -> None:
            raise OperationalError("INSERT", {}, Exception("MySQL is down"))

        monkeypatch.setattr(store, "upsert", down)
        failed = request(sock, "POST", path, token, commit_body(topic, 1))
        assert len(service.counting.requests) == seen, "the failed commit went through the app"
        assert failed.status == 503
        assert failed.headers[b"content-type"] == b"application/problem+json"
        assert failed.headers[b"retry-after"] == b"1"
        problem = json.loads(failed.body)
        assert problem["code"] == "unavailable" and problem["instance"] == path
        assert "MySQL is down" in problem["detail"]
        monkeypatch.undo()
        assert request(sock, "POST", path, token, commit_body(topic, 1)).status == 204
    assert checkpoint_rows(service, group) == [(topic, 0, 0, 0), (topic, 0, 1, 0)]


def test_hot_answers_are_counted_and_honour_connection_close(
    served: tuple[Live, str, str],
) -> None:
    service, topic, token = served
    read = f"/v1/vclusters/{VC}/topics/{topic}/metadata"
    with service.connect() as sock:
        request(sock, "GET", read, token)
    seen = len(service.counting.requests)
    with service.connect() as sock:
        closing = request(sock, "GET", read, token, extra="Connection: close\r\n")
        assert closing.status == 200 and closing.headers[b"connection"] == b"close"
        assert sock.recv(1) == b""
    assert len(service.counting.requests) == seen
    metrics = httpx.get(f"{service.url}/metrics").text
    template = "/v1/vclusters/{vc}/topics/{topic}/metadata"
    counted = [
        line
        for line in metrics.splitlines()
        if line.startswith("xinfra_metadata_http_requests_total{")
        and f'route="{template}"' in line
        and 'status="200"' in line
    ]
    assert counted and float(counted[0].split()[-1]) >= 2


def test_a_served_process_hands_the_gil_back_to_its_loop_within_a_millisecond(
    make_config: Callable[..., ServiceConfig],
) -> None:
    """``serve`` prepares its process: the store's pools opened in full (a new PyMySQL
    connection builds a TLS context, ~27 ms holding the GIL: a stall of every request when
    the pool grew under load), the heap built so far frozen out of the collector's scans,
    and a GIL switch interval short enough that a store call on a worker thread holds the
    event loop back for at most about a millisecond (CPython's 5 ms default let every cold
    read's batch stall the cached reads behind it)."""
    app = create_app(make_config(db_pool_size=3))
    engine = app.state.services.runtime.store.engine
    opened = 0

    def counted(*_: Any) -> None:
        nonlocal opened
        opened += 1

    sa.event.listen(engine, "connect", counted)
    before = sys.getswitchinterval()
    frozen = gc.get_freeze_count()
    try:
        prepare_process(app)
        assert opened == 3 and engine.pool.checkedin() == 3
        assert app.state.groups.checkpoints.store.flush_engine.pool.checkedin() == 4
        assert sys.getswitchinterval() <= 0.001
        assert gc.get_freeze_count() >= frozen
        with engine.connect(), engine.connect(), engine.connect():
            pass
        assert opened == 3, "serving opened a connection the pool should have held"
    finally:
        sys.setswitchinterval(before)
        gc.unfreeze()
        engine.dispose()
        app.state.groups.checkpoints.store.close()


def test_a_commit_that_waits_for_100_continue_gets_it(served: tuple[Live, str, str]) -> None:
    service, topic, token = served
    group = f"g-{uuid.uuid4().hex[:6]}"
    path = f"/v1/vclusters/{VC}/groups/{group}/commit"
    body = commit_body(topic, 0)
    with service.connect() as sock:
        assert request(sock, "POST", path, token, body).status == 204  # claimed: hot from here
        sock.sendall(
            (
                f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
                f"Expect: 100-continue\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode()
        )
        assert read_response(sock).status == 100  # only then does the client send its body
        sock.sendall(body)
        assert read_response(sock).status == 204


def test_hot_answers_are_access_logged_as_uvicorn_logs_them(
    served: tuple[Live, str, str],
) -> None:
    service, topic, token = served
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Collect()
    access = logging.getLogger("uvicorn.access")
    level = access.level
    access.addHandler(handler)
    access.setLevel(logging.INFO)
    try:
        group = f"g-{uuid.uuid4().hex[:6]}"
        read = f"/v1/vclusters/{VC}/topics/{topic}/metadata"
        commit = f"/v1/vclusters/{VC}/groups/{group}/commit"
        with service.connect() as sock:
            assert request(sock, "POST", commit, token, commit_body(topic, 0)).status == 204
            seen = len(service.counting.requests)
            assert request(sock, "GET", read, token).status == 200
            assert request(sock, "POST", commit, token, commit_body(topic, 1)).status == 204
            assert len(service.counting.requests) == seen
    finally:
        access.removeHandler(handler)
        access.setLevel(level)
    assert any(f'"GET {read} HTTP/1.1" 200' in line for line in lines), lines
    assert sum(f'"POST {commit} HTTP/1.1" 204' in line for line in lines) == 2, lines


def commit_on_each(
    socks: list[socket.socket], paths: list[str], token: str, topic: str
) -> list[Response]:
    """One commit on each connection, all sent before any answer is read."""
    for sock, path in zip(socks, paths, strict=True):
        body = commit_body(topic, 0)
        sock.sendall(
            (
                f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            ).encode()
            + body
        )
    return [read_response(sock) for sock in socks]


@contextmanager
def held_flight(
    service: Any, topic: str, token: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """A commit of its own group whose flush is held in MySQL's upsert until the block ends
    (then answered 204): while it is out, later commits gather into one batch."""
    store = service.app.state.groups.checkpoints.store
    buffer = service.app.state.groups.checkpoints.buffer
    upsert, gate, entered = store.upsert, threading.Event(), threading.Event()

    def held(rows: Any) -> None:
        entered.set()
        gate.wait(60)
        upsert(rows)

    group = f"g-{uuid.uuid4().hex[:6]}"
    with service.connect() as sock:
        [claim] = commit_on_each(
            [sock], [f"/v1/vclusters/{VC}/groups/{group}/commit"], token, topic
        )
        assert claim.status == 204  # the app's route claims the group: the next one is hot
        monkeypatch.setattr(store, "upsert", held)
        body = commit_body(topic, 0)
        sock.sendall(
            (
                f"POST /v1/vclusters/{VC}/groups/{group}/commit HTTP/1.1\r\nHost: x\r\n"
                f"Authorization: Bearer {token}\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode()
            + body
        )
        # Held once its flight is in the upsert, not once it is taken: a flight taken but not
        # yet started would find the upsert restored below, land at once and wake the batch.
        assert entered.wait(30), "the held commit never flew"
        assert buffer.in_flight == 1
        monkeypatch.setattr(store, "upsert", upsert)  # later flights write at once
        try:
            yield
        finally:
            gate.set()
        assert read_response(sock).status == 204


def test_the_commits_of_one_flush_are_answered_together_each_with_its_own_outcome(
    make_config: Callable[..., ServiceConfig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three commits fill the buffer (3 keys, no timer flush in the test's time) behind a
    flight held out (an idle buffer flies the first commit at once): one flush holds them, and
    its end answers all three, 204 when durable, and each its own problem+json (its own path as
    ``instance``) when the flush failed."""
    config = make_config(checkpoint_flush_s=300.0, checkpoint_buffer_keys_max=3)
    with serving(config) as (service, topic, token):
        groups = [f"g-{uuid.uuid4().hex[:6]}" for _ in range(3)]
        paths = [f"/v1/vclusters/{VC}/groups/{group}/commit" for group in groups]
        buffer = service.app.state.groups.checkpoints.buffer
        socks = [service.connect() for _ in groups]
        try:
            claims = commit_on_each(socks, paths, token, topic)  # the app's route claims them
            assert [c.status for c in claims] == [204] * 3
            with held_flight(service, topic, token, monkeypatch):
                seen, flushes = len(service.counting.requests), buffer.flushes
                answers = commit_on_each(socks, paths, token, topic)
                assert [a.status for a in answers] == [204] * 3
                assert buffer.flushes == flushes + 1, "the three commits were not one flush"
            assert len(service.counting.requests) == seen, "a commit reached the app"

            def down(_rows: Any) -> None:
                raise OperationalError("INSERT", {}, Exception("MySQL is down"))

            monkeypatch.setattr(service.app.state.groups.checkpoints.store, "upsert", down)
            failed = commit_on_each(socks, paths, token, topic)
            assert len(service.counting.requests) == seen
            for answer, path in zip(failed, paths, strict=True):
                assert answer.status == 503
                assert answer.headers[b"content-type"] == b"application/problem+json"
                problem = json.loads(answer.body)
                assert problem["code"] == "unavailable" and problem["instance"] == path
            monkeypatch.undo()
            assert [a.status for a in commit_on_each(socks, paths, token, topic)] == [204] * 3
        finally:
            for sock in socks:
                sock.close()
        for group in groups:
            assert checkpoint_rows(service, group) == [(topic, 0, 0, 0)]
        metrics = httpx.get(f"{service.url}/metrics").text
        counted = [
            line
            for line in metrics.splitlines()
            if line.startswith("xinfra_metadata_http_requests_total{")
            and 'route="/v1/vclusters/{vc}/groups/{group}/commit"' in line
        ]
        by_status = {line.split('status="')[1][:3]: float(line.split()[-1]) for line in counted}
        assert by_status["503"] == 3 and by_status["204"] >= 6


@pytest.mark.parametrize(
    "name", ["t", "t-1.x_y", "9" * 200, "9" * 201, ".x", "-x", "a\n", "a b", "é", "a%2Fb", ""]
)
def test_the_hot_paths_take_exactly_the_names_the_routers_take(name: str) -> None:
    """One match a request (names inside the path patterns), the names ``NAME_PATTERN`` takes:
    anything else goes on to the app, which answers it."""
    valid = re.fullmatch(NAME_PATTERN.removeprefix("^").removesuffix("$"), name) is not None
    for vc, other in ((name, "ok"), ("ok", name)):
        read = _READ_PATH.fullmatch(f"/v1/vclusters/{vc}/topics/{other}/metadata")
        commit = _COMMIT_PATH.fullmatch(f"/v1/vclusters/{vc}/groups/{other}/commit")
        assert (read is not None, commit is not None) == (valid, valid)
        if read is not None:
            assert (read[1], read[2]) == (vc, other)


DIRECT_BODY = b'{"positions": []}'
DIRECT_HEAD = (
    b"POST /v1/vclusters/default/groups/g/commit HTTP/1.1\r\nHost: x\r\n"
    b"Authorization: Bearer xt_t\r\nContent-Type: application/json\r\n"
)


def direct(extra: bytes = b"", length: int = len(DIRECT_BODY), tail: bytes = b"") -> bytes:
    return DIRECT_HEAD + extra + b"Content-Length: %d\r\n\r\n" % length + DIRECT_BODY + tail


def test_httpx_headers_are_taken_directly() -> None:
    extra = b"Accept-Encoding: gzip, deflate\r\nConnection: Keep-Alive\r\nUser-Agent: httpx\r\n"
    assert direct_head(direct(extra)) is not None


def test_a_commit_through_httpx_is_answered_directly(served: tuple[Live, str, str]) -> None:
    """The SDK's client (httpx, its default headers, head and body written apart) commits
    without the app once the group is claimed."""
    service, topic, token = served
    path = f"/v1/vclusters/{VC}/groups/g-{uuid.uuid4().hex[:6]}/commit"
    headers = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=service.url, headers=headers, timeout=TIMEOUT_S) as client:
        assert client.post(path, content=commit_body(topic, 0)).status_code == 204
        seen = len(service.counting.requests)
        for shard in range(4):
            assert client.post(path, content=commit_body(topic, shard)).status_code == 204
        assert len(service.counting.requests) == seen, "a commit reached the app"
        [connection] = service.server.server_state.connections
        assert connection._direct_target[0] == path, "not parsed directly"


def test_a_plain_commit_head_is_parsed_directly() -> None:
    path = "/v1/vclusters/default/groups/g"
    start = len(direct()) - len(DIRECT_BODY)
    assert direct_head(direct()) == (f"{path}/commit", "Bearer xt_t", start, len(DIRECT_BODY))
    no_token = direct().replace(b"Authorization: Bearer xt_t\r\n", b"")
    assert direct_head(no_token) == (f"{path}/commit", None, start - 28, len(DIRECT_BODY))
    # Whether the body is all there, and nothing after it, is the protocol's to check.
    assert direct_head(direct()[:start]) == direct_head(direct())
    assert direct_head(direct(tail=b"GET / HTTP/1.1\r\n\r\n")) == direct_head(direct())


@pytest.mark.parametrize(
    "data",
    [
        direct(b"Connection: close\r\n"),  # framing and answers are httptools' and uvicorn's
        direct(b"Connection: keep-alive, Upgrade\r\n"),
        direct(b"Expect: 100-continue\r\n"),
        direct(b"Transfer-Encoding: chunked\r\n"),
        direct(b"Upgrade: websocket\r\n"),
        direct(b"X-Other: 1\r\n"),
        direct(b"Content-Length: 17\r\n"),  # repeated
        direct(b"Authorization: Bearer xt_u\r\n"),
        direct(b" folded\r\n"),
        direct(b"Accept : x\r\n"),  # a space before the colon
        direct(b"Accept: \x01\r\n"),
        direct(b"Accept: \xc3\xa9\r\n"),
        direct(b"Accept: a\nb\r\n"),  # a bare LF
        direct(b"Accept: a\rb\r\n"),
        direct().replace(b"Content-Length: 17", b"Content-Length: +17"),
        direct().replace(b"HTTP/1.1", b"HTTP/1.0"),
        direct().replace(b"/commit ", b"/commit?x=1 "),
        direct().replace(b"/g/", b"/%67/"),
        direct().replace(b"POST", b"post"),
        direct()[:40],
    ],
)
def test_anything_else_is_left_to_httptools(data: bytes) -> None:
    assert direct_head(data) is None


def test_requests_behind_a_waiting_commit_are_answered_after_it_in_order(
    served: tuple[Live, str, str],
) -> None:
    """A direct commit waits for its flush: a read and another commit sent behind it on the
    same connection are answered after it, in the order they were sent."""
    service, topic, token = served
    group = f"g-{uuid.uuid4().hex[:6]}"
    path = f"/v1/vclusters/{VC}/groups/{group}/commit"
    read = f"/v1/vclusters/{VC}/topics/{topic}/metadata"
    engine = service.app.state.services.runtime.store.engine
    buffer = service.app.state.groups.checkpoints.buffer
    with service.connect() as sock:
        assert request(sock, "POST", path, token, commit_body(topic, 0)).status == 204
        seen = len(service.counting.requests)
        with engine.connect() as blocker:
            transaction = blocker.begin()
            blocker.execute(
                sa.text("SELECT * FROM checkpoints WHERE group_name = :g FOR UPDATE"), {"g": group}
            )
            body = commit_body(topic, 0, offset=0)
            sock.sendall(
                (
                    f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n"
                ).encode()
                + body
            )
            deadline = time.monotonic() + TIMEOUT_S
            while buffer.in_flight == 0:  # the flight has taken the commit and waits on MySQL
                assert time.monotonic() < deadline, "the commit never reached a flush"
                time.sleep(0.01)
            later = commit_body(topic, 1)
            sock.sendall(
                f"GET {read} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\r\n".encode()
                + (
                    f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
                    f"Content-Length: {len(later)}\r\n\r\n"
                ).encode()
                + later
            )
            while not any(c._held for c in service.server.server_state.connections):
                assert time.monotonic() < deadline, "the later requests were never read"
                time.sleep(0.01)  # polls the condition; the held flush is the synchronisation
            sock.setblocking(False)
            with pytest.raises(BlockingIOError):
                sock.recv(1)  # nothing answered while the first commit's upsert waits
            sock.setblocking(True)
            transaction.rollback()
        first, second, third = read_responses(sock, 3)
        assert (first.status, second.status, third.status) == (204, 200, 204)
        assert json.loads(second.body)["topic"]["name"] == topic
        assert len(service.counting.requests) == seen, "a request reached the app"
    assert checkpoint_rows(service, group) == [(topic, 0, 0, 0), (topic, 0, 1, 0)]


def test_a_deleted_token_commits_no_more(served: tuple[Live, str, str]) -> None:
    """A token that committed on the hot path is refused there once deleted: its header's
    digest is remembered, never what it named."""
    service, topic, token = served
    group = f"g-{uuid.uuid4().hex[:6]}"
    path = f"/v1/vclusters/{VC}/groups/{group}/commit"
    with service.connect() as sock:
        assert request(sock, "POST", path, token, commit_body(topic, 0)).status == 204
        seen = len(service.counting.requests)
        assert request(sock, "POST", path, token, commit_body(topic, 1)).status == 204
        assert len(service.counting.requests) == seen, "the commit reached the app"
    with httpx.Client(
        base_url=service.url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30
    ) as admin:
        names = [t["name"] for t in admin.get("/v1/tokens").raise_for_status().json()["tokens"]]
        for name in names:
            if name.startswith("c-"):
                admin.delete(f"/v1/tokens/{name}").raise_for_status()
    with service.connect() as sock:
        refused = request(sock, "POST", path, token, commit_body(topic, 2))
        assert refused.status == 401
    assert checkpoint_rows(service, group) == [(topic, 0, 0, 0), (topic, 0, 1, 0)]


def test_a_connection_idle_after_a_direct_commit_is_closed_after_the_keep_alive(
    make_config: Callable[..., ServiceConfig],
) -> None:
    """Direct answers keep uvicorn's keep-alive timeout: a connection that sends nothing after
    one is closed by the service (and one still sending is not)."""
    with serving(make_config(keep_alive_s=1.0)) as (service, topic, token):
        group = f"g-{uuid.uuid4().hex[:6]}"
        path = f"/v1/vclusters/{VC}/groups/{group}/commit"
        with service.connect() as sock:
            assert request(sock, "POST", path, token, commit_body(topic, 0)).status == 204
            seen = len(service.counting.requests)
            for shard in range(3):
                assert request(sock, "POST", path, token, commit_body(topic, shard)).status == 204
            assert len(service.counting.requests) == seen, "a commit reached the app"
            assert sock.recv(1) == b"", "the service kept an idle connection open"


def test_a_commit_whose_body_comes_after_its_head_is_answered_directly(
    served: tuple[Live, str, str],
) -> None:
    """A client that writes the head, then the body (as httpx does) is answered without the
    app too; and a request pipelined right behind such a body goes to httptools with it."""
    service, topic, token = served
    group = f"g-{uuid.uuid4().hex[:6]}"
    path = f"/v1/vclusters/{VC}/groups/{group}/commit"
    read = f"/v1/vclusters/{VC}/topics/{topic}/metadata"
    body = commit_body(topic, 1)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    connections = service.server.server_state.connections
    with service.connect() as sock:
        assert request(sock, "POST", path, token, commit_body(topic, 0)).status == 204
        seen = len(service.counting.requests)
        for tail in (b"", f"GET {read} HTTP/1.1\r\nHost: x\r\n\r\n".encode()):
            sock.sendall(head + body[:5])
            deadline = time.monotonic() + TIMEOUT_S
            while not any(c._partial for c in connections):  # the head is in, the body not
                assert time.monotonic() < deadline, "the head was never read"
                time.sleep(0.01)  # polls the condition; the split is the synchronisation
            sock.sendall(body[5:] + tail)
            answers = read_responses(sock, 2 if tail else 1)
            assert [a.status for a in answers] == ([204, 401] if tail else [204])
        # the GET carried no token: the app's 401 (and the pipelined pair went through it)
        assert len(service.counting.requests) == seen + 1
    assert checkpoint_rows(service, group) == [(topic, 0, 0, 0), (topic, 0, 1, 0)]
