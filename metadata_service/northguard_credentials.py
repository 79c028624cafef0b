"""Northguard credentials handed to clients with their topic metadata.

Why: a Northguard cluster registered with a secret attribute
(``northguard.secret``, best as an ``env:``/``file:`` reference) runs brokers
that serve credentials only (``backends.northguard.credentials``).  The
service knows the secret and which virtual cluster a caller may read, so every
topic-metadata answer carries, in each such cluster's public attributes
(``northguard.auth``), a read+write credential scoped to the physical topics
of the topic's virtual cluster (``vc_scope``), valid ``CREDENTIAL_TTL_S``.
Clients refresh it by the long-poll they already run (the service answers the
current metadata at each poll's timeout, with a credential re-signed when
the one cached is past half its life).

Cost: a body naming no Northguard cluster is returned as is (one ``in``
test); one that does is parsed and re-serialized (tens of microseconds).
Bounds: one cached secret per cluster (``SECRET_CACHE_S``), one cached
credential per (cluster, virtual cluster); a cluster's secret change is
picked up within ``SECRET_CACHE_S``.
"""

from __future__ import annotations

import json
import time
from typing import Any

from backends.northguard.credentials import AUTH_ATTRIBUTE, READ, SECRET_ATTRIBUTE, WRITE, sign
from metadata_service.cluster_secrets import resolve
from metadata_service.runtime import Runtime
from xinfra.errors import NotFound
from xinfra.model import ClusterKind

CREDENTIAL_TTL_S = 900.0
"""The default of ``ServiceConfig.northguard_credential_ttl_s``."""
SECRET_CACHE_S = 30.0
_MARKER = f'"kind":"{ClusterKind.NORTHGUARD.value}"'.encode()


def _northguard_clusters(data: dict[str, Any]) -> list[str]:
    return [
        name
        for name, cluster in data.get("clusters", {}).items()
        if cluster.get("kind") == ClusterKind.NORTHGUARD.value
    ]


class CredentialIssuer:
    """Adds Northguard credentials to serialized topic metadata.  Event-loop only."""

    def __init__(self, runtime: Runtime, ttl_s: float = CREDENTIAL_TTL_S) -> None:
        self.rt = runtime
        self.ttl_s = ttl_s
        self._secrets: dict[str, tuple[bytes | None, float]] = {}
        self._credentials: dict[tuple[str, str], tuple[str, float]] = {}

    async def add_to(self, vc: str, scope: str, body: bytes) -> bytes:
        """``body`` with a credential of ``vc`` (on ``scope``: ``topics.vc_scope``) for each of its
        Northguard clusters that has a secret."""
        if _MARKER not in body:
            return body
        data = json.loads(body)
        secrets = {name: await self._secret(name) for name in _northguard_clusters(data)}
        return self._signed(data, vc, scope, secrets, body)

    def add_to_now(self, vc: str, scope: str, body: bytes) -> bytes | None:
        """``add_to`` without waiting: None when a cluster's secret must be read first."""
        if _MARKER not in body:
            return body
        data = json.loads(body)
        now = time.monotonic()
        secrets: dict[str, bytes | None] = {}
        for name in _northguard_clusters(data):
            known = self._secrets.get(name)
            if known is None or now - known[1] >= SECRET_CACHE_S:
                return None
            secrets[name] = known[0]
        return self._signed(data, vc, scope, secrets, body)

    def _signed(
        self,
        data: dict[str, Any],
        vc: str,
        scope: str,
        secrets: dict[str, bytes | None],
        body: bytes,
    ) -> bytes:
        changed = False
        for name, secret in secrets.items():
            if secret is not None:
                cluster = data["clusters"][name]
                cluster.setdefault("attributes", {})[AUTH_ATTRIBUTE] = self._credential(
                    name, vc, scope, secret
                )
                changed = True
        return json.dumps(data, separators=(",", ":")).encode() if changed else body

    async def _secret(self, cluster: str) -> bytes | None:
        now = time.monotonic()
        known = self._secrets.get(cluster)
        if known is not None and now - known[1] < SECRET_CACHE_S:
            return known[0]
        try:
            full, _version = await self.rt.db(self.rt.store.get_cluster, cluster)
        except NotFound:  # deleted meanwhile: the topic's metadata says what remains
            return None
        value = None
        if SECRET_ATTRIBUTE in full.attributes:
            value = resolve(full).attributes[SECRET_ATTRIBUTE].encode()
        self._secrets[cluster] = (value, now)
        return value

    def _credential(self, cluster: str, vc: str, scope: str, secret: bytes) -> str:
        now = time.time()
        known = self._credentials.get((cluster, vc))
        if known is not None and now - known[1] < self.ttl_s / 2:
            return known[0]
        token = sign(secret, f"vc:{vc}", scope, {READ, WRITE}, self.ttl_s, now)
        self._credentials[(cluster, vc)] = (token, now)
        return token
