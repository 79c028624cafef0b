"""A small typed client for the metadata service's /v1 API (what the CLI uses).

Errors come back as the ``xinfra.errors`` exception named by the problem's
stable ``code``, so a caller handles ``VersionConflict`` or ``TopicNotFound``
the same way whether it talks to the service or a backend.  The token is the
one given, else ``XINFRA_TOKEN``, else ``<run_dir>/admin-token`` (written by
an embedded service on its first start).
"""

from __future__ import annotations

import functools
import ssl
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from xinfra.errors import Unavailable, XinfraError, error_from_code
from xinfra.model import PhysicalCluster, TopicMetadata
from xinfra.settings import Settings, get_settings

ADMIN_TOKEN_FILE = "admin-token"


@functools.cache
def tls_context() -> ssl.SSLContext:
    """httpx's default TLS context, built once per process and shared by every service client.

    httpx builds one per client unless given one, loading the system's CA
    certificates each time: 27-45 ms of CPU per ``open_producer``,
    ``open_consumer`` or CLI call here, for a service that is usually plain
    HTTP on localhost.  A context is safe to share between clients and threads.
    """
    return httpx.create_ssl_context()


def resolve_token(settings: Settings, token: str | None = None) -> str | None:
    if token:
        return token
    if settings.token:
        return settings.token
    path = Path(settings.run_dir) / ADMIN_TOKEN_FILE
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


