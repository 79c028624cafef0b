"""Several service instances sharing MariaDB and ZooKeeper: a change on one wakes long-polls
on the others; one killed with SIGKILL, the other keeps serving."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import httpx
import pytest
from ms_harness import Service, admin_headers, running, start_instance
from test_ms_api import VC, create_topic, race_updates, register, wait_for

from metadata_service import ServiceConfig
from xinfra.services.process import ManagedProcess

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


async def test_change_on_one_instance_wakes_long_poll_on_another(
    make_config: Callable[..., ServiceConfig], zookeeper: str, bootstrap: str
) -> None:
    async with two_services(make_config, zookeeper) as (a, b):
        assert (await b.ok("GET", "/ready"))["notifier"] == "ZooKeeperNotifier"
        await register(a, bootstrap)
        await create_topic(a)
        url = f"/v1/vclusters/{VC}/topics/orders/metadata"
        assert (await b.ok("GET", url))["version"] == 1  # now cached on b
        for version in (2, 3, 4):
            poll = asyncio.create_task(
                b.http.get(url, params={"after_version": version - 1, "timeout_s": 30})
            )
            await wait_for(lambda: _has_waiter(b))
            await a.ok(
                "PATCH", f"/v1/vclusters/{VC}/topics/orders", json={"config": {"v": str(version)}}
            )
            response = await asyncio.wait_for(poll, 10)
            assert response.json()["version"] == version
            assert response.json()["topic"]["config"] == {"v": str(version)}
        # b's cache was invalidated too: a plain read is current.
        assert (await b.ok("GET", url))["version"] == 4
        received = (await b.http.get("/metrics")).text
        assert "xinfra_metadata_notifications_received_total" in received


async def test_racing_updates_through_two_instances_one_wins(
    make_config: Callable[..., ServiceConfig], zookeeper: str, bootstrap: str
) -> None:
    """Optimistic concurrency holds across instances: the version check is MySQL's, not a lock's."""
    async with two_services(make_config, zookeeper) as (a, b):
        await register(a, bootstrap)
        await create_topic(a)
        await race_updates([a, b])


@contextlib.asynccontextmanager
async def two_services(
    make_config: Callable[..., ServiceConfig], zookeeper: str
) -> AsyncIterator[tuple[Service, Service]]:
    """Two in-process instances on one database and one ZooKeeper root."""
    root = f"/xinfra-test/{uuid.uuid4().hex}"
    async with (
        running(make_config(zookeeper=zookeeper, zk_root=root)) as a,
        running(make_config(zookeeper=zookeeper, zk_root=root)) as b,
    ):
        yield a, b


async def _has_waiter(service) -> bool:  # type: ignore[no-untyped-def]
    return bool(service.app.state.services.runtime.hub.waiter_count)


@pytest.fixture
def two_instances(
    tmp_path: Path, mysql_url: str, zookeeper: str
) -> Iterator[tuple[ManagedProcess, ManagedProcess]]:
    from metadata_service.migrate import upgrade_database

    upgrade_database(mysql_url)  # once, before two instances start side by side
    first = start_instance(tmp_path, "a", mysql_url, zookeeper)
    try:
        second = start_instance(tmp_path, "b", mysql_url, zookeeper)
    except BaseException:
        first.stop()
        raise
    yield first, second
    first.stop()
    second.stop()


async def test_instance_killed_other_keeps_serving(
    two_instances: tuple[ManagedProcess, ManagedProcess],
) -> None:
    first, second = two_instances
    async with (
        httpx.AsyncClient(base_url=first.url, headers=admin_headers(), timeout=30) as a,
        httpx.AsyncClient(base_url=second.url, headers=admin_headers(), timeout=30) as b,
    ):
        bootstrap = f"memory-{uuid.uuid4().hex[:8]}:9092"
        response = await a.post(
            "/v1/clusters", json={"name": "k1", "kind": "kafka", "bootstrap": bootstrap}
        )
        assert response.status_code == 201, response.text
        response = await a.post(
            f"/v1/vclusters/{VC}/topics", json={"name": "t", "cluster": "k1", "shards": 2}
        )
        assert response.status_code == 201, response.text
        url = f"/v1/vclusters/{VC}/topics/t/metadata"
        assert (await b.get(url)).json()["version"] == 1
        poll = asyncio.create_task(b.get(url, params={"after_version": 1, "timeout_s": 30}))
        await _wait_waiters(b)
        assert (
            await a.patch(f"/v1/vclusters/{VC}/topics/t", json={"config": {"x": "1"}})
        ).status_code == 200
        assert (await asyncio.wait_for(poll, 10)).json()["version"] == 2

        first.kill()
        assert (await b.get("/ready")).status_code == 200
        poll = asyncio.create_task(b.get(url, params={"after_version": 2, "timeout_s": 30}))
        await _wait_waiters(b)
        assert (
            await b.patch(f"/v1/vclusters/{VC}/topics/t", json={"config": {"x": "2"}})
        ).status_code == 200
        assert (await asyncio.wait_for(poll, 10)).json()["version"] == 3
        assert (await b.get(f"/v1/vclusters/{VC}/topics")).json()["topics"][0]["version"] == 3


async def _wait_waiters(http: httpx.AsyncClient) -> None:
    async def waiting() -> bool:
        text = (await http.get("/metrics")).text
        return any(
            line.startswith("xinfra_metadata_long_poll_waiters ") and float(line.split()[1]) >= 1
            for line in text.splitlines()
        )

    await wait_for(waiting)
