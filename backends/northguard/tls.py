"""TLS on Northguard's client port: the broker's context, the client's, and test certificates.

Why: a credential (``backends.northguard.credentials``) is a bearer token and
records are tenants' data; on a plaintext port both can be read, and a
credential replayed, by anyone on the path.  A broker started with a
certificate and key (``--tls-cert`` / ``--tls-key``, or ``CERT_ENV`` /
``KEY_ENV``) speaks TLS 1.2+ only on its client port; its HTTP health and
metrics port stays plaintext (it carries no credential and no record).

Clients take their settings from the physical cluster's public attributes:

* ``northguard.tls`` = ``true``: every connection (admin, producer, reader,
  the blocking one-off) is TLS and verifies the broker's certificate;
* ``northguard.tls.ca``: the CA that signed the brokers' certificates, a file
  path or the PEM text itself (attributes travel with topic metadata to
  clients on other machines, where a path may not exist); without it, the
  system's trust store;
* ``northguard.tls.check_hostname`` = ``false`` to accept a certificate that
  does not name the bootstrap host (the chain is still verified).  On by
  default.

There is no client certificate (mutual TLS): clients prove who they are
with credentials, inside the encrypted connection.

``make_test_certificates`` writes a self-signed CA and a broker certificate
for ``127.0.0.1`` and ``localhost`` (P-256 keys: a handshake costs well under
a millisecond of CPU), for the tests and a local stack.
"""

from __future__ import annotations

import datetime
import os
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from ipaddress import ip_address
from pathlib import Path

from xinfra.errors import InvalidRequest

TLS_ATTRIBUTE = "northguard.tls"
"""Cluster attribute: ``true`` makes every client connection TLS."""
CA_ATTRIBUTE = "northguard.tls.ca"
"""Cluster attribute: the CA bundle (a file path, or PEM text) client connections verify with."""
CHECK_HOSTNAME_ATTRIBUTE = "northguard.tls.check_hostname"
"""Cluster attribute: ``false`` accepts a broker certificate that does not name the host."""
CERT_ENV = "XINFRA_NORTHGUARD_TLS_CERT"
"""Environment equivalent of the broker's ``--tls-cert``."""
KEY_ENV = "XINFRA_NORTHGUARD_TLS_KEY"
"""Environment equivalent of the broker's ``--tls-key``."""
TEST_CERTIFICATE_DAYS = 365

_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off", ""})


@dataclass(frozen=True, slots=True)
class CertificateFiles:
    """PEM files: the CA certificate clients trust, the broker's certificate and its key."""

    ca: Path
    cert: Path
    key: Path


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    """The broker's context: TLS 1.2+ only, no client certificate asked.

    Raises ``ssl.SSLError``/``OSError`` for an unreadable or mismatched pair, so a broker
    with a broken certificate refuses to start instead of serving something else.
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    return context


def _flag(attributes: Mapping[str, str], name: str, default: bool) -> bool:
    value = attributes.get(name)
    if value is None:
        return default
    text = value.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise InvalidRequest(f"cluster attribute {name}={value!r} is not true or false")


def client_context(attributes: Mapping[str, str]) -> ssl.SSLContext | None:
    """The client context a cluster's attributes ask for; None when its brokers are plaintext.

    Built once per backend and shared by all its connections (a context is thread-safe
    and holds the parsed CA).  A CA that cannot be loaded is an ``InvalidRequest`` naming
    the attribute: a misconfigured cluster fails before any connection is tried.
    """
    if not _flag(attributes, TLS_ATTRIBUTE, default=False):
        return None
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.check_hostname = _flag(attributes, CHECK_HOSTNAME_ATTRIBUTE, default=True)
    context.verify_mode = ssl.CERT_REQUIRED
    ca = attributes.get(CA_ATTRIBUTE)
    if ca:
        try:
            if "-----BEGIN" in ca:
                context.load_verify_locations(cadata=ca)
            else:
                context.load_verify_locations(cafile=ca)
        except (OSError, ssl.SSLError, ValueError) as error:
            raise InvalidRequest(
                f"cluster attribute {CA_ATTRIBUTE} cannot be loaded as a PEM CA bundle: {error}"
            ) from error
    return context


def describe_failure(address: str, error: BaseException) -> str:
    """What a client says when its TLS handshake with ``address`` failed, with what to check."""
    detail = str(error) or type(error).__name__
    cause = error.__cause__ if error.__cause__ is not None else error
    if isinstance(cause, ssl.SSLCertVerificationError):
        hint = (
            f"check that {CA_ATTRIBUTE} holds the CA that signed the broker's certificate and "
            f"that the certificate names the host, or set {CHECK_HOSTNAME_ATTRIBUTE}=false"
        )
        return (
            f"TLS handshake with Northguard broker {address} failed, its certificate refused: "
            f"{detail}; {hint}"
        )
    return (
        f"TLS handshake with Northguard broker {address} failed: {detail}; does the broker "
        f"serve TLS? One started without --tls-cert speaks plaintext: unset {TLS_ATTRIBUTE}"
    )


PLAINTEXT_HINT = (
    f"a broker serving TLS (started with --tls-cert) closes plaintext connections: "
    f"set the cluster attributes {TLS_ATTRIBUTE}=true and {CA_ATTRIBUTE}"
)
"""Added when a plaintext connection is closed before any answer: what a TLS broker does."""


def make_test_certificates(
    directory: Path,
    hosts: Sequence[str] = ("127.0.0.1", "localhost"),
    days: int = TEST_CERTIFICATE_DAYS,
) -> CertificateFiles:
    """Write a new self-signed CA and a broker certificate for ``hosts`` it signed.

    For tests and a local stack only: the CA's key is not kept (nothing else can be
    signed with it), the broker's key is written owner-only.  Needs ``cryptography``.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    not_before = now - datetime.timedelta(hours=1)
    not_after = now + datetime.timedelta(days=days)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Northguard test CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )

    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
        .sign(ca_key, hashes.SHA256())
    )

    files = CertificateFiles(
        ca=directory / "ca.pem", cert=directory / "broker.pem", key=directory / "broker.key"
    )
    files.ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(files.key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(key_pem)
    os.chmod(files.key, 0o600)  # an existing file keeps its mode through O_CREAT
    return files
