"""``xinfra up``: the whole local stack in one command, supervised, stopped cleanly.

The stack is ZooKeeper, the Kafka-protocol broker, the Northguard cluster and
the metadata service with both clusters registered (each part as soon as its
command is installed; ``--only`` picks some).  The Northguard cluster is one
broker per address of ``XINFRA_NORTHGUARD_BOOTSTRAP`` (three by default:
9470, 9472, 9474; health and metrics on ``XINFRA_NORTHGUARD_HTTP_PORTS``,
9471, 9473, 9475), replication factor ``XINFRA_NORTHGUARD_REPLICATION_FACTOR``
(3): ``northguard-0`` is the coordinator (``--cluster``), the others join it
(``--coordinator``), each supervised as a component of its own with its data
in ``<run_dir>/northguard/<i>``; all require the run directory's cluster secret.  Every child runs in its own
process group, logs to ``<run_dir>/logs`` and dies with the supervisor even
when the supervisor is SIGKILLed (``xinfra.services.process``); a child that
dies is restarted with backoff (at most ``RESTARTS_MAX`` times).

Stopping: SIGINT (Ctrl-C), SIGTERM and SIGHUP (the terminal closed) all stop
everything in reverse order, during start-up too (a signal interrupts the
start at once).  Output that can no longer be written (``| tee`` killed by the
same Ctrl-C, a closed terminal) is dropped: it never skips a stop.

Other shells: the state file ``<run_dir>/stack.json`` names every pid, address
and health probe (``xinfra status``, ``xinfra down``), and the user config
``~/.config/xinfra/stack.json`` names the last stack's URL and token file
(``xinfra.services.state``).  A port already answering is reused only when
nothing says it belongs to another stack: a live stack of this run directory
or of another one is named and the start refused; a port held by something
that does not answer as the component expects is named in the error.

``xinfra up`` never imports the broker or the service: it starts them through
their own commands (``xinfra northguard broker``, ``xinfra serve``), which keeps
the dependency rule of DESIGN.md §1 and runs each in a process of its own.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import httpx

from xinfra.errors import Conflict, XinfraError
from xinfra.model import ClusterKind, PhysicalCluster
from xinfra.rest import ADMIN_TOKEN_FILE, MetadataClient
from xinfra.services import state as stackstate
from xinfra.services.kafka import start_kafka
from xinfra.services.ports import port_open, split_host_port
from xinfra.services.process import ManagedProcess, ServiceError
from xinfra.services.zookeeper import start_zookeeper
from xinfra.settings import Settings

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
COMPONENT_KINDS = ("zookeeper", "kafka", "northguard", "metadata-service")

RESTARTS_MAX = 5
NORTHGUARD_SECRET_FILE = "northguard-secret"
"""The local Northguard cluster's secret, in the run directory (0600): the broker reads it
(``--secret-file``) and the service signs clients' credentials with it (``file:`` reference)."""
NORTHGUARD_SECRET_ATTRIBUTE = "northguard.secret"
"""``backends.northguard.credentials.SECRET_ATTRIBUTE`` (``xinfra up`` imports no backend)."""
SUPERVISE_INTERVAL_S = 0.5


