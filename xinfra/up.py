"""``xinfra up``: the whole local stack in one command, supervised, stopped cleanly.

The stack is ZooKeeper, the Kafka-protocol broker, the Northguard brokers and
the metadata service with both clusters registered (each part as soon as its
command is installed).  Services that already answer on their configured
address are reused, not started twice.  Every child runs in its own process
group and logs to ``<run_dir>/logs``; a child that dies is restarted with
backoff (at most ``RESTARTS_MAX`` times).  Ctrl-C or SIGTERM stops everything
in reverse order and leaves no process behind.

``xinfra up`` never imports the broker or the service: it starts them through
their own commands (``xinfra northguard broker``, ``xinfra serve``), which keeps
the dependency rule of DESIGN.md §1 and runs each in a process of its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from xinfra.errors import Conflict, XinfraError
from xinfra.model import ClusterKind, PhysicalCluster
from xinfra.rest import ADMIN_TOKEN_FILE, MetadataClient
from xinfra.services.kafka import start_kafka
from xinfra.services.ports import port_open, split_host_port
from xinfra.services.process import ManagedProcess, ServiceError
from xinfra.services.zookeeper import start_zookeeper, zookeeper_ok
from xinfra.settings import Settings

RESTARTS_MAX = 5
SUPERVISE_INTERVAL_S = 0.5


def _xinfra_argv(*args: str) -> list[str]:
    """The argv that runs an ``xinfra`` subcommand with this interpreter."""
    return [sys.executable, "-m", "xinfra.cli", *args]


def http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class Component:
    """One supervised part of the stack: how to start it, how to tell it is healthy."""

    name: str
    url: str
    start: Callable[[], ManagedProcess | None]
    healthy: Callable[[], bool]
    process: ManagedProcess | None = None
    restarts: int = 0
    reused: bool = False


@dataclass
class LocalStack:
    settings: Settings
    installed_commands: set[str]
    progress: Callable[[str], None] = lambda message: None
    components: list[Component] = field(default_factory=list)
    _stopping: threading.Event = field(default_factory=threading.Event)

    @property
    def run_dir(self) -> Path:
        return self.settings.run_dir.resolve()

    @property
    def database_url(self) -> str:
        """The embedded SQLite store lives in the run directory unless a URL was configured."""
        if self.settings.database_url == Settings.model_fields["database_url"].default:
            return f"sqlite:///{self.run_dir / 'metadata.db'}"
        return self.settings.database_url

    @property
    def log_dir(self) -> Path:
        return self.run_dir / "logs"

    def plan(self) -> list[Component]:
        s = self.settings
        zk_host, zk_port = split_host_port(s.zookeeper, 2181)
        kafka_host, kafka_port = split_host_port(s.kafka_bootstrap, 9092)
        components = [
            Component(
                "zookeeper",
                s.zookeeper,
                lambda: start_zookeeper(self.run_dir / "zookeeper", zk_port, log_dir=self.log_dir),
                lambda: zookeeper_ok(zk_host, zk_port),
            ),
            Component(
                "kafka",
                s.kafka_bootstrap,
                lambda: start_kafka(self.log_dir, kafka_port),
                lambda: port_open(kafka_host, kafka_port),
            ),
        ]
        if "northguard" in self.installed_commands:
            ng_host, ng_port = split_host_port(s.northguard_bootstrap, 9470)
            components.append(
                Component(
                    "northguard-0",
                    s.northguard_bootstrap,
                    lambda: self._spawn(
                        "northguard-0",
                        _xinfra_argv(
                            "northguard",
                            "broker",
                            "--id",
                            "0",
                            "--host",
                            ng_host,
                            "--port",
                            str(ng_port),
                            "--data-dir",
                            str(self.run_dir / "northguard" / "0"),
                            "--attr",
                            "rack=r0",
                        ),
                        s.northguard_bootstrap,
                        lambda: port_open(ng_host, ng_port),
                    ),
                    lambda: port_open(ng_host, ng_port),
                )
            )
        if "serve" in self.installed_commands:
            host, port = split_host_port(s.metadata_url.removeprefix("http://"), 8780)
            components.append(
                Component(
                    "metadata-service",
                    s.metadata_url,
                    lambda: self._spawn(
                        "metadata-service",
                        _xinfra_argv("serve", "--host", host, "--port", str(port)),
                        s.metadata_url,
                        lambda: http_ok(f"{s.metadata_url}/health"),
                    ),
                    lambda: http_ok(f"{s.metadata_url}/health"),
                )
            )
        return components

    def _spawn(
        self, name: str, argv: list[str], url: str, ready: Callable[[], bool]
    ) -> ManagedProcess:
        env = {
            **os.environ,
            "XINFRA_RUN_DIR": str(self.run_dir),
            "XINFRA_ZOOKEEPER": self.settings.zookeeper,
            "XINFRA_KAFKA_BOOTSTRAP": self.settings.kafka_bootstrap,
            "XINFRA_NORTHGUARD_BOOTSTRAP": self.settings.northguard_bootstrap,
            "XINFRA_METADATA_URL": self.settings.metadata_url,
            "XINFRA_DATABASE_URL": self.database_url,
        }
        process = ManagedProcess(name, argv, self.log_dir / f"{name}.log", url, env=env)
        return process.start().wait_ready(ready, timeout_s=60)

    def start(self) -> None:
        """Start every component in order; on any failure stop what was started and raise."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            for component in self.plan():
                self.components.append(component)
                if component.healthy():
                    component.reused = True
                    self.progress(
                        f"{component.name}: already running at {component.url}, reusing it"
                    )
                    continue
                self.progress(f"{component.name}: starting")
                component.process = component.start()
                self.progress(f"{component.name}: ready at {component.url}")
        except BaseException:
            self.stop()
            raise

    def register_clusters(self) -> list[str]:
        """Register the local physical clusters with the local service (idempotent); their names."""
        names = {c.name for c in self.components}
        if "metadata-service" not in names:
            return []
        clusters = [
            PhysicalCluster(
                name="kafka-local", kind=ClusterKind.KAFKA, bootstrap=self.settings.kafka_bootstrap
            )
        ]
        if "northguard-0" in names:
            clusters.append(
                PhysicalCluster(
                    name="northguard-local",
                    kind=ClusterKind.NORTHGUARD,
                    bootstrap=self.settings.northguard_bootstrap,
                )
            )
        token = self.settings.token or self.settings.admin_token
        with MetadataClient(token=token, settings=self.settings) as client:
            for cluster in clusters:
                with contextlib.suppress(
                    Conflict
                ):  # registered by an earlier run on this run directory
                    client.register_cluster(cluster)
                self.progress(f"cluster {cluster.name} ({cluster.kind.value}) registered")
        return [c.name for c in clusters]

    def summary(self) -> dict[str, Any]:
        return {
            "run_dir": str(self.run_dir),
            "components": [
                {
                    "name": c.name,
                    "url": c.url,
                    "pid": c.process.pid if c.process else None,
                    "reused": c.reused,
                    "log": str(c.process.log_path) if c.process else None,
                }
                for c in self.components
            ],
        }

    def supervise(self) -> None:
        """Restart dead children with backoff until ``stop`` is requested."""
        while not self._stopping.wait(SUPERVISE_INTERVAL_S):
            for component in self.components:
                process = component.process
                if process is None or process.alive() or self._stopping.is_set():
                    continue
                if component.restarts >= RESTARTS_MAX:
                    self.progress(
                        f"{component.name}: died {RESTARTS_MAX} times, giving up; stopping the stack"
                    )
                    self._stopping.set()
                    break
                component.restarts += 1
                self.progress(
                    f"{component.name}: exited with {process.popen.returncode if process.popen else '?'}, "
                    f"restart {component.restarts}/{RESTARTS_MAX} (log: {process.log_path})"
                )
                time.sleep(min(2.0**component.restarts * 0.1, 5.0))
                try:
                    component.process = component.start()
                except ServiceError as error:
                    self.progress(f"{component.name}: restart failed: {error}")

    def request_stop(self) -> None:
        self._stopping.set()

    def stop(self) -> None:
        self._stopping.set()
        for component in reversed(self.components):
            if component.process is not None:
                self.progress(f"{component.name}: stopping")
                component.process.stop()


def run_up(
    settings: Settings, installed_commands: set[str], as_json: bool, progress: Callable[[str], None]
) -> int:
    """Start the stack, print its summary, supervise until Ctrl-C or SIGTERM, stop everything."""
    stack = LocalStack(settings, installed_commands, progress)
    previous = {
        sig: signal.signal(sig, lambda *_: stack.request_stop())
        for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        try:
            stack.start()
            clusters = stack.register_clusters()
        except (ServiceError, XinfraError) as error:
            progress(f"error: {error}")
            return 1
        summary = {**stack.summary(), "clusters": clusters}
        if clusters:
            summary["admin_token_file"] = str(stack.run_dir / ADMIN_TOKEN_FILE)
        if as_json:
            print(json.dumps({"event": "ready", **summary}), flush=True)
        else:
            progress(
                "ready: " + ", ".join(f"{c['name']} {c['url']}" for c in summary["components"])
            )
        stack.supervise()
        return 0
    finally:
        stack.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if as_json:
            print(json.dumps({"event": "stopped"}), flush=True)
