"""Fixtures for the segment stores: real files in ``tmp_path``; fault injection is in ``store_faults``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from store_faults import FaultyRuntime, StoreFactory

from backends.northguard.runtime import RealRuntime
from backends.northguard.store import FpsStore, MemoryStore, SegmentStore


@pytest.fixture
def faulty_runtime() -> FaultyRuntime:
    return FaultyRuntime()


@pytest.fixture
async def open_fps(tmp_path: Path) -> AsyncIterator[StoreFactory]:
    """``await open_fps(**kwargs)`` opens an FpsStore on ``tmp_path / "data"``; all are closed at the end."""
    opened: list[FpsStore] = []

    async def factory(runtime: RealRuntime | None = None, **kwargs: Any) -> FpsStore:
        store = FpsStore(runtime or RealRuntime(seed=1), tmp_path / "data", **kwargs)
        await store.open()
        opened.append(store)
        return store

    yield factory
    for store in opened:
        await store.close()


@pytest.fixture(params=["fps", "memory"])
async def store(
    request: pytest.FixtureRequest, open_fps: StoreFactory
) -> AsyncIterator[SegmentStore]:
    """Every implementation of the ``SegmentStore`` contract."""
    if request.param == "fps":
        yield await open_fps(group_commit_ms=1.0, index_interval_bytes=256)
        return
    memory = MemoryStore()
    await memory.open()
    yield memory
    await memory.close()
