"""Northguard authentication: a broker started with a cluster secret serves credentials only.

Real broker processes, real sockets.  An unauthenticated connection, a
credential of another tenant's scope, an expired one and a tampered one are
each refused with ``unauthorized`` (at once: no hang); a proper credential
produces and consumes end to end through ``NorthguardBackend``.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from ng_harness import backend_for

from backends.northguard import credentials, protocol
from backends.northguard.backend import NorthguardBackend
from backends.northguard.client.blocking import request_blocking
from backends.northguard.credentials import ADMIN, ALL_TOPICS, READ, WRITE, sign, verify
from backends.northguard.launcher import NorthguardProcess, start_northguard_broker
from backends.northguard.protocol import MsgType
from xinfra.errors import Unauthorized
from xinfra.keyspace import shard_ranges
from xinfra.model import Record

SECRET = "n0rthguard-test-secret-0123456789"
KEY = SECRET.encode()
PREFIX_A = "xinfra.vca."
PREFIX_B = "xinfra.vcb."
RW = {READ, WRITE}


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NorthguardProcess]:
    process = start_northguard_broker(tmp_path_factory.mktemp("ng-auth") / "data", secret=SECRET)
    yield process
    process.stop()


@pytest.fixture
async def admin(secured: NorthguardProcess) -> AsyncIterator[NorthguardBackend]:
    """The metadata service's view: the backend holds the secret and signs admin credentials."""
    backend = backend_for(secured.url, **{credentials.SECRET_ATTRIBUTE: SECRET})
    yield backend
    await backend.close()


def raw_requests(address: str, *requests: dict[str, Any]) -> list[dict[str, Any]]:
    """Send requests on one plain socket; the answers in order (bounded: never hangs)."""
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"".join(protocol.encode_json(MsgType.REQUEST, i, r) for i, r in enumerate(requests, 1))
        )
        decoder = protocol.FrameDecoder()
        answers: dict[int, dict[str, Any]] = {}
        while len(answers) < len(requests):
            data = sock.recv(1 << 16)
            assert data, "the broker closed the connection"
            for item in decoder.feed(data):
                correlation, payload = protocol.decode_json(item.body)
                answers[correlation] = payload
    return [answers[i] for i in range(1, len(requests) + 1)]


def code_of(answer: dict[str, Any]) -> str | None:
    error = answer.get("error")
    return None if error is None else str(error["code"])


# -- the credential module ---------------------------------------------------------------------


def test_a_credential_verifies_under_its_secret_only_and_until_it_expires() -> None:
    token = sign(KEY, "vc:a", PREFIX_A, RW, ttl_s=60, now_s=1000)
    claims = verify(KEY, token, now_s=1001)
    assert claims.scope == PREFIX_A and claims.operations == RW
    claims.authorize(WRITE, PREFIX_A + "t.0.ab", now_s=1001)
    with pytest.raises(Unauthorized):
        claims.authorize(WRITE, PREFIX_B + "t.0.ab", now_s=1001)
    with pytest.raises(Unauthorized):
        claims.authorize(ADMIN, PREFIX_A + "t.0.ab", now_s=1001)
    with pytest.raises(Unauthorized, match="expired"):
        verify(KEY, token, now_s=1060)
    with pytest.raises(Unauthorized, match="signature"):
        verify(b"another-secret-of-32-bytes-long!", token, now_s=1001)
    head, body, mac = token.split(".")
    forged = sign(b"x" * 32, "vc:a", ALL_TOPICS, {ADMIN, READ, WRITE}, 60, now_s=1000)
    for tampered in (
        f"{head}.{forged.split('.')[1]}.{mac}",  # claims swapped, signature kept
        f"{head}.{body}.{mac[:-2]}AA",
        f"{head}.{body}",
        "",
        "x" * 10_000,
    ):
        with pytest.raises(Unauthorized):
            verify(KEY, tampered, now_s=1001)


# -- the broker --------------------------------------------------------------------------------


