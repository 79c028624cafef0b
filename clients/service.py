"""The SDK's link to the metadata service: metadata, long-polls, registration, heartbeats.

``ServiceSource`` implements ``clients.metadata.MetadataSource`` over the /v1
HTTP API.  It registers the client (producer or consumer) with the topics it
uses, heartbeats every third of its lease with the metadata version it runs
on per topic, and re-registers when the service forgot it (a 404 after a
restart or an expiry).  A service that is down raises ``Unavailable`` to the
watch, which keeps the last metadata and retries; data keeps flowing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import uuid
from typing import Any

import httpx

from xinfra.backoff import backoff_s
from xinfra.errors import Forbidden, NotFound, Timeout, Unauthenticated, Unavailable, XinfraError
from xinfra.model import TopicMetadata
from xinfra.rest import MetadataClient, resolve_token, tls_context
from xinfra.settings import Settings, get_settings

log = logging.getLogger(__name__)

LEASE_S = 30.0
"""Registration lease: the service forgets a client that has not heartbeated for this long."""
LONG_POLL_MARGIN_S = 10.0
"""How much longer than the long-poll itself the HTTP request may take."""


class ServiceSource:
    """Metadata from the service for one client of one virtual cluster."""

    def __init__(
        self,
        kind: str,
        *,
        url: str | None = None,
        token: str | None = None,
        virtual_cluster: str | None = None,
        client_id: str | None = None,
        settings: Settings | None = None,
        lease_s: float = LEASE_S,
    ) -> None:
        s = settings or get_settings()
        self.kind = kind
        self.lease_s = lease_s
        self.virtual_cluster = virtual_cluster or s.virtual_cluster
        self.client_id = client_id or f"{kind}-{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
        self.url = (url or s.metadata_url).rstrip("/")
        headers = {}
        if resolved := resolve_token(s, token):
            headers["Authorization"] = f"Bearer {resolved}"
        self._http = httpx.AsyncClient(
            base_url=self.url, headers=headers, timeout=s.request_timeout_s, verify=tls_context()
        )
        self._versions: dict[str, int] = {}
        self._registered_topics: list[str] | None = None
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._fatal: XinfraError | None = None

    async def _call(
        self, method: str, path: str, timeout_s: float | None = None, **kwargs: Any
    ) -> Any:
        try:
            response = await self._http.request(
                method,
                path,
                timeout=timeout_s if timeout_s is not None else httpx.USE_CLIENT_DEFAULT,
                **kwargs,
            )
        except httpx.TimeoutException:
            raise Timeout(f"the metadata service at {self.url} did not answer in time") from None
        except httpx.TransportError as error:
            raise Unavailable(
                f"the metadata service at {self.url} is unreachable ({error})"
            ) from None
        if response.status_code >= 400:
            problem = MetadataClient._error(response)
            if isinstance(problem, Unauthenticated | Forbidden):
                self._fatal = problem
            raise problem
        if self._fatal is not None and response.status_code < 300:
            self._fatal = None  # the token works again (re-created under the same secret)
        return response.json() if response.content else None

    async def connect(self, timeout_s: float) -> None:
        """Check the service answers and accepts the token for this virtual cluster.

        Retries an unreachable service with backoff for up to ``timeout_s``,
        then raises ``Unavailable`` naming the URL; a bad token or an unknown
        virtual cluster raises at once.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        failures = 0
        while True:
            try:
                await self._call("GET", f"/v1/vclusters/{self.virtual_cluster}")
                return
            except XinfraError as error:
                remaining_s = deadline - loop.time()
                if not error.retriable:
                    raise
                if remaining_s <= 0:
                    raise Unavailable(
                        f"the metadata service at {self.url} did not answer in {timeout_s:.1f} s "
                        f"({error.message}); check XINFRA_METADATA_URL and that the service runs"
                    ) from error
                failures += 1
                await asyncio.sleep(min(backoff_s(failures), remaining_s))

    def check(self) -> None:
        """Raise the authentication error the service last gave, if any (a revoked token)."""
        if self._fatal is not None:
            raise self._fatal

    def _topic_path(self, topic: str) -> str:
        return f"/v1/vclusters/{self.virtual_cluster}/topics/{topic}/metadata"

    async def topic_metadata(self, topic: str) -> TopicMetadata:
        metadata = TopicMetadata.model_validate(await self._call("GET", self._topic_path(topic)))
        self._versions.setdefault(topic, metadata.version)
        return metadata

    async def topic_names(self, names_max: int = 100_000) -> list[str]:
        """Names of the virtual cluster's topics, page by page (at most ``names_max``)."""
        names: list[str] = []
        after: str | None = None
        while len(names) < names_max:
            page = await self._call(
                "GET",
                f"/v1/vclusters/{self.virtual_cluster}/topics",
                params={"after": after, "limit": 1000},
            )
            names.extend(topic["name"] for topic in page["topics"])
            after = page["next_after"]
            if after is None:
                break
        return names[:names_max]

    async def wait_for_change(
        self, topic: str, after_version: int, timeout_s: float
    ) -> TopicMetadata | None:
        body = await self._call(
            "GET",
            self._topic_path(topic),
            params={"after_version": after_version, "timeout_s": timeout_s},
            timeout_s=timeout_s + LONG_POLL_MARGIN_S,
        )
        metadata = TopicMetadata.model_validate(body)
        # The same version still matters to a client with credentials (re-signed by the service).
        return metadata if metadata.version >= after_version else None

    async def acknowledge(self, topic: str, version: int) -> None:
        self._versions[topic] = max(version, self._versions.get(topic, 0))
        if self._registered_topics is None or topic not in self._registered_topics:
            await self.register()
        await self.heartbeat()
        if self._heartbeat_task is None:
            self._heartbeat_task = asyncio.get_running_loop().create_task(
                self._heartbeats(), name=f"heartbeat:{self.client_id}"
            )

    async def register(self) -> None:
        topics = sorted(self._versions)
        await self._call(
            "PUT",
            f"/v1/vclusters/{self.virtual_cluster}/clients/{self.client_id}",
            json={
                "kind": self.kind,
                "topics": topics,
                "host": socket.gethostname(),
                "ttl_s": self.lease_s,
            },
        )
        self._registered_topics = topics

    async def heartbeat(self) -> None:
        path = f"/v1/vclusters/{self.virtual_cluster}/clients/{self.client_id}/heartbeat"
        try:
            await self._call("POST", path, json={"versions": self._versions})
        except NotFound:
            await self.register()  # the service forgot us (restart, expiry): register again
            await self._call("POST", path, json={"versions": self._versions})

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 3)
            try:
                await self.heartbeat()
            except XinfraError as error:
                log.warning("heartbeat of %s failed: %s", self.client_id, error)

    async def close(self) -> None:
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat_task
        with contextlib.suppress(XinfraError):
            if self._registered_topics is not None:
                await self._call(
                    "DELETE", f"/v1/vclusters/{self.virtual_cluster}/clients/{self.client_id}"
                )
        await self._http.aclose()
