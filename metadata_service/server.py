"""Run an app under uvicorn so that a SIGTERM first answers the requests that wait for settles.

uvicorn waits up to its graceful timeout for in-flight requests, then cancels
them (the caller gets a 500).  A request that waits for a seal's settle can
wait longer than that, so on the signal the settle service answers those
requests at once with the pending state (202); the settles themselves are
durable and resume at the next start (``metadata_service.settle``).

The HTTP protocol is uvicorn's (httptools when installed, else h11) with bounds uvicorn lacks: a
connection beyond ``connections_max`` is closed as it is accepted, and a
connection that has not sent a whole request head ``header_timeout_s`` after
it opened (or after the first byte of a later head) is closed, so that
connections that never finish their headers cannot pile up; httptools' heads
are bounded to ``header_bytes_max`` here, h11's by uvicorn.  uvicorn's own
``limit_concurrency`` (503 past it), ``timeout_keep_alive`` and
``h11_max_incomplete_event_size`` (the largest head) are set from the same
``ServiceConfig``.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import importlib.util
import re
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import (
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)
from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string

from metadata_service.config import ServiceConfig
from metadata_service.hot_routes import NO_CONTENT, HotRequest, HotRoutes
from metadata_service.hot_routes import Reply as HotReply

STARTUP_FAILURE = 3
"""uvicorn's exit code when the app fails to start."""


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._on_exit()
        super().handle_exit(sig, frame)


class _HeadTimer:
    """The request-head timer both guarded protocols share: armed when a head may begin,
    disarmed when it ends; firing closes a connection still inside its head.

    One timer per connection, not per request: disarming only forgets when the head began,
    and a timer that fires for a head that has ended since, or began later, goes away or
    waits for that later head's deadline.  (A timer created and cancelled on every request
    was a few percent of a hot commit's cost.)"""

    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    header_timeout_s: float
    _head_timer: asyncio.TimerHandle | None
    _head_since: float | None
    """Loop time at which the head in progress began; None between heads."""

    def _in_head_now(self) -> bool:
        raise NotImplementedError

    def _arm(self) -> None:
        if self._head_since is None:
            self._head_since = self.loop.time()
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timeout)

    def _disarm(self) -> None:
        self._head_since = None

    def _drop_head_timer(self) -> None:
        self._head_since = None
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        since = self._head_since
        if since is None or self.transport.is_closing():
            return  # no head in progress: the next one arms a timer again
        left = since + self.header_timeout_s - self.loop.time()
        if left > 0:  # a later head than the one this timer was set for
            self._head_timer = self.loop.call_later(left, self._head_timeout)
        elif self._in_head_now():
            self.transport.close()


class GuardedH11Protocol(_HeadTimer, H11Protocol):
    """uvicorn's h11 protocol with a connection limit and a request-head timeout (h11 bounds
    the head's size itself: ``h11_max_incomplete_event_size``)."""

    connections_max: int = 1000
    header_timeout_s: float = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_since: float | None = None
        super().connection_made(transport)
        if len(self.connections) > self.connections_max:
            transport.close()  # connection_lost forgets it
            return
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._arm()  # a head has begun (or not even that): it must end in time
        else:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._drop_head_timer()
        super().connection_lost(exc)

    def _in_head_now(self) -> bool:
        return bool(self.conn.their_state is h11.IDLE)


_DIRECT_HEADERS = frozenset(
    (
        b"host",
        b"authorization",
        b"content-type",
        b"content-length",
        b"user-agent",
        b"accept",
        b"accept-encoding",
        b"connection",
    )
)
"""The header names a directly parsed commit may carry (httpx's, the SDK's client, among them):
none changes how HTTP frames or answers it (no ``expect``, ``transfer-encoding``, ``upgrade``;
``connection`` only as ``keep-alive``, HTTP/1.1's default; nothing here compresses answers),
so its bytes mean the same to this parser as to httptools."""
_NOT_PLAIN = re.compile(rb"[^\t\r\n\x20-\x7e]")
"""A byte a direct head may not hold (controls, DEL, anything not ASCII): httptools' call."""


