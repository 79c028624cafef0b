"""Helpers of the SDK tests: a live metadata service, skip markers, bounded waits.

The service runs under uvicorn in a thread on real MariaDB, with the real
backends from the ``xinfra.backends`` entry points; the SDK reaches it over
HTTP exactly as an application would.  ``LiveService.restart()`` stops and
starts it on the same port (same database) to show clients ride through.
"""

from __future__ import annotations

import asyncio
import importlib
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest
import uvicorn

from metadata_service import ServiceConfig, create_app
from xinfra.model import ClusterKind, PhysicalCluster, TopicMetadata
from xinfra.rest import MetadataClient
from xinfra.services.ports import free_port

T = TypeVar("T")
ADMIN_TOKEN = "sdk-admin-" + uuid.uuid4().hex
VC = "default"
NORTHGUARD_SECRET = "sdk-northguard-secret-0123456789abcdef"
"""The cluster secret of ``secured_broker`` (conftest): the tests verify credentials with it."""


def _importable(module: str) -> str | None:
    """None when the module imports, else why not."""
    try:
        importlib.import_module(module)
    except ImportError as error:
        return f"{module} cannot be imported yet ({error})"
    return None


KAFKA_MISSING = _importable("backends.kafka.backend")
NORTHGUARD_MISSING = _importable("backends.northguard.backend")

needs_kafka = pytest.mark.skipif(
    KAFKA_MISSING is not None,
    reason=f"SKIPPED LOUDLY: {KAFKA_MISSING}; SDK tests on Kafka wait for the Kafka backend",
)
needs_northguard = pytest.mark.skipif(
    NORTHGUARD_MISSING is not None,
    reason=f"SKIPPED LOUDLY: {NORTHGUARD_MISSING}; SDK tests on Northguard wait for it",
)


@dataclass
class LiveService:
    """One metadata service instance under uvicorn in a thread; restartable on its port."""

    config: ServiceConfig
    port: int = field(default_factory=free_port)
    _server: uvicorn.Server | None = None
    _thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        assert self._server is None, "already running"
        server = uvicorn.Server(
            uvicorn.Config(
                create_app(self.config),
                host="127.0.0.1",
                port=self.port,
                log_level="warning",
                timeout_graceful_shutdown=1,
            )
        )
        thread = threading.Thread(target=server.run, name="metadata-service", daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive(), "the metadata service thread died at start"
            assert time.monotonic() < deadline, "the metadata service did not start in 30 s"
            time.sleep(0.02)
        self._server, self._thread = server, thread

    def stop(self) -> None:
        if self._server is None or self._thread is None:
            return
        self._server.should_exit = True
        self._thread.join(15)
        assert not self._thread.is_alive(), "the metadata service did not stop in 15 s"
        self._server = self._thread = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def admin(self) -> MetadataClient:
        return MetadataClient(self.url, token=ADMIN_TOKEN, timeout_s=60)

    def register_cluster(
        self, name: str, kind: str, bootstrap: str, attributes: dict[str, str] | None = None
    ) -> str:
        """Register a physical cluster (the service checks it answers); its name."""
        cluster = PhysicalCluster(
            name=name, kind=ClusterKind(kind), bootstrap=bootstrap, attributes=attributes or {}
        )
        with self.admin() as client:
            client.register_cluster(cluster)
        return name

    async def call(self, function: Callable[[MetadataClient], T]) -> T:
        """Run a blocking admin call off the event loop (an epoch change waits for our producers)."""

        def run() -> T:
            with self.admin() as client:
                return function(client)

        return await asyncio.to_thread(run)

    async def create_topic(self, name: str, cluster: str, shards: int) -> TopicMetadata:
        return await self.call(lambda c: c.create_topic(VC, name, cluster, shards))

    async def add_epoch(self, topic: str, cluster: str) -> TopicMetadata:
        """Seal the current epoch (two-phase) and add one on ``cluster``; returns the final metadata."""
        return await self.call(lambda c: c.add_epoch(VC, topic, cluster))

    async def metadata(self, topic: str) -> TopicMetadata:
        return await self.call(lambda c: c.topic_metadata(VC, topic))

    async def client_token(self, name: str) -> str:
        body = await self.call(
            lambda c: c.request(
                "POST", "/v1/tokens", json={"name": name, "role": "client", "scope": VC}
            )
        )
        return str(body["token"])

    async def revoke_token(self, name: str) -> None:
        await self.call(lambda c: c.request("DELETE", f"/v1/tokens/{name}"))


async def read_all(consumer: Any, expected: int, timeout_s: float = 60.0) -> list[Any]:
    """Poll until ``expected`` records arrived (fail after ``timeout_s``), then a short drain."""
    out: list[Any] = []
    deadline = time.monotonic() + timeout_s
    while len(out) < expected:
        assert time.monotonic() < deadline, (
            f"read {len(out)} of {expected} records in {timeout_s} s"
        )
        out.extend(await consumer.poll(1000, timeout_s=0.5))
    out.extend(await consumer.poll(1000, timeout_s=0.3))  # anything extra is a duplicate
    return out


def keyed_value(key: int, seq: int) -> bytes:
    return f"k{key}:{seq}".encode()


def parse_keyed(value: bytes | None) -> tuple[int, int]:
    assert value is not None
    key, seq = value.decode().split(":")
    return int(key[1:]), int(seq)


def assert_per_key_order(values: list[bytes | None]) -> None:
    """Each key's sequence numbers appear in increasing order (at-least-once: a retried record may
    repeat right after itself, never before an older one)."""
    last: dict[int, int] = {}
    for value in values:
        key, seq = parse_keyed(value)
        assert seq >= last.get(key, -1), f"key {key}: {seq} after {last[key]}"
        last[key] = seq


def assert_exactly_once(values: list[bytes | None], expected: set[bytes]) -> None:
    counts: dict[bytes | None, int] = {}
    for value in values:
        counts[value] = counts.get(value, 0) + 1
    duplicates = {v: n for v, n in counts.items() if n > 1}
    assert not duplicates, f"{len(duplicates)} records delivered more than once"
    missing = expected - set(counts)
    assert not missing, f"{len(missing)} records lost, e.g. {sorted(missing)[:5]}"
    extra = set(counts) - expected
    assert not extra, f"{len(extra)} unexpected records, e.g. {sorted(extra)[:5]}"  # type: ignore[type-var]
