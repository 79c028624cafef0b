"""Run one metadata service instance as a real process (a subprocess of the tests).

Usage: python ms_serve_instance.py PORT DATABASE_URL ZOOKEEPER ADMIN_TOKEN RUN_DIR [OVERRIDES]

ZOOKEEPER ``-`` means in-process notifications only.  OVERRIDES is a JSON
object of ``ServiceConfig`` fields, plus ``"backend": "real"`` for the
registered backends (Kafka, Northguard) instead of the in-memory one.  Served
as ``xinfra serve`` serves (a graceful shutdown bounded in time).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from ms_memory_backend import MemoryBackend

from metadata_service import ServiceConfig, create_app
from metadata_service.server import serve
from xinfra.backend import open_backend

port, database_url, zookeeper, admin_token, run_dir = sys.argv[1:6]
overrides: dict[str, Any] = json.loads(sys.argv[6]) if len(sys.argv) > 6 else {}
backend = overrides.pop("backend", "memory")
config = ServiceConfig(
    database_url=database_url,
    zookeeper=None if zookeeper == "-" else zookeeper,
    admin_token=admin_token,
    run_dir=Path(run_dir),
    backend_factory=open_backend if backend == "real" else MemoryBackend,
    **overrides,
)
serve(
    create_app(config),
    host="127.0.0.1",
    port=int(port),
    log_level="warning",
    timeout_graceful_shutdown=1,
)