def direct_head(data: bytes) -> tuple[str, str | None, int, int] | None:
    """(path, authorization, where the body begins, its Content-Length) when ``data`` begins
    with the whole head of a ``POST`` of HTTP/1.1 with a Content-Length, no query string,
    percent sign or odd byte in its target, and only ``_DIRECT_HEADERS``, each once; None for
    anything else (httptools then parses it).  Whether the body is all there is the caller's.

    A committer's request arrives whole in one read (or its head, then its body): parsed
    here it costs a few splits, where httptools' callbacks and uvicorn's request cycle (its
    scope, its event, its keep-alive timer) were about a third of a hot commit's CPU."""
    if not data.startswith(b"POST /"):
        return None
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return None
    head = data[:end]
    crlf = head.count(b"\r\n")
    if head.count(b"\r") != crlf or head.count(b"\n") != crlf or _NOT_PLAIN.search(head):
        return None  # a bare CR or LF, a control or a non-ASCII byte: httptools decides
    lines = head.split(b"\r\n")
    line = lines[0]
    if not line.endswith(b" HTTP/1.1"):
        return None
    target = line[5:-9]
    if b" " in target or b"?" in target or b"%" in target or b"#" in target:
        return None
    authorization: bytes | None = None
    length: bytes | None = None
    seen: set[bytes] = set()
    for header in lines[1:]:
        name, colon, value = header.partition(b":")
        name = name.lower()
        if not colon or name not in _DIRECT_HEADERS or name in seen:
            return None  # unknown, repeated, folded (leading space) or without a colon
        seen.add(name)
        if name == b"authorization":
            authorization = value.strip(b" \t")
        elif name == b"content-length":
            length = value.strip(b" \t")
        elif name == b"connection" and value.strip(b" \t").lower() != b"keep-alive":
            return None  # close, upgrade: httptools and uvicorn's
    if length is None or not length.isdigit():
        return None
    return (
        target.decode("ascii"),
        None if authorization is None else authorization.decode("ascii"),
        end + 4,
        int(length),
    )


