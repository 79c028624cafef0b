"""The two requests clients send most, answered from the HTTP protocol without the ASGI stack.

Every client reads topic metadata (``GET /v1/vclusters/{vc}/topics/{topic}/metadata``)
and every consumer commits positions (``POST /v1/vclusters/{vc}/groups/{group}/commit``)
every few seconds.  Through ASGI each such request pays for a task, uvicorn's
request cycle and six middleware layers (FastAPI's, Starlette's, the proxy
headers', ours) before it reaches a cache or the checkpoint buffer: ~100 us
of CPU for a commit whose own work (token check, validation, buffer) is
~20 us.  ``metadata_service.server``'s httptools protocol asks ``HotRoutes``
first, and answers here only what needs no waiting except for the flush:

* ``begin`` (request head complete): the path is one of the two, without a
  query string, with valid names; the bearer token is known without a store
  read (``TokenService.authenticate_cached``) and may read the virtual
  cluster; a commit declares a Content-Length of at most ``body_bytes_max``.
  So no body is buffered here for a caller without a token (the gate's promise).
* ``finish`` (body complete): a read is answered from the cache
  (``metadata_body_now``) or, on a miss, once the store read that
  ``TopicService.metadata_body`` batches with the others returns, with its
  errors as the router's problem+json (the fast-path middleware does the same
  under ASGI); a commit's body passes the router's ``CommitIn``, and its checks pass on
  what this instance holds (``GroupCoordinator.commit_now``): it joins the
  coalescing buffer and is answered 204 when the flush that holds it is
  durable in MySQL, or with the problem+json of the flush's error; the commits of one
  flush are answered in one pass when it ends (one callback, their latencies counted
  together, the 204's bytes built once a second by the protocol).

A commit the protocol parsed itself, head and body (``server.direct_head``: a plain
request of a committer, most of them), comes whole to ``commit_direct``, which checks it as
``begin`` and ``finish`` do and answers it the same way, without httptools' callbacks or
uvicorn's request cycle.

Anything else, at either step, goes on through ASGI unchanged (the fast path
middleware, the gate, the routers), which answers it, errors included: every
check here is one the ASGI route makes too, so a request is never refused
here that the routers would take, nor taken that they would refuse.  The
request counter and latency histogram are kept as ``MetricsMiddleware``
keeps them, by route template.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from metadata_service.auth import Principal, TokenService
from metadata_service.groups import Groups
from metadata_service.groups.schemas import CommitIn
from metadata_service.metrics import ServiceMetrics
from metadata_service.problems import error_response, problem
from metadata_service.topics import TopicService
from xinfra.errors import Unavailable, XinfraError
from xinfra.names import NAME_PATTERN

log = logging.getLogger(__name__)

BODY_BYTES_MAX = 64 << 10
"""The largest commit body answered here (a commit of ~1000 positions); larger ones go through
ASGI, whose bound is ``request_bytes_max``."""

READ_TEMPLATE = "/v1/vclusters/{vc}/topics/{topic}/metadata"
COMMIT_TEMPLATE = "/v1/vclusters/{vc}/groups/{group}/commit"
_NAME = "(" + NAME_PATTERN.removeprefix("^").removesuffix("$") + ")"
"""A name as the routers take it, inside a path (one match a request, names included)."""
_READ_PATH = re.compile(f"/v1/vclusters/{_NAME}/topics/{_NAME}/metadata")
_COMMIT_PATH = re.compile(f"/v1/vclusters/{_NAME}/groups/{_NAME}/commit")


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


Respond = Callable[[Reply], None]

NO_CONTENT = Reply(204, [], b"")
"""A durable commit's answer: one object, so the protocol writes its bytes from a cache."""


@dataclass(frozen=True, slots=True)
class HotRequest:
    commit: bool
    vc: str
    name: str
    path: str
    principal: Principal
    start: float


def _metadata_reply(version: int, document: bytes) -> Reply:
    return Reply(
        200,
        [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(document)).encode()),
            (b"etag", f'"{version}"'.encode()),
        ],
        document,
    )


def _error_of(future: asyncio.Future[Any]) -> BaseException | None:
    if future.cancelled():
        return Unavailable("the service stopped before the request was answered")
    return future.exception()


def _problem_reply(error: BaseException, method: str, path: str) -> Reply:
    """The problem+json the app's handlers write for ``error`` (``metadata_service.problems``)."""
    if isinstance(error, XinfraError):
        response = error_response(error, path)
    else:
        log.error("unexpected error serving %s %s", method, path, exc_info=error)
        response = problem(
            500,
            "internal",
            "Internal error",
            f"unexpected {type(error).__name__}; see the service log",
            path,
        )
    return Reply(response.status_code, list(response.raw_headers), bytes(response.body))


