"""Start a Northguard broker as a child process: for tests, benchmarks and ``xinfra up``.

``start_northguard_broker`` returns a ``NorthguardProcess`` (a
``ManagedProcess``: ``url`` is the bootstrap ``host:port``, ``stop()`` sends
SIGTERM and waits, ``kill()`` is a SIGKILL for crash tests) once the client
port answers, i.e. after recovery.  ``restart()`` starts the same broker on
the same port and data directory again.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from backends.northguard.credentials import SECRET_ENV
from backends.northguard.tls import CertificateFiles
from xinfra.services.ports import free_port, port_open
from xinfra.services.process import ManagedProcess

START_TIMEOUT_S = 60.0


@dataclass
class NorthguardProcess(ManagedProcess):
    port: int = 0
    http_port: int = 0
    data_dir: Path = field(default_factory=Path)

    def restart(self, timeout_s: float = START_TIMEOUT_S) -> NorthguardProcess:
        """Start again after ``stop``/``kill``: same port, same data (recovery runs first)."""
        self.stop()
        self.popen = None
        self.start()
        self.wait_ready(lambda: port_open("127.0.0.1", self.port), timeout_s=timeout_s)
        return self


def start_northguard_broker(
    data_dir: Path,
    port: int | None = None,
    *,
    broker_id: str = "1",
    http_port: int | None = None,
    attributes: dict[str, str] | None = None,
    extra_args: list[str] | None = None,
    log_path: Path | None = None,
    timeout_s: float = START_TIMEOUT_S,
    secret: str | None = None,
    tls: CertificateFiles | None = None,
) -> NorthguardProcess:
    """Start one broker on ``port`` (a free one when None) and wait until it serves.

    ``secret``: the cluster secret, passed in the child's environment (never its argv);
    the broker then requires credentials.  None: the broker inherits this environment.
    ``tls``: the client port speaks TLS with this certificate and key (the readiness
    check is a TCP connect, which a TLS port accepts too).
    """
    port = port or free_port()
    http_port = http_port or free_port()
    argv = [
        sys.executable,
        "-m",
        "backends.northguard.broker",
        "--id",
        broker_id,
        "--port",
        str(port),
        "--http-port",
        str(http_port),
        "--data-dir",
        str(data_dir),
    ]
    if tls is not None:
        argv += ["--tls-cert", str(tls.cert), "--tls-key", str(tls.key)]
    for key, value in (attributes or {}).items():
        argv += ["--attr", f"{key}={value}"]
    argv += extra_args or []
    process = NorthguardProcess(
        name=f"northguard broker {broker_id}",
        argv=argv,
        log_path=log_path or data_dir.parent / f"northguard-{broker_id}.log",
        url=f"127.0.0.1:{port}",
        cwd=Path(__file__).resolve().parents[2],
        port=port,
        http_port=http_port,
        data_dir=data_dir,
        env=None if secret is None else {**os.environ, SECRET_ENV: secret},
    )
    process.start()
    process.wait_ready(lambda: port_open("127.0.0.1", port), timeout_s=timeout_s)
    return process


def start_northguard_cluster(
    run_dir: Path,
    count: int = 3,
    *,
    replication_factor: int = 3,
    attributes: list[dict[str, str]] | None = None,
    extra_args: list[str] | None = None,
    secret: str | None = None,
    tls: CertificateFiles | None = None,
) -> list[NorthguardProcess]:
    """``count`` brokers as one cluster: broker 1 the coordinator, the others members joined to
    it; the coordinator waits for the members to register before this returns, so the first
    segment already has its replica set.  Stop them with ``stop`` on each (members first)."""
    from backends.northguard.client.blocking import request_blocking
    from backends.northguard.credentials import ALL_TOPICS, OPERATIONS, sign
    from backends.northguard.tls import CA_ATTRIBUTE, TLS_ATTRIBUTE, client_context

    first_port = free_port()
    address = f"127.0.0.1:{first_port}"
    common = [*(extra_args or []), "--replication-factor", str(replication_factor)]
    if tls is not None:
        common += ["--peer-tls-ca", str(tls.ca)]
    processes: list[NorthguardProcess] = []
    try:
        for index in range(count):
            broker_id = str(index + 1)
            args = [*common, "--cluster"] if index == 0 else [*common, "--coordinator", address]
            processes.append(
                start_northguard_broker(
                    run_dir / f"broker-{broker_id}",
                    first_port if index == 0 else None,
                    broker_id=broker_id,
                    attributes=(attributes or [{}] * count)[index],
                    extra_args=args,
                    log_path=run_dir / f"northguard-{broker_id}.log",
                    secret=secret,
                    tls=tls,
                )
            )
        credential = (
            None
            if secret is None
            else sign(secret.encode(), "launcher", ALL_TOPICS, OPERATIONS, START_TIMEOUT_S)
        )
        tls_context = (
            None
            if tls is None
            else client_context({TLS_ATTRIBUTE: "true", CA_ATTRIBUTE: str(tls.ca)})
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            status = request_blocking(
                address, "cluster_status", 10.0, credential=credential, tls_context=tls_context
            )
            if sum(1 for b in status["brokers"] if b["live"]) == count:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {status['brokers']} of {count} brokers joined")
            time.sleep(0.05)
    except BaseException:
        for process in reversed(processes):
            process.stop()
        raise
    return processes


def start_northguard(run_dir: Path, port: int | None = None) -> NorthguardProcess:
    """The contract suite's entry: one broker with its data under ``run_dir`` (``xinfra up`` runs
    a three-broker cluster through its own commands: ``xinfra.up``)."""
    return start_northguard_broker(
        run_dir / "northguard-data", port, log_path=run_dir / "northguard.log"
    )