class GuardedHttpToolsProtocol(_HeadTimer, HttpToolsProtocol):
    """uvicorn's httptools protocol with a connection limit, a request-head timeout and a bound
    on the head's size (httptools has none of its own), which asks ``hot_routes`` to answer a
    request before it starts the ASGI app for it (``metadata_service.hot_routes``).

    A commit that arrives between requests (whole, or its head then its body) is parsed here
    (``direct_head``) and answered without httptools or a request cycle when
    ``HotRoutes.commit_direct`` takes it; bytes that arrive while it waits for its flush wait
    for its answer (reading paused), so answers keep the order of requests.

    A hot request is taken at its head only when uvicorn would start its app at once (no
    request of the connection in progress, no 503 for concurrency, writes not paused), and
    answered at the end of its body, or handed to the app then as uvicorn would have: its
    request cycle, body included, is the one uvicorn built.  Its reply is written as uvicorn
    writes one (its default headers, ``connection: close`` when not keeping alive) and ends
    the cycle the same way (access-logged as uvicorn logs it), so keep-alive, pipelining
    and graceful shutdown are unchanged.
    """

    connections_max: int = 1000
    header_timeout_s: float = 10.0
    header_bytes_max: int = 16 << 10
    hot_routes: HotRoutes | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_since: float | None = None
        self._in_head = True
        self._head_bytes = 0
        self._hot: tuple[RequestResponseCycle, Any, HotRequest] | None = None
        self._between = True
        """No byte of a request parsed since the last one ended: a direct commit may begin."""
        self._direct = False
        """A direct commit waits for its answer."""
        self._direct_path = ""
        self._direct_close = False
        """Close the connection once the direct commit is answered (a graceful shutdown)."""
        self._direct_head = b"\0"
        """The whole head (blank line included) of the last direct commit parsed on this
        connection, with its Content-Length and target: a client sends the same head each
        time, and a request that begins with it is parsed already (its Content-Length is in
        the bytes compared)."""
        self._direct_length = 0
        self._direct_target: tuple[str, str | None] = ("", None)
        self._held: list[bytes] = []
        """Bytes that came while a direct commit waited, fed on once it is answered."""
        self._partial = b""
        """A direct commit's whole head and the start of its body, until the rest comes."""
        self._idle_since: float | None = None
        """Loop time of the last direct answer while no byte came since; None otherwise."""
        self._idle_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        if len(self.connections) > self.connections_max:
            transport.close()
            return
        self._arm()

    def data_received(self, data: bytes) -> None:
        self._idle_since = None
        if self._direct:  # answers keep the order of requests: this waits for the commit's
            self._held.append(data)
            self.flow.pause_reading()
            return
        if self._partial:  # the rest of a direct commit's body (or more)
            data, self._partial = self._partial + data, b""
        if self._between and self._take_direct(data):
            return
        self._parse(data)

    def _parse(self, data: bytes) -> None:
        """Feed ``data`` to httptools (uvicorn's ``data_received``), the head's size bounded."""
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._in_head and self._head_bytes > self.header_bytes_max:
            self.transport.close()  # still no end of the head after this many bytes

    def on_message_begin(self) -> None:
        self._between = False
        self._in_head = True
        self._head_bytes = 0
        self._arm()
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._drop_head_timer()
        self._hot = None
        self._direct = False
        self._held = []
        self._partial = b""
        self._idle_since = None
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        super().connection_lost(exc)

    def shutdown(self) -> None:
        if self._partial:  # a request whose body is coming: uvicorn's to finish, then close
            data, self._partial = self._partial, b""
            self._parse(data)
        if self._direct:
            self._direct_close = True  # answered first, then closed
        else:
            super().shutdown()

    def _take_direct(self, data: bytes) -> bool:
        """Answer ``data`` as a direct commit (``direct_head``) if it is one the hot routes take,
        when uvicorn would start a request at once, or keep it until its body is all here;
        False: nothing done."""
        hot = self.hot_routes
        if (
            hot is None
            or (self.cycle is not None and not self.cycle.response_complete)
            or self.pipeline
            or self.flow.write_paused
            or self.transport.is_closing()
            or (
                self.limit_concurrency is not None
                and max(len(self.connections), len(self.tasks)) >= self.limit_concurrency
            )
        ):
            return False
        head = self._direct_head
        if data.startswith(head):  # the head of the last one, byte for byte
            path, authorization = self._direct_target
            start, length = len(head), self._direct_length
        else:
            parsed = direct_head(data)
            if parsed is None or parsed[2] > self.header_bytes_max:
                return False
            path, authorization, start, length = parsed
            self._direct_head = data[:start]
            self._direct_length = length
            self._direct_target = (path, authorization)
        if len(data) != start + length:
            if len(data) > start + length or length > hot.body_bytes_max:
                return False  # a request pipelined behind it, or a body not answered here
            if hot.tokens.authenticate_cached(authorization) is None:
                return False  # no body kept for a caller without a known token (the gate's)
            # Its body comes next (a client may write the head, then the body): kept until
            # it is all here, httptools fed nothing yet (and fed it all if it is not taken).
            self._partial = data
            self._disarm()  # its head has ended
            self._unset_keepalive_if_required()
            return True
        body = data[start:]
        self._unset_keepalive_if_required()
        self._direct, self._direct_path = True, path
        taken = False
        try:  # answered at the earliest by the flush's callback, never inside this call
            taken = hot.commit_direct(path, authorization, body, self._direct_reply)
        finally:
            self._direct = taken
        if taken:
            self._disarm()  # its head has ended
        return taken

    def _direct_reply(self, reply: HotReply) -> None:
        """Write a direct commit's ``reply`` as ``_hot_reply`` writes one, then go on with what
        came meanwhile."""
        if not self._direct:
            return  # the connection was lost
        self._direct = False
        if self.access_log:
            self.access_logger.info(
                '%s - "POST %s HTTP/1.1" %d',
                "{}:{}".format(*self.client) if self.client else "",  # as get_client_addr
                self._direct_path,
                reply.status,
            )
        self.transport.write(_reply_bytes(reply, self.server_state.default_headers, True))
        self.server_state.total_requests += 1
        if self._direct_close:
            self.transport.close()
            return
        held, self._held = self._held, []
        if held:
            self.flow.resume_reading()
            self.data_received(b"".join(held))
            return
        # Idle from now: closed after the keep-alive timeout unless a byte comes first, by one
        # timer per connection (uvicorn's, created and cancelled per request, was ~2 us of a
        # direct commit's CPU).
        self._idle_since = self.loop.time()
        if self._idle_timer is None:
            self._idle_timer = self.loop.call_later(self.timeout_keep_alive, self._idle_timeout)

    def _idle_timeout(self) -> None:
        self._idle_timer = None
        since = self._idle_since
        if since is None or self.transport.is_closing():
            return  # not idle (a byte came since): the next direct answer arms one again
        left = since + self.timeout_keep_alive - self.loop.time()
        if left > 0:  # idle again since a later answer
            self._idle_timer = self.loop.call_later(left, self._idle_timeout)
        else:
            self.transport.close()

    def _in_head_now(self) -> bool:
        return self._in_head

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        hot = self.hot_routes
        # cycle.more_body: called from the head, not for a pipelined request whose body is in;
        # a client waiting for "100 Continue" before its body gets it from the app's receive.
        if (
            hot is not None
            and app is self.app
            and cycle.more_body
            and not cycle.waiting_for_100_continue
            and not self.flow.write_paused
        ):
            request = hot.begin(cycle.scope)
            if request is not None:
                self._hot = (cycle, app, request)
                return  # answered at the end of the body (on_message_complete)
        super()._start_asgi_task(cycle, app)

    def on_message_complete(self) -> None:
        self._between = True
        super().on_message_complete()
        taken, self._hot = self._hot, None
        if taken is None:
            return
        cycle, app, request = taken
        assert self.hot_routes is not None and cycle is self.cycle
        body = bytes(cycle.body)
        if self.hot_routes.finish(request, body, functools.partial(self._hot_reply, cycle)):
            cycle.body = bytearray()
        else:
            super()._start_asgi_task(cycle, app)

    def _hot_reply(self, cycle: RequestResponseCycle, reply: HotReply) -> None:
        """Write ``reply`` as ``RequestResponseCycle.send`` would, and end the cycle."""
        if cycle.disconnected or cycle.response_complete:
            return
        cycle.response_started = True
        if cycle.access_log:
            cycle.access_logger.info(
                '%s - "%s %s HTTP/%s" %d',
                get_client_addr(cycle.scope),
                cycle.scope["method"],
                get_path_with_query_string(cycle.scope),
                cycle.scope["http_version"],
                reply.status,
            )
        cycle.transport.write(_reply_bytes(reply, cycle.default_headers, cycle.keep_alive))
        cycle.response_complete = True
        cycle.message_event.set()
        if not cycle.keep_alive:
            cycle.transport.close()
        cycle.on_response()


