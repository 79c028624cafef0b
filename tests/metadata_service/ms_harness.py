"""The metadata service under test: an app on real MariaDB, reached through httpx's ASGI transport.

Shared by conftest.py and the test modules under a name of its own
(conftest modules all share the name ``conftest``, so tests never import them).
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI

from metadata_service import ServiceConfig, create_app
from xinfra.services.ports import free_port
from xinfra.services.process import ManagedProcess

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

ADMIN_TOKEN = "test-admin-" + uuid.uuid4().hex


def admin_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@dataclass
class Service:
    app: FastAPI
    http: httpx.AsyncClient
    config: ServiceConfig

    async def ok(self, method: str, url: str, status: int = 200, **kwargs: Any) -> Any:
        response = await self.http.request(method, url, **kwargs)
        assert response.status_code == status, (response.status_code, response.text)
        return response.json() if response.content else None


@asynccontextmanager
async def running(config: ServiceConfig) -> AsyncIterator[Service]:
    app = create_app(config)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://service", headers=admin_headers(), timeout=60
        ) as http:
            yield Service(app, http, config)


def start_instance(
    run_dir: Path,
    name: str,
    database_url: str,
    zookeeper: str | None = None,
    **overrides: Any,
) -> ManagedProcess:
    """One service instance as a real process (``ms_serve_instance.py``), ready when it returns.

    ``overrides`` are ``ServiceConfig`` fields (and ``backend="real"``).  Start
    the returned process again to restart the instance on the same port.
    """
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT)])}
    process = ManagedProcess(
        name=name,
        argv=[
            sys.executable,
            str(HERE / "ms_serve_instance.py"),
            str(port),
            database_url,
            zookeeper or "-",
            ADMIN_TOKEN,
            str(run_dir / name),
            json.dumps(overrides),
        ],
        log_path=run_dir / f"{name}.log",
        url=f"http://127.0.0.1:{port}",
        env=env,
    )
    return restart(process)


def restart(process: ManagedProcess) -> ManagedProcess:
    """Start (again) and wait until the instance answers /ready."""

    def healthy() -> bool:
        try:
            return httpx.get(f"{process.url}/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    return process.start().wait_ready(healthy, timeout_s=60)
