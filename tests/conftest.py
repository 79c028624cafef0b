"""Real services for the whole suite, started once per session when they are not already running.

Where a Docker engine answers, MySQL, ZooKeeper and Kafka come from containers
(``containers.py``: real Apache Kafka for the contract suite).  Otherwise each
fixture calls the one function of ``xinfra.services`` that knows how to start
its service; ``xinfra up`` calls the same functions.  The run's header says
which.  Nothing here is a mock: a test that needs ZooKeeper gets a ZooKeeper
server.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from containers import (
    engine_missing,
    kafka_container,
    mysql_container,
    source,
    zookeeper_container,
)

from xinfra.services.kafka import start_kafka
from xinfra.services.mysql import MysqlServer, ensure_mysql
from xinfra.services.redis import ensure_redis
from xinfra.services.zookeeper import start_zookeeper


@pytest.fixture(scope="session")
def services_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("services")


@pytest.fixture(scope="session")
def zookeeper(services_dir: Path) -> Iterator[str]:
    """A ZooKeeper connect string (``host:port``); ``XINFRA_TEST_ZOOKEEPER`` reuses a running one."""
    if existing := os.environ.get("XINFRA_TEST_ZOOKEEPER"):
        yield existing
        return
    if engine_missing() is None:
        with zookeeper_container() as connect:
            yield connect
        return
    process = start_zookeeper(services_dir / "zookeeper")
    yield process.url
    process.stop()


@pytest.fixture(scope="session")
def kafka_bootstrap(services_dir: Path) -> Iterator[str]:
    """The bootstrap ``host:port`` of a real Kafka-protocol broker: Apache Kafka, or tansu."""
    if engine_missing() is None:
        with kafka_container() as bootstrap:
            yield bootstrap
        return
    process = start_kafka(services_dir / "kafka")
    yield process.url
    process.stop()


@pytest.fixture(scope="session")
def mysql_server(services_dir: Path) -> Iterator[MysqlServer]:
    if engine_missing() is None:
        with mysql_container() as container:
            yield container
        return
    server = ensure_mysql(services_dir)
    yield server
    server.stop()


@pytest.fixture
def mysql_url(mysql_server: MysqlServer) -> Iterator[str]:
    """A SQLAlchemy URL to a fresh, empty MySQL database of this test's own."""
    name = f"xinfra_test_{uuid.uuid4().hex[:12]}"
    yield mysql_server.create_database(name)
    mysql_server.drop_database(name)


@pytest.fixture(scope="session")
def redis_url(services_dir: Path) -> Iterator[str]:
    url, process = ensure_redis(services_dir)
    yield url
    if process is not None:
        process.stop()


def pytest_report_header() -> str:
    return source()
