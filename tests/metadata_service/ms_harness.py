"""The metadata service under test: an app on real MariaDB, reached through httpx's ASGI transport.

Shared by conftest.py and the test modules under a name of its own
(conftest modules all share the name ``conftest``, so tests never import them).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI

from metadata_service import ServiceConfig, create_app

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