class MetadataClient:
    """Synchronous client of one service; every call is bounded by ``timeout_s``."""

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        timeout_s: float | None = None,
        settings: Settings | None = None,
    ) -> None:
        s = settings or get_settings()
        headers = {}
        resolved = resolve_token(s, token)
        if resolved:
            headers["Authorization"] = f"Bearer {resolved}"
        self.url = (url or s.metadata_url).rstrip("/")
        self._http = httpx.Client(
            base_url=self.url,
            headers=headers,
            timeout=timeout_s or s.request_timeout_s,
            verify=tls_context(),
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> MetadataClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def request(
        self,
        method: str,
        path: str,
        json: Any = None,
        params: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        """One call; the decoded JSON body (None for 204), or the service's error raised."""
        try:
            response = self._http.request(
                method,
                path,
                json=json,
                params={k: v for k, v in (params or {}).items() if v is not None},
                headers=headers,
                timeout=timeout_s if timeout_s is not None else httpx.USE_CLIENT_DEFAULT,
            )
        except httpx.TransportError as error:
            raise Unavailable(
                f"the metadata service at {self.url} is unreachable ({error}); is it running (`xinfra up`)?"
            ) from None
        if response.status_code >= 400:
            raise self._error(response)
        return response.json() if response.content else None

    @staticmethod
    def _error(response: httpx.Response) -> XinfraError:
        try:
            body = response.json()
            return error_from_code(str(body["code"]), str(body.get("detail") or body.get("title")))
        except (ValueError, KeyError, TypeError):
            return XinfraError(f"HTTP {response.status_code}: {response.text[:500]}")

    # ---- physical clusters ----------------------------------------------------------------

    def register_cluster(self, cluster: PhysicalCluster, check: bool = True) -> dict[str, Any]:
        result: dict[str, Any] = self.request(
            "POST", "/v1/clusters", json=cluster.model_dump(mode="json"), params={"check": check}
        )
        return result

    def list_clusters(self) -> list[dict[str, Any]]:
        return list(self.request("GET", "/v1/clusters")["clusters"])

    def describe_cluster(self, name: str) -> dict[str, Any]:
        result: dict[str, Any] = self.request("GET", f"/v1/clusters/{name}")
        return result

    def delete_cluster(self, name: str) -> None:
        self.request("DELETE", f"/v1/clusters/{name}")

    # ---- topics -----------------------------------------------------------------------------

    def create_topic(
        self, vc: str, name: str, cluster: str, shards: int, config: Mapping[str, str] | None = None
    ) -> TopicMetadata:
        body = {"name": name, "cluster": cluster, "shards": shards, "config": dict(config or {})}
        return TopicMetadata.model_validate(
            self.request("POST", f"/v1/vclusters/{vc}/topics", json=body)
        )

    def list_topics(self, vc: str, limit_max: int = 100_000) -> list[dict[str, Any]]:
        """Every topic summary of a virtual cluster, page by page (at most ``limit_max``)."""
        topics: list[dict[str, Any]] = []
        after: str | None = None
        while len(topics) < limit_max:
            page = self.request(
                "GET", f"/v1/vclusters/{vc}/topics", params={"after": after, "limit": 1000}
            )
            topics.extend(page["topics"])
            after = page["next_after"]
            if after is None:
                break
        return topics[:limit_max]

    def topic_metadata(
        self, vc: str, name: str, after_version: int | None = None, timeout_s: float = 30.0
    ) -> TopicMetadata:
        """The topic's metadata; with ``after_version``, long-poll for a newer version."""
        body = self.request(
            "GET",
            f"/v1/vclusters/{vc}/topics/{name}/metadata",
            params={"after_version": after_version, "timeout_s": timeout_s},
            timeout_s=timeout_s + 10.0,
        )
        return TopicMetadata.model_validate(body)

    def update_topic_config(
        self, vc: str, name: str, config: Mapping[str, str], expected_version: int | None = None
    ) -> TopicMetadata:
        body = {"config": dict(config), "expected_version": expected_version}
        return TopicMetadata.model_validate(
            self.request("PATCH", f"/v1/vclusters/{vc}/topics/{name}", json=body)
        )

    def seal_topic(
        self,
        vc: str,
        name: str,
        end_offsets: Mapping[int, int] | None = None,
        expected_version: int | None = None,
    ) -> TopicMetadata:
        body: dict[str, Any] = {"expected_version": expected_version}
        if end_offsets is not None:
            body["end_offsets"] = {str(k): v for k, v in end_offsets.items()}
        return TopicMetadata.model_validate(
            self.request("POST", f"/v1/vclusters/{vc}/topics/{name}/seal", json=body)
        )

    def delete_topic(self, vc: str, name: str, expected_version: int | None = None) -> None:
        self.request(
            "DELETE",
            f"/v1/vclusters/{vc}/topics/{name}",
            params={"expected_version": expected_version},
        )

    def add_epoch(
        self,
        vc: str,
        name: str,
        cluster: str,
        shards: int | None = None,
        state: str = "active",
        seal_current: bool = True,
        end_offsets: Mapping[int, int] | None = None,
        mirror_of: int | None = None,
        expected_version: int | None = None,
    ) -> TopicMetadata:
        """Add an epoch on ``cluster``; by default seal the current one (end offsets from the backend)."""
        body: dict[str, Any] = {
            "cluster": cluster,
            "shards": shards,
            "state": state,
            "seal_current": seal_current,
            "mirror_of": mirror_of,
            "expected_version": expected_version,
        }
        if end_offsets is not None:
            body["end_offsets"] = {str(k): v for k, v in end_offsets.items()}
        return TopicMetadata.model_validate(
            self.request("POST", f"/v1/vclusters/{vc}/topics/{name}/epochs", json=body)
        )

    def update_epoch(
        self,
        vc: str,
        name: str,
        number: int,
        state: str,
        end_offsets: Mapping[int, int] | None = None,
        expected_version: int | None = None,
    ) -> TopicMetadata:
        body: dict[str, Any] = {"state": state, "expected_version": expected_version}
        if end_offsets is not None:
            body["end_offsets"] = {str(k): v for k, v in end_offsets.items()}
        return TopicMetadata.model_validate(
            self.request("PATCH", f"/v1/vclusters/{vc}/topics/{name}/epochs/{number}", json=body)
        )

    def reconcile(
        self, grace_s: float | None = None, delete_orphans: bool = False
    ) -> dict[str, Any]:
        result: dict[str, Any] = self.request(
            "POST",
            "/v1/admin/reconcile",
            params={"grace_s": grace_s, "delete_orphans": delete_orphans},
        )
        return result

    # ---- clients registry -------------------------------------------------------------------

    def register_client(
        self,
        vc: str,
        client_id: str,
        kind: str,
        topics: list[str],
        host: str = "",
        ttl_s: float | None = None,
    ) -> dict[str, Any]:
        body = {"kind": kind, "topics": topics, "host": host, "ttl_s": ttl_s}
        result: dict[str, Any] = self.request(
            "PUT", f"/v1/vclusters/{vc}/clients/{client_id}", json=body
        )
        return result

    def heartbeat(self, vc: str, client_id: str, versions: Mapping[str, int]) -> dict[str, Any]:
        result: dict[str, Any] = self.request(
            "POST",
            f"/v1/vclusters/{vc}/clients/{client_id}/heartbeat",
            json={"versions": dict(versions)},
        )
        return result

    def unacknowledged(self, vc: str, topic: str) -> dict[str, Any]:
        result: dict[str, Any] = self.request(
            "GET", f"/v1/vclusters/{vc}/topics/{topic}/unacknowledged"
        )
        return result