class HotRoutes:
    """Event-loop only (the protocol calls it from its callbacks)."""

    def __init__(
        self,
        topics: TopicService,
        tokens: TokenService,
        groups: Groups,
        metrics: ServiceMetrics,
        body_bytes_max: int = BODY_BYTES_MAX,
    ) -> None:
        self.topics = topics
        self.tokens = tokens
        self.groups = groups
        self.metrics = metrics
        self.body_bytes_max = body_bytes_max
        self._reading: set[asyncio.Future[tuple[int, bytes]]] = set()
        """Store reads of misses in flight (the loop keeps only weak references to tasks)."""
        self._acks: dict[asyncio.Future[None], list[tuple[HotRequest, Respond]]] = {}
        """Commits waiting for each flush in flight, answered together when it ends."""

    def begin(self, scope: Any) -> HotRequest | None:
        """A request this may answer, from its head (``scope`` as uvicorn built it); None: ASGI."""
        if scope["query_string"]:
            return None
        method = scope["method"]
        if method not in ("GET", "POST"):
            return None
        authorization = None
        declared = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value.decode("latin-1")
            elif name == b"content-length":
                declared = value
        commit = method == "POST"
        if commit and not (declared.isdigit() and int(declared) <= self.body_bytes_max):
            return None
        return self._request(commit, scope["path"], authorization)

    def commit_direct(
        self, path: str, authorization: str | None, body: bytes, respond: Respond
    ) -> bool:
        """A whole commit request the protocol parsed itself (``server.direct_head``), answered
        as ``begin`` then ``finish`` answer one; False, with no side effect, when they would
        leave it to ASGI (the protocol then feeds it to its parser as it came)."""
        if len(body) > self.body_bytes_max:
            return False
        request = self._request(True, path, authorization)
        return request is not None and self._commit(request, body, respond)

    def _request(self, commit: bool, path: str, authorization: str | None) -> HotRequest | None:
        """The request of ``path`` (a commit's or a read's), when its token is known without a
        store read and may read the virtual cluster; None: ASGI answers it."""
        match = (_COMMIT_PATH if commit else _READ_PATH).fullmatch(path)
        if match is None:
            return None
        principal = self.tokens.authenticate_cached(authorization)
        if principal is None or not principal.can_read(match[1]):
            return None
        return HotRequest(commit, match[1], match[2], path, principal, time.perf_counter())

    def finish(self, request: HotRequest, body: bytes, respond: Respond) -> bool:
        """Answer ``request`` through ``respond`` (now or once durable); False: ASGI answers."""
        if request.commit:
            return self._commit(request, body, respond)
        answer = self.topics.metadata_body_now(request.vc, request.name)
        if answer is not None:
            reply = _metadata_reply(*answer)
            self._done(request, READ_TEMPLATE, "GET", reply)
            respond(reply)
            return True
        # A miss: the store read (batched with the others, ``MetadataReader``) in a task kept
        # here until it answers; its errors are the route's problem+json.
        reading = asyncio.ensure_future(self.topics.metadata_body(request.vc, request.name))
        self._reading.add(reading)

        def read(future: asyncio.Future[tuple[int, bytes]]) -> None:
            self._reading.discard(future)
            error = _error_of(future)
            reply = (
                _metadata_reply(*future.result())
                if error is None
                else _problem_reply(error, "GET", request.path)
            )
            self._done(request, READ_TEMPLATE, "GET", reply)
            respond(reply)

        reading.add_done_callback(read)
        return True

    def _commit(self, request: HotRequest, body: bytes, respond: Respond) -> bool:
        try:
            commit = CommitIn.model_validate_json(body)
        except ValidationError:
            return False  # the router's 422, described as it describes it
        durable = self.groups.coordinator.commit_now(
            request.vc,
            request.name,
            commit.member_id,
            commit.member_epoch,
            [(p.topic, p.epoch, p.shard, p.offset) for p in commit.positions],
        )
        if durable is None:
            return False
        waiting = self._acks.get(durable)
        if waiting is None:  # the first commit of this flush: one callback answers them all
            waiting = self._acks[durable] = []
            durable.add_done_callback(self._flushed)
        waiting.append((request, respond))
        return True

    def _flushed(self, future: asyncio.Future[None]) -> None:
        """Answer every commit the flush held, in the order they came: 204 once it is durable,
        each its own problem+json (its path is its ``instance``) if not."""
        waiting = self._acks.pop(future)
        error = _error_of(future)
        now = time.perf_counter()
        if error is None:
            self.metrics.requests_done(
                "POST", COMMIT_TEMPLATE, 204, [now - request.start for request, _ in waiting]
            )
            for _, respond in waiting:
                respond(NO_CONTENT)
            return
        for request, respond in waiting:
            reply = _problem_reply(error, "POST", request.path)
            self._done(request, COMMIT_TEMPLATE, "POST", reply)
            respond(reply)

    def _done(self, request: HotRequest, template: str, method: str, reply: Reply) -> None:
        self.metrics.request_done(
            method, template, reply.status, time.perf_counter() - request.start
        )
