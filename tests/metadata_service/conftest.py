"""Fixtures for the metadata service: an app on real MariaDB (and ZooKeeper where asked).

``service`` runs the app's lifespan in the test's event loop and talks to it
through httpx's ASGI transport; the physical side is the in-memory backend
until ``backends.kafka`` can be imported (Kafka tests use the real broker).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from ms_harness import ADMIN_TOKEN, Service, running
from ms_memory_backend import MemoryBackend, memory_cluster

from metadata_service import ServiceConfig, create_app
from xinfra.services.ports import free_port
from xinfra.settings import get_settings


@pytest.fixture
def service_config(mysql_url: str, tmp_path: Path) -> ServiceConfig:
    return ServiceConfig(
        database_url=mysql_url,
        zookeeper=None,
        run_dir=tmp_path / "run",
        admin_token=ADMIN_TOKEN,
        backend_factory=MemoryBackend,
        client_purge_interval_s=0.2,
        backend_timeout_s=5.0,
    )


@pytest.fixture
async def service(service_config: ServiceConfig) -> AsyncIterator[Service]:
    async with running(service_config) as svc:
        yield svc


@pytest.fixture
def bootstrap() -> str:
    """A fresh in-memory physical cluster address for this test."""
    address = f"memory-{uuid.uuid4().hex[:8]}:9092"
    memory_cluster(address)
    return address


@pytest.fixture
def make_config(service_config: ServiceConfig) -> Callable[..., ServiceConfig]:
    def make(**overrides: Any) -> ServiceConfig:
        return replace(service_config, instance_id=uuid.uuid4().hex[:12], **overrides)

    return make


@pytest.fixture
def live_url(service_config: ServiceConfig, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(service_config), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    monkeypatch.setenv("XINFRA_METADATA_URL", url)
    monkeypatch.setenv("XINFRA_TOKEN", ADMIN_TOKEN)
    get_settings.cache_clear()
    yield url
    server.should_exit = True
    thread.join(10)
    get_settings.cache_clear()
