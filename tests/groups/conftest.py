"""Fixtures of the consumer-group tests: a service (ZooKeeper-coordinated) over real tansu."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from groups_harness import ThreadService, group_config, register_kafka

from metadata_service import ServiceConfig
from metadata_service.migrate import upgrade_database


@pytest.fixture
def zk_root() -> str:
    return f"/xinfra-groups-test/{uuid.uuid4().hex}"


@pytest.fixture
def make_config(
    mysql_url: str, tmp_path: Path, zookeeper: str, zk_root: str
) -> Callable[..., ServiceConfig]:
    upgrade_database(mysql_url)  # once, before instances start side by side

    def make(**overrides: Any) -> ServiceConfig:
        values: dict[str, Any] = {
            "zookeeper": zookeeper,
            "zk_root": zk_root,
            "instance_id": uuid.uuid4().hex[:12],
            "auto_upgrade": False,
        }
        values.update(overrides)
        return group_config(mysql_url, tmp_path / "run", **values)

    return make


@pytest.fixture
def service(make_config: Callable[..., ServiceConfig]) -> Iterator[ThreadService]:
    instance = ThreadService(make_config()).start()
    yield instance
    instance.stop()


@pytest.fixture
def kafka(service: ThreadService, kafka_bootstrap: str) -> str:
    """The session's tansu, registered as physical cluster ``kafka``."""
    register_kafka(service.url, kafka_bootstrap)
    return "kafka"
