"""Helpers of the consumer-group tests: service instances on real MariaDB, ZooKeeper and tansu.

``ThreadService`` runs one instance under uvicorn in a thread of the test
process; ``ProcessService`` runs one as a subprocess (``groups_serve.py``) so
a test can SIGKILL it.  Both advertise their URL, so group requests that
reach the wrong instance are redirected to the coordinator.  Waiting is
``waiting.wait_until`` (a condition against a deadline, never a bare sleep).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from metadata_service import ServiceConfig, create_app
from xinfra.services.ports import free_port

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
ADMIN_TOKEN = "groups-admin-" + uuid.uuid4().hex
VC = "default"
HEADERS = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def group_config(database_url: str, run_dir: Path, **overrides: Any) -> ServiceConfig:
    """Short sessions so that expiry and failover tests take seconds; real backends."""
    base = ServiceConfig(
        database_url=database_url,
        zookeeper=None,
        run_dir=run_dir,
        admin_token=ADMIN_TOKEN,
        client_purge_interval_s=0.5,
        backend_timeout_s=15.0,
        long_poll_s_max=5.0,
        group_session_s=6.0,
        group_heartbeat_s=0.1,
        group_zk_session_s=10.0,
    )
    return replace(base, **overrides)


class Deadline:
    """``check()`` fails the test once ``timeout_s`` has passed: bounds every consuming loop."""

    def __init__(self, timeout_s: float, what: str) -> None:
        self.end = time.monotonic() + timeout_s
        self.what = what

    def check(self) -> None:
        assert time.monotonic() < self.end, f"timed out: {self.what}"


@dataclass
class ThreadService:
    config: ServiceConfig
    port: int = field(default_factory=free_port)
    _server: uvicorn.Server | None = None
    _thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ThreadService:
        config = replace(self.config, advertised_url=self.url)
        self._server = uvicorn.Server(
            uvicorn.Config(
                create_app(config),
                host="127.0.0.1",
                port=self.port,
                log_level="warning",
                timeout_graceful_shutdown=1,
            )
        )
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            assert self._thread.is_alive() and time.monotonic() < deadline, "did not start"
            time.sleep(0.02)
        return self

    @property
    def app_state(self) -> Any:
        assert self._server is not None
        return self._server.config.app.state  # type: ignore[union-attr]

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            assert self._thread is not None
            self._thread.join(15)
            self._server = None


@dataclass
class ProcessService:
    """One instance in its own process (``groups_serve.py``), for SIGKILL."""

    config: ServiceConfig
    log_path: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ProcessService:
        settings = {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in asdict(replace(self.config, advertised_url=self.url)).items()
            if k != "backend_factory"
        }
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT)])}
        self.process = subprocess.Popen(
            [sys.executable, str(HERE / "groups_serve.py"), str(self.port), json.dumps(settings)],
            stdout=self.log_path.open("ab"),
            stderr=subprocess.STDOUT,
            env=env,
        )
        deadline = time.monotonic() + 60
        while True:
            assert self.process.poll() is None, self.log_path.read_text()[-3000:]
            try:
                if httpx.get(f"{self.url}/ready", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "instance did not become ready"
            time.sleep(0.05)

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)


def register_kafka(url: str, bootstrap: str) -> None:
    """Register ``bootstrap`` as physical cluster ``kafka`` (again: a no-op)."""
    response = httpx.post(
        f"{url}/v1/clusters",
        json={"name": "kafka", "kind": "kafka", "bootstrap": bootstrap},
        headers=HEADERS,
        timeout=30,
    )
    assert response.status_code in (201, 409), response.text


def create_topic(url: str, name: str, shards: int, cluster: str = "kafka") -> dict[str, Any]:
    """A virtual topic through the REST API; its metadata body."""
    response = httpx.post(
        f"{url}/v1/vclusters/{VC}/topics",
        json={"name": name, "cluster": cluster, "shards": shards},
        headers=HEADERS,
        timeout=60,
    )
    assert response.status_code == 201, response.text
    body: dict[str, Any] = response.json()
    return body