_no_content: tuple[list[tuple[bytes, bytes]], bytes] = ([], b"")
"""uvicorn's default headers (a new list each second: its ``date``) and the bytes of
``NO_CONTENT`` kept alive with them."""


def _reply_bytes(
    reply: HotReply, default_headers: list[tuple[bytes, bytes]], keep_alive: bool
) -> bytes:
    """The bytes of ``reply`` with uvicorn's default headers.  Those of a durable commit's
    answer (the same for every commit of a second) are built once: building them per
    commit was a tenth of the commit's cost on the hot route."""
    global _no_content
    cacheable = reply is NO_CONTENT and keep_alive
    if cacheable and _no_content[0] is default_headers:
        return _no_content[1]
    content = [STATUS_LINE[reply.status]]
    for name, value in (*default_headers, *reply.headers):
        content.extend((name, b": ", value, b"\r\n"))
    if not keep_alive:
        content.append(b"connection: close\r\n")
    content.append(b"\r\n")
    content.append(reply.body)
    data = b"".join(content)
    if cacheable:
        _no_content = (default_headers, data)
    return data


def uvicorn_config(
    app: FastAPI, host: str, port: int, http: str = "auto", **options: Any
) -> uvicorn.Config:
    """The ``uvicorn.Config`` of an app made by ``create_app``, bounded by its ``ServiceConfig``.

    ``http`` is ``auto`` (httptools when installed, as uvicorn picks), ``httptools`` or
    ``h11``, each guarded; ``options`` are ``uvicorn.Config``'s and override the bounds.
    """
    config: ServiceConfig = app.state.config
    if http == "auto":
        http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    if http not in ("h11", "httptools"):
        raise ValueError(f"http={http!r}: use auto, h11 or httptools")
    base: type[Any] = GuardedHttpToolsProtocol if http == "httptools" else GuardedH11Protocol
    protocol = type(
        base.__name__,
        (base,),
        {
            "connections_max": config.connections_max,
            "header_timeout_s": config.header_timeout_s,
            "header_bytes_max": config.header_bytes_max,
            "hot_routes": getattr(app.state, "hot_routes", None),
        },
    )
    bounded: dict[str, Any] = {
        "http": protocol,
        # Requests in flight; +1: connections are capped by the protocol at connections_max,
        # and uvicorn counts those too (it would refuse every request at a full house).
        "limit_concurrency": config.connections_max + 1,
        "timeout_keep_alive": config.keep_alive_s,
        "h11_max_incomplete_event_size": config.header_bytes_max,
    }
    return uvicorn.Config(app, host=host, port=port, **{**bounded, **options})


