"""Northguard credentials: signed, scoped, short-lived, verified by a broker without a call out.

Why: a broker must refuse a tenant's operations on another tenant's physical
topics, yet it cannot ask the metadata service on every connection (the
service is not on the data path, and may be down while data still flows).  So
the service signs what a caller may do, and the broker checks the signature
with the cluster secret both know (HMAC-SHA256, ``hmac.compare_digest``).

A credential is one ASCII string::

    ng1.<base64url(JSON claims)>.<base64url(HMAC-SHA256(secret, "ng1." + claims part))>

Claims: ``p`` the principal (for logs only), ``s`` the physical-topic scope
(a name prefix, ``*`` for every topic), ``o`` the operations (``read``,
``write``, ``admin``), ``x`` the expiry (unix seconds).  Expiry is checked
against the *verifier's* clock at every use, so a credential stops working
within clock skew of its expiry.  A credential is a bearer token: whoever
holds it may use it until it expires (there is no revocation list; keep
lifetimes short).  The claims are signed, not encrypted.

The broker side (``backends.northguard.broker.connection``) receives it in an
``authenticate`` request, the first request of every connection; see there.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import time
from dataclasses import dataclass

from xinfra.errors import Unauthorized

VERSION = "ng1"
READ = "read"
WRITE = "write"
ADMIN = "admin"
OPERATIONS = frozenset({READ, WRITE, ADMIN})
ALL_TOPICS = "*"
CREDENTIAL_BYTES_MAX = 4096
"""A longer credential is refused before any decoding (it is sent on every connection)."""
SECRET_BYTES_MIN = 16
"""A shorter cluster secret is refused: it could be guessed offline from one credential."""
SECRET_ENV = "XINFRA_NORTHGUARD_SECRET"
"""The environment variable a broker reads its cluster secret from."""
SECRET_ATTRIBUTE = "northguard.secret"
"""The (secret) physical-cluster attribute the metadata service and its backend sign with."""
AUTH_ATTRIBUTE = "northguard.auth"
"""The cluster attribute that carries a client's credential in served topic metadata."""


@dataclass(frozen=True, slots=True)
class Claims:
    principal: str
    scope: str
    operations: frozenset[str]
    expires_s: float

    def covers(self, topic: str) -> bool:
        """Whether ``topic`` is inside the scope (a prefix match, or every topic)."""
        return self.scope == ALL_TOPICS or topic.startswith(self.scope)

    def authorize(self, operation: str, topic: str | None, now_s: float) -> None:
        """Raise ``Unauthorized`` unless ``operation`` on ``topic`` (None: no topic) is allowed now."""
        assert operation in OPERATIONS
        if now_s >= self.expires_s:
            raise Unauthorized(
                f"the credential of {self.principal!r} expired at {self.expires_s:.0f} "
                "(unix s); reconnect with a fresh one from the metadata service"
            )
        if operation not in self.operations:
            raise Unauthorized(f"{self.principal!r} may not {operation} on this cluster")
        if topic is not None and not self.covers(topic):
            raise Unauthorized(f"{self.principal!r} may not {operation} topic {topic!r}")


PLACEHOLDER_WORDS = (b"change-me", b"changeme", b"change_me", b"placeholder", b"replace-me")
"""A secret containing one of these was copied from an example: refused like a short one."""


def check_secret(secret: bytes) -> bytes:
    """The secret, or ``ValueError`` when it is too short or a placeholder (an example's value
    is known to everyone who read the example, so it would open the broker to them)."""
    if any(word in secret.lower() for word in PLACEHOLDER_WORDS):
        raise ValueError(
            "the Northguard cluster secret is a placeholder; generate one: openssl rand -base64 32"
        )
    if len(secret) < SECRET_BYTES_MIN:
        raise ValueError(
            f"a Northguard cluster secret needs at least {SECRET_BYTES_MIN} bytes "
            "(generate one: openssl rand -base64 32)"
        )
    return secret


def sign(
    secret: bytes,
    principal: str,
    scope: str,
    operations: frozenset[str] | set[str],
    ttl_s: float,
    now_s: float | None = None,
) -> str:
    """A credential for ``principal`` on ``scope`` with ``operations``, valid ``ttl_s`` from now."""
    assert operations and set(operations) <= OPERATIONS, operations
    assert ttl_s > 0
    expires_s = (time.time() if now_s is None else now_s) + ttl_s
    claims = {"p": principal, "s": scope, "o": sorted(operations), "x": int(expires_s)}
    body = _b64(json.dumps(claims, separators=(",", ":")).encode())
    signed = f"{VERSION}.{body}"
    return f"{signed}.{_b64(_mac(secret, signed))}"


def verify(secret: bytes, credential: str, now_s: float | None = None) -> Claims:
    """The claims of a genuine, unexpired credential; ``Unauthorized`` otherwise.

    The signature is compared in constant time before the claims are parsed,
    so nothing of a forged credential is ever interpreted.
    """
    if not isinstance(credential, str) or len(credential) > CREDENTIAL_BYTES_MAX:
        raise Unauthorized("malformed credential")
    version, _, rest = credential.partition(".")
    body, _, mac = rest.partition(".")
    if version != VERSION or not body or not mac:
        raise Unauthorized("malformed credential")
    try:
        given = base64.urlsafe_b64decode(_pad(mac))
    except (binascii.Error, ValueError):
        raise Unauthorized("malformed credential") from None
    if not hmac.compare_digest(given, _mac(secret, f"{version}.{body}")):
        raise Unauthorized("credential signature does not match this cluster's secret")
    try:
        data = json.loads(base64.urlsafe_b64decode(_pad(body)))
        claims = Claims(
            principal=str(data["p"]),
            scope=str(data["s"]),
            operations=frozenset(str(o) for o in data["o"]) & OPERATIONS,
            expires_s=float(data["x"]),
        )
    except (ValueError, KeyError, TypeError, binascii.Error):
        raise Unauthorized("malformed credential claims") from None
    if (time.time() if now_s is None else now_s) >= claims.expires_s:
        raise Unauthorized(
            f"the credential of {claims.principal!r} has expired; "
            "reconnect with a fresh one from the metadata service"
        )
    return claims


def expires_s(credential: str) -> float:
    """The expiry a credential claims, read *without* verifying it (clients plan refreshes by it)."""
    try:
        body = credential.split(".")[1]
        return float(json.loads(base64.urlsafe_b64decode(_pad(body)))["x"])
    except (IndexError, ValueError, KeyError, TypeError, binascii.Error):
        return 0.0


def _mac(secret: bytes, signed: str) -> bytes:
    return hmac.new(secret, signed.encode(), hashlib.sha256).digest()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _pad(text: str) -> bytes:
    return (text + "=" * (-len(text) % 4)).encode()
