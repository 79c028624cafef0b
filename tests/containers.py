"""Where the suite's services come from: containers when a Docker engine answers, else local processes.

With an engine (``testcontainers``), MySQL, ZooKeeper, Apache Kafka (Confluent's
community image, KRaft) and Couchbase each run in a container, so the backend
contract and every Kafka test run against real Apache Kafka and the Couchbase
adapter against a real server.  Without one (this project's CI machine) each
fixture starts the local process ``xinfra up`` uses (MariaDB, ZooKeeper from
PySpark's jars, tansu) and Couchbase skips loudly.  The header of every run
says which source each service came from and why.

``XINFRA_TEST_CONTAINERS``: ``auto`` (default: containers when an engine
answers), ``never`` (local processes), ``always`` (fail when no engine answers).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Final

import httpx

from xinfra.services.mysql import MysqlServer
from xinfra.services.zookeeper import zookeeper_ok

MYSQL_IMAGE: Final = "mysql:8.4"
ZOOKEEPER_IMAGE: Final = "zookeeper:3.9"
KAFKA_IMAGE: Final = "confluentinc/cp-kafka:7.6.0"
"""Apache Kafka as Confluent's community image ships it; testcontainers' KafkaContainer drives it."""
COUCHBASE_IMAGE: Final = "couchbase/server:community-7.6.2"
COUCHBASE_BUCKET: Final = "xinfra"
COUCHBASE_USER: Final = "Administrator"
COUCHBASE_PASSWORD: Final = "xinfra-test"
START_TIMEOUT_S: Final = 180.0


@functools.cache
def engine_missing() -> str | None:
    """Why containers are not used (None: they are); asked once per run."""
    mode = os.environ.get("XINFRA_TEST_CONTAINERS", "auto")
    if mode not in ("auto", "never", "always"):
        raise RuntimeError(f"XINFRA_TEST_CONTAINERS={mode!r}: use auto, never or always")
    if mode == "never":
        return "XINFRA_TEST_CONTAINERS=never"
    try:
        from testcontainers.core.docker_client import DockerClient

        DockerClient().client.ping()
    except Exception as error:  # no SDK, no socket, no daemon: all mean "no engine"
        reason = f"no Docker engine answers ({type(error).__name__}: {str(error)[:160]})"
        if mode == "always":
            raise RuntimeError(f"XINFRA_TEST_CONTAINERS=always but {reason}") from error
        return reason
    return None


def source() -> str:
    """One line for the run's header: where the services come from."""
    missing = engine_missing()
    if missing is None:
        return "services: containers (testcontainers): MySQL, ZooKeeper, Apache Kafka, Couchbase"
    return (
        "services: local processes (MariaDB, ZooKeeper from PySpark's jars, tansu 0.6.0); "
        f"Couchbase skips; why: {missing}"
    )


KAFKA_IS_TANSU: Final = engine_missing() is not None
"""The Kafka-protocol broker of the run is tansu: its known deviations are expected failures."""


@contextmanager
def mysql_container() -> Iterator[MysqlServer]:
    from testcontainers.mysql import MySqlContainer

    with MySqlContainer(MYSQL_IMAGE, username="root", password="xinfra-test") as container:
        yield MysqlServer(
            host=container.get_container_host_ip(),
            port=int(container.get_exposed_port(3306)),
            user="root",
            password="xinfra-test",
        )


@contextmanager
def zookeeper_container() -> Iterator[str]:
    from testcontainers.core.container import DockerContainer

    with DockerContainer(ZOOKEEPER_IMAGE).with_exposed_ports(2181) as container:
        host = container.get_container_host_ip()
        port = int(container.get_exposed_port(2181))
        _wait(lambda: zookeeper_ok(host, port), f"ZooKeeper container at {host}:{port}")
        yield f"{host}:{port}"


@contextmanager
def kafka_container() -> Iterator[str]:
    from testcontainers.kafka import KafkaContainer

    with KafkaContainer(KAFKA_IMAGE).with_kraft() as container:
        yield container.get_bootstrap_server()


@contextmanager
def couchbase_container() -> Iterator[str]:
    """A one-node Couchbase with the data service and one bucket; yields its ``couchbase://`` URL.

    The node is initialised through its REST API as the image's documentation
    describes (services, credentials, then the bucket), since the image starts
    uninitialised.
    """
    from testcontainers.core.container import DockerContainer

    ports = (8091, 8092, 8093, 8094, 11210)
    with DockerContainer(COUCHBASE_IMAGE).with_exposed_ports(*ports) as container:
        host = container.get_container_host_ip()
        mgmt = container.get_exposed_port(8091)
        kv = container.get_exposed_port(11210)
        rest = f"http://{host}:{mgmt}"
        _wait(lambda: _answers(f"{rest}/ui/index.html"), f"Couchbase REST at {rest}")
        auth = (COUCHBASE_USER, COUCHBASE_PASSWORD)
        with httpx.Client(timeout=30) as http:
            http.post(f"{rest}/node/controller/setupServices", data={"services": "kv"})
            http.post(
                f"{rest}/settings/web",
                data={"username": COUCHBASE_USER, "password": COUCHBASE_PASSWORD, "port": "SAME"},
            ).raise_for_status()
            # Clients outside the container reach the node through the mapped ports: publish
            # them as its external addresses, which the SDK picks when bootstrapped through them.
            http.put(
                f"{rest}/node/controller/setupAlternateAddresses/external",
                auth=auth,
                data={"hostname": host, "mgmt": str(mgmt), "kv": str(kv)},
            ).raise_for_status()
            http.post(
                f"{rest}/pools/default/buckets",
                auth=auth,
                data={"name": COUCHBASE_BUCKET, "ramQuota": "128", "bucketType": "couchbase"},
            ).raise_for_status()
            _wait(
                lambda: (
                    http.get(
                        f"{rest}/pools/default/buckets/{COUCHBASE_BUCKET}", auth=auth
                    ).is_success
                ),
                "the Couchbase bucket",
            )
        yield (
            f"couchbase://{host}:{kv}/{COUCHBASE_BUCKET}"
            f"?username={COUCHBASE_USER}&password={COUCHBASE_PASSWORD}"
        )


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code < 500
    except httpx.HTTPError:
        return False


def _wait(ready: Any, what: str) -> None:
    """Poll ``ready`` until it is true; fail naming ``what`` after ``START_TIMEOUT_S``."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not become ready within {START_TIMEOUT_S:.0f} s")
        time.sleep(0.5)