async def test_an_unauthenticated_connection_can_do_nothing_but_ping(
    secured: NorthguardProcess, admin: NorthguardBackend
) -> None:
    name = f"{PREFIX_A}victim.0.aa"
    await admin.create_topic(name, shard_ranges(1))
    started = time.monotonic()
    answers = raw_requests(
        secured.url,
        {"op": "ping"},
        {"op": "list_topics"},
        {"op": "topic_metadata", "name": name},
        {"op": "offset_for_timestamp", "name": name, "range_id": 0, "timestamp_ms": 0},
        {"op": "create_topic", "name": f"{PREFIX_A}lookalike", "count": 1},
        {"op": "seal_topic", "name": name},
        {"op": "delete_topic", "name": name},
        {"op": "split_range", "name": name, "range_id": 0},
        {"op": "no_such_op"},
    )
    assert time.monotonic() - started < 5
    assert code_of(answers[0]) is None
    assert [code_of(a) for a in answers[1:]] == ["unauthorized"] * 8
    # Streams: neither produce nor consume opens.
    host, _, port = secured.url.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            protocol.encode_json(
                MsgType.PRODUCE_OPEN, 1, {"topic": name, "range_id": 0, "producer_id": 1}
            )
            + protocol.encode_json(
                MsgType.CONSUME_OPEN,
                2,
                {"topic": name, "range_id": 0, "offset": 0, "window_bytes": 1024},
            )
        )
        decoder = protocol.FrameDecoder()
        frames: list[protocol.Frame] = []
        while len(frames) < 2:
            frames += decoder.feed(sock.recv(1 << 16))
    assert [f.type for f in frames] == [MsgType.STREAM_ERROR, MsgType.STREAM_ERROR]
    assert all(protocol.decode_json(f.body)[1]["error"]["code"] == "unauthorized" for f in frames)
    topic = await admin.describe_topic(name)  # untouched: not sealed, not deleted
    assert not topic.sealed
    assert "xinfra.vca.lookalike" not in await admin.list_topics()


async def test_a_credential_of_one_virtual_cluster_reaches_none_of_another(
    secured: NorthguardProcess, admin: NorthguardBackend
) -> None:
    theirs = f"{PREFIX_B}cards.0.bb"
    ours = f"{PREFIX_A}orders.0.aa"
    await admin.create_topic(theirs, shard_ranges(1))
    await admin.create_topic(ours, shard_ranges(1))
    token_a = sign(KEY, "vc:a", PREFIX_A, RW, ttl_s=300)
    auth = {"op": "authenticate", "credential": token_a}
    answers = raw_requests(
        secured.url,
        auth,
        {"op": "list_topics"},
        {"op": "topic_metadata", "name": theirs},
        {"op": "topic_metadata", "name": ours},
        {"op": "seal_topic", "name": theirs},
        {"op": "delete_topic", "name": theirs},
        {"op": "create_topic", "name": f"{PREFIX_A}mine", "count": 1},  # rw is not admin
    )
    assert code_of(answers[0]) is None
    listed = answers[1]["result"]["topics"]
    assert ours in listed and theirs not in listed
    assert all(t.startswith(PREFIX_A) for t in listed)
    assert code_of(answers[2]) == "unauthorized"
    assert code_of(answers[3]) is None
    assert [code_of(a) for a in answers[4:]] == ["unauthorized"] * 3

    client = backend_for(secured.url, **{credentials.AUTH_ATTRIBUTE: token_a})
    try:
        with pytest.raises(Unauthorized):
            client.producer(theirs)  # its metadata request is refused
        reader = client.reader(theirs)
        with pytest.raises(Unauthorized):
            await reader.end_offsets()
        await reader.close()
    finally:
        await client.close()
    assert not (await admin.describe_topic(theirs)).sealed