class StopRequested(BaseException):
    """A stop signal arrived while the stack was starting: unwind and stop what runs."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _xinfra_argv(*args: str) -> list[str]:
    """The argv that runs an ``xinfra`` subcommand with this interpreter."""
    return [sys.executable, "-m", "xinfra.cli", *args]


def http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def _northguard_ready(health_url: str, coordinator_metrics_url: str, live_brokers: int) -> bool:
    """A broker answers its health check and the coordinator counts at least ``live_brokers``
    brokers live (a member that started is registered before the next starts, so the cluster
    places three replicas from its first segment on)."""
    if not http_ok(health_url):
        return False
    if live_brokers <= 1:
        return True
    try:
        metrics = httpx.get(coordinator_metrics_url, timeout=1.0).text
    except httpx.HTTPError:
        return False
    for line in metrics.splitlines():
        if line.startswith("northguard_live_brokers "):
            return float(line.split()[1]) >= live_brokers
    return False


@dataclass
class Component:
    """One supervised part of the stack: how to start it, how to tell it is healthy."""

    name: str
    kind: str
    url: str
    start: Callable[[], ManagedProcess | None]
    health: dict[str, str]
    """A probe ``xinfra.services.state.probe`` runs: kind ``zookeeper``, ``tcp`` or ``http``."""
    address: str
    """The ``host:port`` it listens on (what must be free, or be this component)."""
    extra: dict[str, str] = field(default_factory=dict)
    also_listens: str | None = None
    """Another ``host:port`` it listens on (a health port), which must be free too."""
    process: ManagedProcess | None = None
    restarts: int = 0
    reused: bool = False

    def healthy(self) -> bool:
        return stackstate.probe(self.health)

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "url": self.url,
            **self.extra,
            "pid": self.process.pid if self.process else None,
            "start_time": self.process.start_time() if self.process else None,
            "reused": self.reused,
            "log": str(self.process.log_path) if self.process else None,
            "health": self.health,
        }


class SafeOutput:
    """Writes that never raise: once a stream is broken (EPIPE, EIO) it is sent to /dev/null.

    The supervisor's last duty is to stop its children; a message it cannot
    print must not get in the way.
    """

    def __init__(self) -> None:
        self.broken: set[int] = set()

    def write(self, stream: TextIO, text: str) -> None:
        try:
            fd = stream.fileno()
        except (OSError, ValueError):
            return
        if fd in self.broken:
            return
        try:
            stream.write(text + "\n")
            stream.flush()
        except (OSError, ValueError):
            self.broken.add(fd)
            # Point the descriptor at /dev/null: later writes (and the interpreter's final
            # flush) succeed silently instead of raising again.
            with contextlib.suppress(OSError):
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, fd)
                os.close(devnull)


@dataclass
class LocalStack:
    settings: Settings
    installed_commands: set[str]
    progress: Callable[[str], None] = lambda message: None
    only: set[str] | None = None
    components: list[Component] = field(default_factory=list)
    _stopping: threading.Event = field(default_factory=threading.Event)
    _interruptible: bool = False
    _interrupted: int | None = None

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
        _zk_host, zk_port = split_host_port(s.zookeeper, 2181)
        _kafka_host, kafka_port = split_host_port(s.kafka_bootstrap, 9092)
        components = [
            Component(
                "zookeeper",
                "zookeeper",
                s.zookeeper,
                lambda: start_zookeeper(self.run_dir / "zookeeper", zk_port, log_dir=self.log_dir),
                {"kind": "zookeeper", "target": s.zookeeper},
                s.zookeeper,
            ),
            Component(
                "kafka",
                "kafka",
                s.kafka_bootstrap,
                lambda: start_kafka(self.log_dir, kafka_port),
                {"kind": "tcp", "target": s.kafka_bootstrap},
                s.kafka_bootstrap,
                {"note": "memory only: topics and records are lost when it stops"},
            ),
        ]
        if "northguard" in self.installed_commands:
            components += self._northguard_plan()
        if "serve" in self.installed_commands:
            host, port = split_host_port(s.metadata_url.removeprefix("http://"), 8780)
            components.append(
                Component(
                    "metadata-service",
                    "metadata-service",
                    s.metadata_url,
                    lambda: self._spawn(
                        "metadata-service",
                        _xinfra_argv("serve", "--host", host, "--port", str(port)),
                        lambda: http_ok(f"{s.metadata_url}/health"),
                        {"XINFRA_ADMIN_TOKEN": self.admin_token()},
                    ),
                    {"kind": "http", "target": f"{s.metadata_url}/health"},
                    f"{host}:{port}",
                )
            )
        if self.only is not None:
            components = [c for c in components if c.kind in self.only]
        return components

    def northguard_brokers(self) -> list[tuple[str, int, int]]:
        """The local Northguard cluster's brokers: (host, client port, health port) each, the
        coordinator first; ``ServiceError`` naming the settings when they do not fit together."""
        s = self.settings
        addresses = [a.strip() for a in s.northguard_bootstrap.split(",") if a.strip()]
        http_ports = [p.strip() for p in s.northguard_http_ports.split(",") if p.strip()]
        if (
            not addresses
            or len(http_ports) != len(addresses)
            or not all(p.isdigit() for p in http_ports)
        ):
            raise ServiceError(
                f"XINFRA_NORTHGUARD_BOOTSTRAP names {len(addresses)} broker(s) "
                f"({s.northguard_bootstrap!r}) and XINFRA_NORTHGUARD_HTTP_PORTS "
                f"{s.northguard_http_ports!r}: give one health port per broker, in the same order"
            )
        if not 1 <= s.northguard_replication_factor <= len(addresses):
            raise ServiceError(
                f"XINFRA_NORTHGUARD_REPLICATION_FACTOR={s.northguard_replication_factor} needs "
                f"at least as many brokers, and XINFRA_NORTHGUARD_BOOTSTRAP names {len(addresses)}"
            )
        brokers = []
        for address, http_port in zip(addresses, http_ports, strict=True):
            host, port = split_host_port(address, 9470)
            brokers.append((host, port, int(http_port)))
        return brokers

    def _northguard_plan(self) -> list[Component]:
        """One component per broker of the local Northguard cluster: broker 0 (the first
        address) is the coordinator (``--cluster``), the others join it (``--coordinator``);
        broker ``i`` keeps its data in ``<run_dir>/northguard/<i>`` (broker 0's is where the
        single broker of earlier stacks kept its data, so an old run directory's topics stay
        readable: the coordinator owns that metadata, with a copy on each of as many members as the
        replication factor asks)."""
        brokers = self.northguard_brokers()
        coordinator = f"{brokers[0][0]}:{brokers[0][1]}"
        coordinator_metrics = f"http://{brokers[0][0]}:{brokers[0][2]}/metrics"
        factor = self.settings.northguard_replication_factor  # segments and metadata alike
        components = []
        for index, (host, port, http_port) in enumerate(brokers):
            name = f"northguard-{index}"
            address = f"{host}:{port}"
            http_url = f"http://{host}:{http_port}"
            data_dir = self.run_dir / "northguard" / str(index)
            role = (
                ["--cluster", "--metadata-replication-factor", str(factor)]
                if index == 0
                else ["--coordinator", coordinator]
            )
            ready = functools.partial(
                _northguard_ready, f"{http_url}/health", coordinator_metrics, index + 1
            )
            components.append(
                Component(
                    name,
                    "northguard",
                    address,
                    functools.partial(
                        self._start_northguard, name, index, address, http_port, role, ready
                    ),
                    {"kind": "http", "target": f"{http_url}/health"},
                    address,
                    {
                        "health_url": f"{http_url}/health",
                        "metrics_url": f"{http_url}/metrics",
                        "role": "coordinator" if index == 0 else "member",
                        "data_dir": str(data_dir),
                    },
                    also_listens=f"{host}:{http_port}",
                )
            )
        return components

    def _start_northguard(
        self,
        name: str,
        index: int,
        address: str,
        http_port: int,
        role: list[str],
        ready: Callable[[], bool],
    ) -> ManagedProcess:
        host, port = split_host_port(address, 9470)
        argv = _xinfra_argv(
            "northguard",
            "broker",
            "--id",
            str(index),
            "--host",
            host,
            "--port",
            str(port),
            "--http-port",
            str(http_port),
            "--data-dir",
            str(self.run_dir / "northguard" / str(index)),
            "--attr",
            f"rack=r{index}",
            "--secret-file",
            str(self.northguard_secret_file()),
            "--replication-factor",
            str(self.settings.northguard_replication_factor),
            *role,
        )
        return self._spawn(name, argv, ready)

    def admin_token(self) -> str:
        """The admin token of this stack: configured, else the run directory's token file, else
        a new one written there (0600).  The service gets it in its environment, so it never
        creates one of its own and never prints one to its log."""
        if self.settings.admin_token:
            return self.settings.admin_token
        path = self.run_dir / ADMIN_TOKEN_FILE
        with contextlib.suppress(OSError):
            existing = path.read_text().strip()
            if existing:
                return existing
        token = secrets.token_urlsafe(32)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(token + "\n")
        return token

    def northguard_secret_file(self) -> Path:
        """The run directory's Northguard cluster secret: made once (32 random bytes, 0600), then
        reused by every later stack of this run directory, so its broker data and its cluster
        registration stay valid across restarts.  Only its path is passed around (never argv or
        a log)."""
        path = self.run_dir / NORTHGUARD_SECRET_FILE
        with contextlib.suppress(FileNotFoundError):
            if path.read_text().strip():
                if path.stat().st_mode & 0o077:
                    path.chmod(0o600)
                return path
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_urlsafe(32) + "\n")
        return path

    def _spawn(
        self,
        name: str,
        argv: list[str],
        ready: Callable[[], bool],
        extra_env: dict[str, str] | None = None,
    ) -> ManagedProcess:
        env = {
            **os.environ,
            "XINFRA_RUN_DIR": str(self.run_dir),
            "XINFRA_ZOOKEEPER": self.settings.zookeeper,
            "XINFRA_KAFKA_BOOTSTRAP": self.settings.kafka_bootstrap,
            "XINFRA_NORTHGUARD_BOOTSTRAP": self.settings.northguard_bootstrap,
            "XINFRA_METADATA_URL": self.settings.metadata_url,
            "XINFRA_DATABASE_URL": self.database_url,
            **(extra_env or {}),
        }
        process = ManagedProcess(name, argv, self.log_dir / f"{name}.log", "", env=env)
        return process.start().wait_ready(ready, timeout_s=60)

    # ---- signals ---------------------------------------------------------------------------

    def on_signal(self, signum: int, _frame: FrameType | None) -> None:
        """Every stop signal stops the stack; while starting, it interrupts the start at once."""
        self._stopping.set()
        if self._interruptible and self._interrupted is None:
            self._interrupted = signum
            raise StopRequested(signum)
        if self._interrupted is None:
            self._interrupted = signum

    @contextlib.contextmanager
    def interruptible(self) -> Any:
        """A stop signal inside this block raises ``StopRequested`` (outside it only sets a flag)."""
        if self._stopping.is_set():
            raise StopRequested(self._interrupted or signal.SIGTERM)
        self._interruptible = True
        try:
            yield
        finally:
            self._interruptible = False

    # ---- start, check, stop ----------------------------------------------------------------

    def preflight(self) -> None:
        """Refuse to start over a live stack (this run directory's or another's) and stop the
        leftovers of a supervisor that died before its children could be stopped."""
        state = stackstate.read_state(self.run_dir)
        if state is not None:
            if stackstate.supervisor_alive(state):
                raise ServiceError(
                    f"a stack of this run directory ({self.run_dir}) is already running "
                    f"(supervisor pid {state['supervisor']['pid']}): `xinfra status` shows it, "
                    "`xinfra down` stops it"
                )
            killed = stackstate.kill_leftovers(state)
            if killed:
                self.progress(
                    f"stopped what an earlier supervisor left running: {', '.join(killed)}"
                )
            stackstate.remove_state(self.run_dir)
        ours = {c.address for c in self.plan()}
        for other in stackstate.other_stacks(self.run_dir):
            theirs = {c.get("address") for c in other.get("components", [])}
            shared = sorted(a for a in ours & theirs if a)
            if shared:
                raise ServiceError(
                    f"the stack of run directory {other['run_dir']} (supervisor pid "
                    f"{other['supervisor']['pid']}) already listens on {', '.join(shared)}: "
                    "stop it (`XINFRA_RUN_DIR=... xinfra down`) or give this stack other ports "
                    "(XINFRA_ZOOKEEPER, XINFRA_KAFKA_BOOTSTRAP, XINFRA_NORTHGUARD_BOOTSTRAP, "
                    "XINFRA_NORTHGUARD_HTTP_PORTS, XINFRA_METADATA_URL)"
                )

    def start(self) -> None:
        """Start every component in order; on any failure or stop signal stop what runs and raise."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            with self.interruptible():
                self.preflight()
                self.write_state("starting")
                for component in self.plan():
                    self.components.append(component)
                    if component.healthy():
                        component.reused = True
                        self.progress(
                            f"{component.name}: {component.url} already answers and belongs to "
                            "no xinfra stack: using it (not started, not stopped by this stack)"
                        )
                        continue
                    for address in filter(None, (component.address, component.also_listens)):
                        host, port = split_host_port(address, 0)
                        if port_open(host, port):
                            raise ServiceError(
                                f"{component.name}: port {address} is taken by a process that "
                                f"is not {component.kind}; free it or set another address"
                            )
                    self.progress(f"{component.name}: starting")
                    component.process = component.start()
                    self.write_state("starting")
                    self.progress(f"{component.name}: ready at {component.url}")
        except BaseException:
            self.stop()
            raise

    def register_clusters(self) -> list[str]:
        """Register the local physical clusters with the local service (idempotent); their names."""
        kinds = {c.kind for c in self.components}
        if "metadata-service" not in kinds:
            return []
        clusters = []
        if "kafka" in kinds:
            clusters.append(
                PhysicalCluster(
                    name="kafka-local",
                    kind=ClusterKind.KAFKA,
                    bootstrap=self.settings.kafka_bootstrap,
                )
            )
        if "northguard" in kinds:
            clusters.append(
                PhysicalCluster(
                    name="northguard-local",
                    kind=ClusterKind.NORTHGUARD,
                    bootstrap=self.settings.northguard_bootstrap,
                    attributes={
                        NORTHGUARD_SECRET_ATTRIBUTE: f"file:{self.northguard_secret_file()}"
                    },
                )
            )
        token = self.settings.token or self.admin_token()
        with (
            self.interruptible(),
            MetadataClient(
                url=self.settings.metadata_url, token=token, settings=self.settings
            ) as client,
        ):
            for cluster in clusters:
                try:
                    client.register_cluster(cluster)
                except Conflict:  # registered by an earlier run on this run directory
                    self._update_registration(client, cluster)
                self.progress(f"cluster {cluster.name} ({cluster.kind.value}) registered")
        return [c.name for c in clusters]

    def _update_registration(self, client: MetadataClient, cluster: PhysicalCluster) -> None:
        """A cluster an earlier ``xinfra up`` registered differently: without the secret its
        brokers now require, or with another bootstrap (the single broker of stacks before the
        three-broker cluster).  The service has no route that changes a cluster, so this is a
        delete and a register, which the service refuses while epochs live on the cluster: a
        missing secret then stops the start with what to do; an older bootstrap is kept, with a
        warning (its first address is the coordinator, which serves every request)."""
        wanted_secret = cluster.attributes.get(NORTHGUARD_SECRET_ATTRIBUTE)
        registered = client.describe_cluster(cluster.name)
        missing_secret = wanted_secret is not None and NORTHGUARD_SECRET_ATTRIBUTE not in (
            registered.get("attributes") or {}
        )
        old_bootstrap = str(registered.get("bootstrap", ""))
        moved = _addresses(old_bootstrap) != _addresses(cluster.bootstrap)
        if not missing_secret and not moved:
            return
        try:
            client.request(
                "DELETE",
                f"/v1/clusters/{cluster.name}",
                params={"expected_version": registered["version"]},
            )
        except Conflict as error:
            if missing_secret:
                raise ServiceError(
                    f"cluster {cluster.name} was registered by an earlier `xinfra up` without "
                    f"{NORTHGUARD_SECRET_ATTRIBUTE}, and its broker now requires credentials; the "
                    f"service cannot add the attribute while epochs live on the cluster ({error}). "
                    "Delete those topics, or start a fresh stack elsewhere (XINFRA_RUN_DIR)"
                ) from error
            self.progress(
                f"WARNING: cluster {cluster.name} stays registered with bootstrap {old_bootstrap} "
                f"(not {cluster.bootstrap}): the service cannot change it while epochs live on "
                "the cluster; clients reach the cluster through those addresses"
            )
            return
        client.register_cluster(cluster)
        self.progress(
            f"cluster {cluster.name}: registered again "
            + ("with its secret" if missing_secret else f"with bootstrap {cluster.bootstrap}")
        )

    def repair_topics(self) -> list[dict[str, Any]]:
        """After a restart the memory-only local Kafka has no topics while the metadata still
        names them: recreate each lost physical topic (empty) and say loudly what was lost.
        Raises ``ServiceError`` naming ``xinfra topics reconcile --repair`` when it cannot."""
        if "metadata-service" not in {c.kind for c in self.components}:
            return []
        from xinfra.commands.topics import repair_missing_physical_topics

        token = self.settings.token or self.admin_token()
        with (
            self.interruptible(),
            MetadataClient(
                url=self.settings.metadata_url, token=token, settings=self.settings
            ) as client,
        ):
            report = client.reconcile()
            repaired, errors = repair_missing_physical_topics(client, report["drift"])
        for item in repaired:
            self.progress(
                f"WARNING: {item['virtual_cluster']}/{item['topic']} epoch {item['epoch']}: "
                f"physical topic {item['physical_topic']} was gone from {item['cluster']} "
                f"(the local Kafka keeps nothing across a restart); recreated with "
                f"{item['shards']} shard(s); {item['lost']}"
            )
        for error in report["errors"]:
            self.progress(f"reconcile: {error}")
        if errors:
            raise ServiceError(
                "some topics lost their physical topics and could not be recreated:\n  "
                + "\n  ".join(errors)
                + "\nrun `xinfra topics reconcile --repair` once the cause is fixed"
            )
        return repaired

    def summary(self) -> dict[str, Any]:
        return {
            "run_dir": str(self.run_dir),
            "metadata_url": self.settings.metadata_url,
            "components": [
                {k: v for k, v in c.describe().items() if k not in ("start_time", "health")}
                for c in self.components
            ],
        }

    def write_state(self, phase: str, **extra: Any) -> None:
        """The state file other shells read (``xinfra status``, ``xinfra down``)."""
        pid = os.getpid()
        components = []
        for component in self.components:
            described = component.describe()
            described["address"] = component.address
            components.append(described)
        stackstate.write_state(
            self.run_dir,
            {
                "phase": phase,
                "run_dir": str(self.run_dir),
                "metadata_url": self.settings.metadata_url,
                "supervisor": {"pid": pid, "start_time": _own_start_time()},
                "components": components
                + [
                    {"name": c.name, "address": c.address}
                    for c in self.plan()
                    if c.name not in {d["name"] for d in components}
                ],
                **extra,
            },
        )

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
                if self._stopping.wait(min(2.0**component.restarts * 0.1, 5.0)):
                    return
                try:
                    with self.interruptible():
                        component.process = component.start()
                    self.write_state("ready")
                except ServiceError as error:
                    self.progress(f"{component.name}: restart failed: {error}")
                except StopRequested:
                    return

    def request_stop(self) -> None:
        self._stopping.set()

    def stop(self) -> None:
        """Stop every started component in reverse order; never interrupted, never raises."""
        self._interruptible = False
        self._stopping.set()
        for component in reversed(self.components):
            if component.process is not None:
                self.progress(f"{component.name}: stopping")
                component.process.stop()
        with contextlib.suppress(OSError):
            state = stackstate.read_state(self.run_dir)
            if state and (state.get("supervisor") or {}).get("pid") == os.getpid():
                stackstate.remove_state(self.run_dir)


