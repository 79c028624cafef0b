"""The backend contract suite runs once per backend kind: ``backend`` is parametrized.

* ``kafka``: the session's tansu broker (``kafka_bootstrap`` from tests/conftest.py).
* ``northguard``: skipped, loudly, while ``backends.northguard.backend`` cannot
  be imported.  Otherwise its broker comes from ``XINFRA_TEST_NORTHGUARD``
  (a running cluster's bootstrap) or from
  ``backends.northguard.launcher.start_northguard(run_dir)``, which is expected
  to return, like ``xinfra.services.kafka.start_kafka``, an object with
  ``url`` and ``stop()``.

``broker`` starts a private broker of the same kind for a test that stops it
(the broker-down tests); the session broker is never disturbed.
"""

from __future__ import annotations

import importlib
import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from contract_support import Broker, cluster

from xinfra.backend import Backend, open_backend
from xinfra.model import ClusterKind
from xinfra.services.kafka import start_kafka

KINDS = [ClusterKind.KAFKA, ClusterKind.NORTHGUARD]


def _northguard_missing() -> str | None:
    try:
        importlib.import_module("backends.northguard.backend")
    except ImportError as error:
        return (
            f"NORTHGUARD CONTRACT SKIPPED: backends.northguard.backend cannot be imported ({error})"
        )
    return None


def _northguard_starter() -> Callable[[Path], Any]:
    """``start_northguard(run_dir)`` from the launcher; skip loudly when it does not exist."""
    if missing := _northguard_missing():
        pytest.skip(missing)
    try:
        launcher = importlib.import_module("backends.northguard.launcher")
    except ImportError as error:
        pytest.skip(f"NORTHGUARD CONTRACT SKIPPED: no backends.northguard.launcher ({error})")
    start = getattr(launcher, "start_northguard", None)
    if start is None:
        pytest.skip(
            "NORTHGUARD CONTRACT SKIPPED: backends.northguard.launcher has no start_northguard"
        )
    return start  # type: ignore[no-any-return]


@pytest.fixture(scope="session")
def northguard_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if missing := _northguard_missing():
        pytest.skip(missing)
    if existing := os.environ.get("XINFRA_TEST_NORTHGUARD"):
        yield existing
        return
    process = _northguard_starter()(tmp_path_factory.mktemp("northguard"))
    yield process.url
    process.stop()


@pytest.fixture(params=KINDS, ids=[kind.value for kind in KINDS])
def kind(request: pytest.FixtureRequest) -> ClusterKind:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
async def backend(request: pytest.FixtureRequest, kind: ClusterKind) -> AsyncIterator[Backend]:
    fixture = "kafka_bootstrap" if kind is ClusterKind.KAFKA else "northguard_bootstrap"
    bootstrap: str = request.getfixturevalue(fixture)
    opened = open_backend(cluster(kind, bootstrap))
    yield opened
    await opened.close()


@pytest.fixture
def broker(kind: ClusterKind, tmp_path: Path) -> Iterator[Broker]:
    start = start_kafka if kind is ClusterKind.KAFKA else _northguard_starter()
    process = start(tmp_path / "broker")
    yield Broker(kind, process.url, getattr(process, "kill", process.stop))
    process.stop()


@pytest.fixture
def topic_name() -> str:
    return f"contract-{uuid.uuid4().hex[:12]}"