@pytest.mark.parametrize("kind", ["expired", "tampered", "other-secret"])
async def test_an_expired_or_tampered_credential_is_refused(
    secured: NorthguardProcess, admin: NorthguardBackend, kind: str
) -> None:
    name = f"{PREFIX_A}refused.0.aa"
    if name not in await admin.list_topics():
        await admin.create_topic(name, shard_ranges(1))
    if kind == "expired":
        token = sign(KEY, "vc:a", PREFIX_A, RW, ttl_s=10, now_s=time.time() - 60)
    elif kind == "tampered":
        good = sign(KEY, "vc:a", PREFIX_A, RW, ttl_s=300)
        wider = sign(b"z" * 32, "vc:a", ALL_TOPICS, {ADMIN, READ, WRITE}, ttl_s=300)
        token = ".".join((good.split(".")[0], wider.split(".")[1], good.split(".")[2]))
    else:
        token = sign(b"a-secret-this-broker-never-had!!", "vc:a", ALL_TOPICS, RW, ttl_s=300)
    answers = raw_requests(
        secured.url,
        {"op": "authenticate", "credential": token},
        {"op": "topic_metadata", "name": name},
        {"op": "delete_topic", "name": name},
    )
    assert [code_of(a) for a in answers] == ["unauthorized"] * 3
    with pytest.raises(Unauthorized):
        request_blocking(secured.url, "topic_metadata", 10, credential=token, name=name)


async def test_a_proper_credential_produces_and_consumes_end_to_end(
    secured: NorthguardProcess, admin: NorthguardBackend
) -> None:
    name = f"{PREFIX_A}e2e.0.aa"
    await admin.create_topic(name, shard_ranges(2))
    client = backend_for(
        secured.url, **{credentials.AUTH_ATTRIBUTE: sign(KEY, "vc:a", PREFIX_A, RW, ttl_s=300)}
    )
    try:
        producer = client.producer(name)
        offsets = await producer.send(1, [Record(b"v%d" % i, key=b"k") for i in range(5)])
        assert offsets == [0, 1, 2, 3, 4]
        reader = client.reader(name)
        reader.assign({1: 0})
        got: list[bytes | None] = []
        deadline = time.monotonic() + 30
        while len(got) < 5 and time.monotonic() < deadline:
            got += [r.value for r in await reader.poll(timeout_s=1.0)]
        assert got == [b"v%d" % i for i in range(5)]
        await reader.close()
        await producer.close()
    finally:
        await client.close()


async def test_an_expired_connection_credential_is_renewed_from_the_source(
    secured: NorthguardProcess, admin: NorthguardBackend
) -> None:
    """A client whose credential expired (refused: ``unauthorized``) re-authenticates with the
    newer one its metadata brought (``update_credential``) and goes on, on the same connection."""
    name = f"{PREFIX_A}renew.0.aa"
    await admin.create_topic(name, shard_ranges(1))
    short = sign(KEY, "vc:a", PREFIX_A, RW, ttl_s=2)
    client = backend_for(secured.url, **{credentials.AUTH_ATTRIBUTE: short})
    try:
        assert (await client.describe_topic(name)).name == name
        await asyncio.sleep(2.2)
        with pytest.raises(Unauthorized, match="expired"):
            await client.describe_topic(name)
        client.update_credential(sign(KEY, "vc:a", PREFIX_A, RW, ttl_s=300))
        assert (await client.describe_topic(name)).name == name
    finally:
        await client.close()


def test_a_broker_without_a_secret_warns_loudly(tmp_path: Path) -> None:
    process = start_northguard_broker(tmp_path / "data")
    try:
        assert code_of(raw_requests(process.url, {"op": "list_topics"})[0]) is None
    finally:
        process.stop()
    assert "STARTED WITHOUT A SECRET" in process.log_path.read_text()


def test_a_placeholder_secret_is_refused_like_a_short_one() -> None:
    for placeholder in (b"change-me-northguard-secret", b"PLACEHOLDER-0123456789abcdef"):
        with pytest.raises(ValueError, match="placeholder"):
            credentials.check_secret(placeholder)
    assert credentials.check_secret(b"q8Zr1v0x4lT2m9pWc7Ys3b==") == b"q8Zr1v0x4lT2m9pWc7Ys3b=="