def _addresses(bootstrap: str) -> list[str]:
    return [a.strip() for a in bootstrap.split(",") if a.strip()]


def _own_start_time() -> int | None:
    from xinfra.services.process import process_start_time

    return process_start_time(os.getpid())


def run_up(
    settings: Settings,
    installed_commands: set[str],
    as_json: bool,
    progress: Callable[[str], None],
    only: set[str] | None = None,
) -> int:
    """Start the stack, print its summary, supervise until a stop signal, stop everything.

    Exit status: 0 stopped after a successful start, 1 failed to start, 128+N
    stopped by signal N during start-up.
    """
    output = SafeOutput()

    def say(message: str) -> None:
        if sys.stderr.fileno() in output.broken:
            return
        try:
            progress(message)
        except (OSError, ValueError, SystemExit):
            # SystemExit: rich's answer to a broken pipe (it has already pointed the stream at
            # /dev/null).  Either way stderr is gone; the stop goes on without it.
            output.broken.add(sys.stderr.fileno())

    def event(data: dict[str, Any]) -> None:
        if as_json:
            output.write(sys.stdout, json.dumps(data))

    stack = LocalStack(settings, installed_commands, say, only)
    previous = {sig: signal.signal(sig, stack.on_signal) for sig in STOP_SIGNALS}
    try:
        try:
            stack.start()
            clusters = stack.register_clusters()
            repaired = stack.repair_topics()
        except StopRequested as stop:
            say(f"{signal.Signals(stop.signum).name} during start-up: stopped")
            return 128 + stop.signum
        except (ServiceError, XinfraError) as error:
            say(f"error: {error}")
            return 1
        summary = {**stack.summary(), "clusters": clusters, "repaired_topics": repaired}
        token_file = stack.run_dir / ADMIN_TOKEN_FILE
        if clusters:
            summary["admin_token_file"] = str(token_file)
        if any(c.kind == "northguard" for c in stack.components):
            summary["northguard_secret_file"] = str(stack.northguard_secret_file())
        stack.write_state("ready", clusters=clusters, admin_token_file=str(token_file))
        stackstate.record_user_config(
            {
                "run_dir": str(stack.run_dir),
                "metadata_url": settings.metadata_url,
                "token_file": str(token_file),
                "zookeeper": settings.zookeeper,
                "kafka_bootstrap": settings.kafka_bootstrap,
                "northguard_bootstrap": settings.northguard_bootstrap,
                "northguard_http_ports": settings.northguard_http_ports,
            }
        )
        event({"event": "ready", **summary})
        if not as_json:
            for component in summary["components"]:
                extra = "".join(
                    f" {key}={component[key]}"
                    for key in ("health_url", "metrics_url")
                    if key in component
                )
                pid = "reused" if component["reused"] else f"pid {component['pid']}"
                say(f"ready: {component['name']} {component['url']} ({pid}){extra}")
            say("`xinfra status` shows the stack, `xinfra down` or Ctrl-C stops it")
        stack.supervise()
        return 0
    finally:
        stack.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        event({"event": "stopped"})
