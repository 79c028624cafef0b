"""One contract for every checkpoint cache adapter that can run here.

Couchbase runs against ``XINFRA_TEST_COUCHBASE`` when it is set, else in a
container where a Docker engine answers (``tests/containers.py``), else
against ``couchbase://127.0.0.1/xinfra`` when a server answers there, and
skips loudly otherwise (this project's CI machine has none of them).
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import AsyncIterator, Iterator
from urllib.parse import urlsplit

import pytest
from containers import couchbase_container, engine_missing

from metadata_service.checkpoints.cache import CheckpointCache, MemoryCache, RedisCache

COUCHBASE_URL = os.environ.get("XINFRA_TEST_COUCHBASE", "couchbase://127.0.0.1/xinfra")


@pytest.fixture(scope="session")
def couchbase_url() -> Iterator[str]:
    if "XINFRA_TEST_COUCHBASE" not in os.environ and engine_missing() is None:
        with couchbase_container() as url:
            yield url
        return
    yield COUCHBASE_URL


def couchbase_cache(url: str) -> CheckpointCache:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 11210
    try:  # the SDK waits seconds for a server that is not there: ask the port first
        socket.create_connection((host, port), timeout=1).close()
    except OSError as error:
        pytest.skip(
            f"SKIPPED LOUDLY: no Couchbase server answers at {url} ({error}); "
            "set XINFRA_TEST_COUCHBASE to run the Couchbase adapter's contract"
        )
    try:
        from metadata_service.checkpoints.couchbase_cache import CouchbaseCache

        return CouchbaseCache.from_url(url)
    except Exception as error:  # no SDK, no server: say so, loudly
        pytest.skip(
            f"SKIPPED LOUDLY: no Couchbase server answers at {url} ({type(error).__name__}: "
            f"{str(error)[:200]}); set XINFRA_TEST_COUCHBASE to run the Couchbase adapter's contract"
        )


@pytest.fixture(params=["memory", "redis", "couchbase"])
async def cache(request: pytest.FixtureRequest, redis_url: str) -> AsyncIterator[CheckpointCache]:
    adapter: CheckpointCache
    if request.param == "memory":
        adapter = MemoryCache()
    elif request.param == "redis":
        adapter = RedisCache(redis_url, prefix=f"contract-{uuid.uuid4().hex[:8]}")
    else:
        adapter = couchbase_cache(request.getfixturevalue("couchbase_url"))
    yield adapter
    await adapter.close()


async def test_contract(cache: CheckpointCache) -> None:
    key = ("default", f"g-{uuid.uuid4().hex[:8]}")
    assert await cache.get_group(key) is None
    # A write-through before any fill leaves the entry incomplete: still a miss.
    await cache.put({key: {("t", 0, 0): 5}})
    assert await cache.get_group(key) is None
    # A fill never overwrites what a flush wrote, and completes the entry.
    await cache.fill_group(key, {("t", 0, 0): 1, ("t", 0, 1): 2})
    assert await cache.get_group(key) == {("t", 0, 0): 5, ("t", 0, 1): 2}
    # Write-throughs overwrite; topic names with dots and dashes survive the field encoding.
    await cache.put({key: {("t", 0, 1): 3, ("a.b-c", 2, 7): 9}})
    assert await cache.get_group(key) == {("t", 0, 0): 5, ("t", 0, 1): 3, ("a.b-c", 2, 7): 9}
    await cache.drop_group(key)
    assert await cache.get_group(key) is None
