"""The live service, tansu and a Northguard broker: the fixtures of ``tests/clients``, imported.

``tests/clients/conftest.py`` is loaded under its own name and its fixtures
re-exported, so both folders run the same service over the same brokers.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

_CLIENTS = Path(__file__).resolve().parent.parent / "clients"
if str(_CLIENTS) not in sys.path:
    sys.path.insert(0, str(_CLIENTS))

from sdk_live import NORTHGUARD_MISSING, LiveService  # noqa: E402  (needs the path above)

_spec = importlib.util.spec_from_file_location("tests_clients_conftest", _CLIENTS / "conftest.py")
assert _spec is not None and _spec.loader is not None
_clients_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_clients_conftest)

service_config = _clients_conftest.service_config
live = _clients_conftest.live
kafka = _clients_conftest.kafka
second_kafka = _clients_conftest.second_kafka
northguard = _clients_conftest.northguard
tansu_deviations = _clients_conftest.tansu_deviations
xfail_on = _clients_conftest.xfail_on


@pytest.fixture
def second_northguard(live: LiveService, tmp_path: Path) -> Iterator[str]:
    """A second Northguard broker registered as ``northguard2``: a cluster of its own."""
    if NORTHGUARD_MISSING is not None:
        pytest.skip(f"SKIPPED LOUDLY: {NORTHGUARD_MISSING}")
    launcher = importlib.import_module("backends.northguard.launcher")
    process = launcher.start_northguard(tmp_path / "northguard2")
    try:
        live.register_cluster("northguard2", "northguard", process.url)
        yield "northguard2"
    finally:
        process.stop()