SWITCH_INTERVAL_S = 0.0005
"""How long a thread that wants the GIL waits before the holder must hand it over (CPython:
5 ms).  Store calls run on worker threads (``Runtime.db``) doing Python work (the driver,
rows, models) while the event loop serves cached reads and commits: each time the loop
comes back from a socket wait it needs the GIL again, and waited up to the whole interval
for it, so one batch of cold reads held every request of the loop back by 5 ms, often
several times (the convoy showed in py-spy as the loop's time in ``Condition.notify``
and in socket writes)."""


def prepare_process(app: FastAPI) -> None:
    """Prepare a process that is the service's own for ``app`` (``serve`` calls it).

    The store's pool, and the checkpoint upserts' own, are opened in full
    (``MetadataStore.open_pool``, ``CheckpointStore.open_pool``) before any request:
    each new PyMySQL connection holds the GIL ~27 ms building a TLS context, and the pool
    grew under the first load (token lookups and cold reads at once), 16 such stalls.
    Its heap as built so far (modules, routes, schemas: the bulk of every object it will
    ever hold) moves to the collector's permanent generation.  Otherwise each full
    collection rescans it all, and on a busy instance those ran every few seconds, each
    stopping every request for 50-70 ms (measured under ``bench/metadata_service.py``).
    And the GIL's switch interval is ``SWITCH_INTERVAL_S``: under the mixed read load of
    that bench (10% misses), loop stalls over 5 ms fell from ~10 to ~6 a second (--quick,
    loop-lag probe, noisy shared 2-core machine).
    """
    config: ServiceConfig = app.state.config
    app.state.services.runtime.store.open_pool(config.db_pool_size)
    app.state.groups.checkpoints.store.open_pool()
    gc.collect()
    gc.freeze()
    sys.setswitchinterval(SWITCH_INTERVAL_S)


def serve(app: FastAPI, host: str, port: int, **options: Any) -> None:
    """``uvicorn.run`` for one app made by ``create_app`` (``options`` are ``uvicorn.Config``'s),
    in a process prepared for it (``prepare_process``)."""
    prepare_process(app)
    server = _Server(
        uvicorn_config(app, host, port, **options),
        app.state.services.begin_shutdown,
    )
    server.run()
    if not server.started:
        sys.exit(STARTUP_FAILURE)
