"""Fixtures of the Northguard tests: a real broker process for the session, private ones per test."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from ng_harness import backend_for, mounted_tmpfs

from backends.northguard.backend import NorthguardBackend
from backends.northguard.launcher import (
    NorthguardProcess,
    start_northguard_broker,
    start_northguard_cluster,
)


@pytest.fixture(scope="session")
def northguard_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NorthguardProcess]:
    """One broker process (fps store) on a free port for the whole session."""
    process = start_northguard_broker(tmp_path_factory.mktemp("ng-session") / "data")
    yield process
    process.stop()


@pytest.fixture
def ng_address(northguard_process: NorthguardProcess) -> str:
    return northguard_process.url


@pytest.fixture
async def ng_backend(ng_address: str) -> AsyncIterator[NorthguardBackend]:
    backend = backend_for(ng_address)
    yield backend
    await backend.close()


@pytest.fixture
def private_broker(tmp_path: Path) -> Iterator[NorthguardProcess]:
    """A broker process of this test alone (it may kill, corrupt or restart it)."""
    process = start_northguard_broker(tmp_path / "data")
    yield process
    process.stop()


@pytest.fixture
def clusters(tmp_path: Path) -> Iterator[Callable[..., list[NorthguardProcess]]]:
    """Start clusters of this test (``start_northguard_cluster`` arguments); all stopped after."""
    started: list[NorthguardProcess] = []

    def start(count: int, **arguments: Any) -> list[NorthguardProcess]:
        processes = start_northguard_cluster(
            tmp_path / f"cluster-{len(started)}", count, **arguments
        )
        started.extend(processes)
        return processes

    yield start
    for process in reversed(started):
        process.stop()


@pytest.fixture
def topic_name() -> str:
    return f"ng-{uuid.uuid4().hex[:12]}"


SMALL_DISK_BYTES = 2 << 20


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs of this test: a data directory that really runs out of space."""
    with mounted_tmpfs(tmp_path / "small-disk", SMALL_DISK_BYTES) as path:
        yield path
