"""TLS on Northguard's client port: a broker with a certificate speaks TLS only.

Real broker processes, real sockets.  A client with the cluster's CA
produces and consumes end to end (async connections and the blocking
one-off request); a client trusting another CA, a plaintext client of a TLS
broker and a TLS client of a plaintext broker each fail at once with a
``BackendUnavailable`` naming TLS, well within the request timeout; the
hostname is checked unless the cluster says not to; credentials still work
over TLS.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from ipaddress import IPv4Address
from pathlib import Path

import pytest
from cryptography import x509
from ng_harness import backend_for
from typer.testing import CliRunner

from backends.northguard import cli, credentials, tls
from backends.northguard.backend import NorthguardBackend
from backends.northguard.client.blocking import request_blocking
from backends.northguard.launcher import NorthguardProcess, start_northguard_broker
from backends.northguard.tls import CertificateFiles, make_test_certificates
from xinfra.errors import BackendUnavailable, InvalidRequest, Unauthorized
from xinfra.keyspace import shard_ranges
from xinfra.model import Record

SECRET = "n0rthguard-tls-test-secret-0123456"
TIMEOUT_S = 5.0
"""Request timeout of the clients here; every failure must come well before it."""
FAST_S = 3.0


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> CertificateFiles:
    return make_test_certificates(tmp_path_factory.mktemp("ng-tls-certs"))


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> CertificateFiles:
    """A second, unrelated CA: a client trusting it must refuse the broker."""
    return make_test_certificates(tmp_path_factory.mktemp("ng-tls-other"))


@pytest.fixture(scope="module")
def tls_broker(
    tmp_path_factory: pytest.TempPathFactory, certificates: CertificateFiles
) -> Iterator[NorthguardProcess]:
    process = start_northguard_broker(tmp_path_factory.mktemp("ng-tls") / "data", tls=certificates)
    yield process
    process.stop()


def tls_attributes(ca: Path, **more: str) -> dict[str, str]:
    return {
        tls.TLS_ATTRIBUTE: "true",
        tls.CA_ATTRIBUTE: str(ca),
        "request_timeout_s": str(TIMEOUT_S),
        **more,
    }


@pytest.fixture
async def tls_client(
    tls_broker: NorthguardProcess, certificates: CertificateFiles
) -> AsyncIterator[NorthguardBackend]:
    backend = backend_for(tls_broker.url, **tls_attributes(certificates.ca))
    yield backend
    await backend.close()


def value(i: int, size: int) -> bytes:
    return (b"v%d:" % i).ljust(size, b"x")


async def produce_and_consume(
    backend: NorthguardBackend, name: str, count: int = 20, size: int = 16
) -> None:
    """Create ``name``, produce ``count`` records of ``size`` bytes to shard 1 (in sends of
    500), read them back in order (bounded wait)."""
    await backend.create_topic(name, shard_ranges(2))
    producer = backend.producer(name)
    sends = [
        producer.send(1, [Record(value(i, size), key=b"k") for i in range(first, last)])
        for first, last in ((n, min(n + 500, count)) for n in range(0, count, 500))
    ]
    offsets = [offset for chunk in await asyncio.gather(*sends) for offset in chunk]
    assert offsets == list(range(count))
    reader = backend.reader(name)
    reader.assign({1: 0})
    got: list[bytes | None] = []
    deadline = time.monotonic() + 30
    while len(got) < count and time.monotonic() < deadline:
        got += [r.value for r in await reader.poll(timeout_s=1.0)]
    assert got == [value(i, size) for i in range(count)]
    await reader.close()
    await producer.close()


# -- certificates and contexts ------------------------------------------------------------------


def test_test_certificates_name_the_loopback_addresses_and_keep_the_key_private(
    certificates: CertificateFiles,
) -> None:
    cert = x509.load_pem_x509_certificate(certificates.cert.read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert IPv4Address("127.0.0.1") in names.get_values_for_type(x509.IPAddress)
    assert "localhost" in names.get_values_for_type(x509.DNSName)
    ca = x509.load_pem_x509_certificate(certificates.ca.read_bytes())
    assert cert.issuer == ca.subject
    assert certificates.key.stat().st_mode & 0o077 == 0


def test_contexts_refuse_anything_below_tls_1_2_and_verify_the_broker(
    certificates: CertificateFiles,
) -> None:
    server = tls.server_context(certificates.cert, certificates.key)
    assert server.minimum_version >= ssl.TLSVersion.TLSv1_2
    client = tls.client_context(tls_attributes(certificates.ca))
    assert client is not None
    assert client.minimum_version >= ssl.TLSVersion.TLSv1_2
    assert client.verify_mode is ssl.CERT_REQUIRED and client.check_hostname
    relaxed = tls.client_context(
        tls_attributes(certificates.ca, **{tls.CHECK_HOSTNAME_ATTRIBUTE: "false"})
    )
    assert relaxed is not None
    assert relaxed.verify_mode is ssl.CERT_REQUIRED and not relaxed.check_hostname
    inline = tls.client_context(
        tls_attributes(Path("unused"), **{tls.CA_ATTRIBUTE: certificates.ca.read_text()})
    )
    assert inline is not None and inline.get_ca_certs()
    assert tls.client_context({}) is None
    assert tls.client_context({tls.TLS_ATTRIBUTE: "false"}) is None
    with pytest.raises(InvalidRequest, match=tls.CA_ATTRIBUTE):
        tls.client_context(tls_attributes(Path("/nonexistent/ca.pem")))
    with pytest.raises(InvalidRequest, match=tls.TLS_ATTRIBUTE):
        tls.client_context({tls.TLS_ATTRIBUTE: "maybe"})


def test_the_broker_wants_both_certificate_and_key(
    certificates: CertificateFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    def never(*_: object) -> None:
        raise AssertionError("the broker started with half a TLS configuration")

    monkeypatch.setattr(cli, "run_broker", never)
    result = CliRunner().invoke(cli.app, ["broker", "--tls-cert", str(certificates.cert)])
    assert result.exit_code == 2
    assert "--tls-key" in result.output
    # The environment equivalents are the same options.
    result = CliRunner().invoke(cli.app, ["broker"], env={tls.KEY_ENV: str(certificates.key)})
    assert result.exit_code == 2
    assert "--tls-cert" in result.output


# -- a TLS broker -------------------------------------------------------------------------------


async def test_a_tls_client_with_the_cluster_ca_produces_and_consumes_end_to_end(
    tls_broker: NorthguardProcess, tls_client: NorthguardBackend, certificates: CertificateFiles
) -> None:
    await tls_client.check()
    await produce_and_consume(tls_client, "tls-e2e", count=4000, size=1024)  # 4 MB each way
    # A second client has no view of the topic: its producer asks by the blocking one-off.
    other = backend_for(tls_broker.url, **tls_attributes(certificates.ca))
    try:
        producer = other.producer("tls-e2e")
        assert await producer.send(0, [Record(b"x", key=b"k")]) == [0]
        await producer.close()
    finally:
        await other.close()
    context = tls.client_context(tls_attributes(certificates.ca))
    result = request_blocking(
        tls_broker.url, "topic_metadata", TIMEOUT_S, tls_context=context, name="tls-e2e"
    )
    assert result["name"] == "tls-e2e"
    assert context is not None
    with (
        socket.create_connection(("127.0.0.1", tls_broker.port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as sock,
    ):
        assert sock.version() in ("TLSv1.2", "TLSv1.3")
    # The health and metrics port stays plain HTTP.
    url = f"http://127.0.0.1:{tls_broker.http_port}/health"
    with urllib.request.urlopen(url, timeout=10) as response:
        assert json.loads(response.read())["broker_id"] == "1"


async def test_a_client_trusting_another_ca_is_refused_naming_tls(
    tls_broker: NorthguardProcess, other_ca: CertificateFiles
) -> None:
    backend = backend_for(tls_broker.url, **tls_attributes(other_ca.ca))
    try:
        started = time.monotonic()
        with pytest.raises(BackendUnavailable, match=r"TLS.*certificate"):
            await backend.check()
        with pytest.raises(BackendUnavailable, match=r"TLS.*certificate"):
            await backend.create_topic("never", shard_ranges(1))
        with pytest.raises(BackendUnavailable, match=r"TLS.*certificate"):
            backend.producer("never")  # the blocking one-off
        assert time.monotonic() - started < FAST_S
    finally:
        await backend.close()


async def test_a_plaintext_client_of_a_tls_broker_fails_fast_naming_tls(
    tls_broker: NorthguardProcess,
) -> None:
    backend = backend_for(tls_broker.url, request_timeout_s=str(TIMEOUT_S))
    try:
        started = time.monotonic()
        with pytest.raises(BackendUnavailable, match="TLS"):
            await backend.check()
        with pytest.raises(BackendUnavailable, match="TLS"):
            backend.producer("never")
        assert time.monotonic() - started < FAST_S
    finally:
        await backend.close()


async def test_a_tls_client_of_a_plaintext_broker_fails_fast_naming_tls(
    northguard_process: NorthguardProcess, certificates: CertificateFiles
) -> None:
    backend = backend_for(northguard_process.url, **tls_attributes(certificates.ca))
    try:
        started = time.monotonic()
        with pytest.raises(BackendUnavailable, match="TLS"):
            await backend.check()
        with pytest.raises(BackendUnavailable, match="TLS"):
            backend.producer("never")
        assert time.monotonic() - started < FAST_S
    finally:
        await backend.close()


async def test_the_hostname_is_checked_unless_the_cluster_says_not_to(tmp_path: Path) -> None:
    """A certificate naming another host: refused by default, accepted with the check off."""
    elsewhere = make_test_certificates(tmp_path / "certs", hosts=["broker.example"])
    process = start_northguard_broker(tmp_path / "data", tls=elsewhere)
    try:
        strict = backend_for(process.url, **tls_attributes(elsewhere.ca))
        try:
            with pytest.raises(BackendUnavailable, match=r"TLS.*(?i:hostname|IP address)"):
                await strict.check()
        finally:
            await strict.close()
        relaxed = backend_for(
            process.url,
            **tls_attributes(elsewhere.ca, **{tls.CHECK_HOSTNAME_ATTRIBUTE: "false"}),
        )
        try:
            await relaxed.check()
            await relaxed.create_topic("relaxed", shard_ranges(1))
            relaxed.producer("relaxed")  # no view in another backend: the blocking path too
        finally:
            await relaxed.close()
    finally:
        process.stop()


async def test_credentials_still_work_over_tls(
    tmp_path: Path, certificates: CertificateFiles
) -> None:
    process = start_northguard_broker(tmp_path / "data", tls=certificates, secret=SECRET)
    try:
        admin = backend_for(
            process.url,
            **tls_attributes(certificates.ca, **{credentials.SECRET_ATTRIBUTE: SECRET}),
        )
        try:
            await produce_and_consume(admin, "xinfra.vca.secure.0.aa")
        finally:
            await admin.close()
        anonymous = backend_for(process.url, **tls_attributes(certificates.ca))
        try:
            with pytest.raises(Unauthorized):
                await anonymous.list_topics()
        finally:
            await anonymous.close()
    finally:
        process.stop()
