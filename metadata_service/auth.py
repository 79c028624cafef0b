"""API tokens: bearer tokens stored as SHA-256 hashes, each with a role and a scope.

Roles: ``admin`` manages clusters, topics and tokens; ``client`` reads
metadata and uses the registry (and, later, groups and checkpoints).  The
scope is one virtual cluster or ``*``.  Physical clusters, virtual clusters and
tokens are global, so they need an admin token scoped to ``*``.

Tokens are 32 random bytes, so a plain SHA-256 is enough (no password
stretching: there is nothing to brute-force).  Verified tokens are cached for
``token_cache_s``: a revoked token can be accepted that long by an instance
that has seen it; the instance that deletes a token forgets it at once, even
when a lookup of it is in flight.  There is no anonymous access except /health,
/ready and /metrics.

Concurrent requests of a token that is not cached share one lookup (a known
token whose entry expires under load costs one lookup, not one per request).
Unknown tokens cost a database lookup each, so a peer (an IP address) may try
``auth_failures_burst`` of them, refilled at ``auth_failures_per_s``; past
that its uncached tokens are refused with 429 before any lookup (a known
token that is cached, or the configured admin token, still passes).  Token
creation is bounded the same way over the whole instance.  No token is ever
logged: the initial admin token goes to a 0600 file.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass

from metadata_service.runtime import Runtime
from xinfra.errors import Backpressure, Conflict, Forbidden, Unauthenticated

log = logging.getLogger(__name__)

ADMIN_TOKEN_FILE = "admin-token"
ADMIN_TOKEN_CHARS_MIN = 24
PLACEHOLDER_TOKENS = frozenset({"change-me-admin-token", "change-me", "changeme", "admin"})
"""Known placeholders (the old docker-compose default among them): never an admin token."""


def check_admin_token(token: str) -> None:
    """Refuse a configured admin token that is a placeholder or too short to be a secret.

    It never expires and cannot be revoked (only unset), so it must be unguessable.
    """
    if token.strip().lower() in PLACEHOLDER_TOKENS or len(token.strip()) < ADMIN_TOKEN_CHARS_MIN:
        raise ValueError(
            "XINFRA_ADMIN_TOKEN is a placeholder or shorter than "
            f"{ADMIN_TOKEN_CHARS_MIN} characters; set a long random secret "
            "(e.g. `openssl rand -base64 32`), or unset it to have the service create one"
        )


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    return "xt_" + secrets.token_urlsafe(32)


@dataclass(frozen=True)
class Principal:
    name: str
    role: str
    scope: str

    def can_read(self, vcluster: str) -> bool:
        return self.scope in ("*", vcluster)

    def require_read(self, vcluster: str) -> None:
        if not self.can_read(vcluster):
            raise Forbidden(f"token {self.name!r} is scoped to {self.scope!r}, not {vcluster!r}")

    def require_admin(self, vcluster: str | None = None) -> None:
        """Admin of ``vcluster``, or of everything when None."""
        if self.role != "admin":
            raise Forbidden(
                f"token {self.name!r} has role {self.role!r}; this needs an admin token"
            )
        if vcluster is None and self.scope != "*":
            raise Forbidden(
                f"token {self.name!r} is scoped to {self.scope!r}; this needs an admin token for all (*)"
            )
        if vcluster is not None:
            self.require_read(vcluster)


_BOOTSTRAP_ADMIN = Principal("bootstrap-admin", "admin", "*")


class TokenService:
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        config = runtime.config
        if config.admin_token:
            check_admin_token(config.admin_token)
        self._bootstrap_hash = hash_token(config.admin_token) if config.admin_token else None
        self._cache: OrderedDict[str, tuple[Principal | None, float]] = OrderedDict()
        self._digests: dict[str, str] = {}
        """Authorization header -> its token's digest, for headers that named a known token
        (``authenticate_cached``)."""
        self._generation = 0
        """Bumped by every delete: a lookup that started before it must not cache what it read."""
        self._lookups: dict[str, asyncio.Future[Principal | None]] = {}
        """Store lookups in flight by token digest (at most one each); a delete forgets them, so
        a request that arrives after it starts a lookup of its own."""
        from metadata_service.gate import PeerBuckets, TokenBucket

        self._failures = PeerBuckets(config.auth_failures_per_s, config.auth_failures_burst)
        self._creations = TokenBucket(config.token_creations_per_s, config.token_creations_burst)

    async def authenticate(self, authorization: str | None, peer: str = "-") -> Principal:
        """The principal of a bearer token; ``peer`` (the caller's address) bounds lookups of
        unknown tokens."""
        if not authorization:
            raise Unauthenticated(
                "missing bearer token: set XINFRA_TOKEN (or pass --token) for the xinfra CLI "
                "and the SDK, or send 'Authorization: Bearer <token>'; `xinfra up` writes its "
                "admin token to .xinfra/admin-token"
            )
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthenticated("the Authorization header must be 'Bearer <token>'")
        digest = hash_token(token.strip())
        if self._bootstrap_hash is not None and hmac.compare_digest(digest, self._bootstrap_hash):
            return _BOOTSTRAP_ADMIN
        now = time.monotonic()
        cached = self._cache.get(digest)
        if cached is not None and cached[1] > now:
            self.runtime.metrics.token_cache_hits.inc()
            principal = cached[0]
        else:
            lookup = self._lookups.get(digest)
            if lookup is not None:
                self.runtime.metrics.token_cache_misses.inc()  # it waits for a store read
            else:
                lookup = asyncio.ensure_future(self._lookup(digest, peer, now))
                self._lookups[digest] = lookup
                lookup.add_done_callback(lambda _: self._forget_lookup(digest, lookup))
            # Shielded: one caller giving up must not cancel the lookup the others wait for.
            principal = await asyncio.shield(lookup)
        if principal is None:
            raise Unauthenticated("unknown or revoked token")
        return principal

    async def _lookup(self, digest: str, peer: str, now: float) -> Principal | None:
        """One store lookup of a token that is not cached, shared by every request of it that
        arrives meanwhile: a known token whose entry expired under load costs one lookup, not
        one per request (each of which would spend a failure of its peer's bucket)."""
        # Spend a failure before the lookup (concurrent floods of distinct tokens cannot
        # overdraw the bucket); a token that turns out to be known gives it back.
        failures = self._failures.get(peer)
        if not failures.take():
            raise Backpressure(
                f"too many unknown tokens from {peer}; retry later "
                f"(at most {self.runtime.config.auth_failures_per_s:g} a second)"
            )
        self.runtime.metrics.token_cache_misses.inc()
        generation = self._generation
        row = await self.runtime.db(self.runtime.store.find_token, digest)
        principal = Principal(row.name, row.role, row.scope) if row is not None else None
        if principal is not None:
            failures.give_back()
        if generation == self._generation:
            self._cache[digest] = (principal, now + self.runtime.config.token_cache_s)
            self._cache.move_to_end(digest)
            while len(self._cache) > self.runtime.config.token_cache_max:
                self._cache.popitem(last=False)
        return principal

    def _forget_lookup(self, digest: str, lookup: asyncio.Future[Principal | None]) -> None:
        if self._lookups.get(digest) is lookup:
            del self._lookups[digest]
        if not lookup.cancelled():
            lookup.exception()  # retrieved: every waiter re-raises it, none may be left

    def authenticate_cached(self, authorization: str | None) -> Principal | None:
        """The principal of a bearer token known without a store lookup: the configured admin
        token, or a token verified within ``token_cache_s``.  None for anything else (unknown,
        expired from the cache, refused, malformed, missing): ``authenticate`` answers those,
        errors included."""
        if not authorization:
            return None
        digest = self._digests.get(authorization)
        if digest is None:
            scheme, _, token = authorization.partition(" ")
            token = token.strip()
            if scheme.lower() != "bearer" or not token:
                return None
            digest = hash_token(token)
        if self._bootstrap_hash is not None and hmac.compare_digest(digest, self._bootstrap_hash):
            self._remember_digest(authorization, digest)
            return _BOOTSTRAP_ADMIN
        cached = self._cache.get(digest)
        if cached is None or cached[0] is None or cached[1] <= time.monotonic():
            return None
        self._remember_digest(authorization, digest)
        self.runtime.metrics.token_cache_hits.inc()
        return cached[0]

    def _remember_digest(self, authorization: str, digest: str) -> None:
        """Keep the digest of a header that named a known token: a client sends the same header
        on every request, and hashing it again was about half of the token check (cProfile).
        Only the digest is kept (what the token names is looked up each time), and at most
        ``token_cache_max`` headers."""
        if authorization not in self._digests:
            if len(self._digests) >= self.runtime.config.token_cache_max:
                self._digests.clear()
            self._digests[authorization] = digest

    async def create(self, name: str, role: str, scope: str) -> tuple[str, int]:
        """A new token (returned once); 429 past ``token_creations_burst`` at a time."""
        if not self._creations.take():
            raise Backpressure("too many tokens created recently; retry later")
        token = new_token()
        row = await self.runtime.db(
            self.runtime.store.insert_token, hash_token(token), name, role, scope
        )
        return token, row.created_ms

    async def delete(self, name: str) -> None:
        await self.runtime.db(self.runtime.store.delete_token, name)
        self._generation += 1
        self._cache.clear()
        self._lookups.clear()

    async def ensure_initial_admin(self) -> str | None:
        """First start without a configured admin token: create one and write it to the run dir.

        Returns the new token (None when an admin token already exists or one is
        configured).  Two instances starting at once race on the token name;
        the loser keeps the winner's token.
        """
        if self._bootstrap_hash is not None:
            return None
        if await self.runtime.db(self.runtime.store.count_admin_tokens) > 0:
            return None
        try:
            token, _ = await self.create("initial-admin", "admin", "*")
        except Conflict:
            return None
        path = self.runtime.config.run_dir / ADMIN_TOKEN_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(token + "\n")
        log.warning("created the initial admin token; it is in %s", path)
        return token
