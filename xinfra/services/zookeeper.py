"""A standalone ZooKeeper server on a free port, from the jars PySpark ships or a given classpath.

No root and no system package is needed: PySpark (a dev and spark extra) ships
the ZooKeeper 3.9 server jars, and the machine has Java 17.  Set
``XINFRA_ZOOKEEPER_CLASSPATH`` to use other jars (Debian's ``/usr/share/java/*``).
The admin HTTP server is disabled so that it never takes port 8080.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import socket
from pathlib import Path

from xinfra.services.ports import free_port
from xinfra.services.process import ManagedProcess, ServiceError


def zookeeper_classpath() -> str:
    configured = os.environ.get("XINFRA_ZOOKEEPER_CLASSPATH")
    if configured:
        return configured
    spec = importlib.util.find_spec("pyspark")
    if spec is not None and spec.origin is not None:
        jars = Path(spec.origin).parent / "jars"
        if glob.glob(str(jars / "zookeeper-*.jar")):
            return str(jars / "*")
    for debian in ("/usr/share/zookeeper/lib", "/usr/share/java"):
        if glob.glob(f"{debian}/zookeeper*.jar"):
            return f"{debian}/*"
    raise ServiceError(
        "no ZooKeeper jars found: install the dev extra (`pip install -e '.[dev]'`, it brings "
        "PySpark's jars) or set XINFRA_ZOOKEEPER_CLASSPATH"
    )


def zookeeper_ok(host: str, port: int) -> bool:
    """The 'ruok' four-letter word: 'imok' once the server serves clients."""
    try:
        with socket.create_connection((host, port), timeout=0.5) as sock:
            sock.sendall(b"ruok")
            return sock.recv(16) == b"imok"
    except OSError:
        return False


def start_zookeeper(
    data_dir: Path, port: int | None = None, log_dir: Path | None = None
) -> ManagedProcess:
    """Start ZooKeeper and return once it answers; ``url`` is ``host:port`` for kazoo."""
    java = shutil.which("java")
    if java is None:
        raise ServiceError(
            "java not found: ZooKeeper needs a Java runtime (apt-get install default-jre-headless)"
        )
    port = port or free_port()
    data_dir.mkdir(parents=True, exist_ok=True)
    config = data_dir / "zoo.cfg"
    config.write_text(
        "\n".join(
            [
                "tickTime=2000",
                f"dataDir={data_dir / 'data'}",
                f"clientPort={port}",
                "clientPortAddress=127.0.0.1",
                "admin.enableServer=false",
                "4lw.commands.whitelist=ruok,srvr,mntr,stat",
                "maxClientCnxns=0",
                "",
            ]
        )
    )
    process = ManagedProcess(
        name="zookeeper",
        argv=[
            java,
            "-Xmx256m",
            "-Dzookeeper.admin.enableServer=false",
            "-Dlog4j.configuration=none",
            "-cp",
            zookeeper_classpath(),
            "org.apache.zookeeper.server.ZooKeeperServerMain",
            str(config),
        ],
        log_path=(log_dir or data_dir) / "zookeeper.log",
        url=f"127.0.0.1:{port}",
    )
    return process.start().wait_ready(lambda: zookeeper_ok("127.0.0.1", port), timeout_s=60)
