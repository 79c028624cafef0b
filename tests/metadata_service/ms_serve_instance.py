"""Run one metadata service instance with the in-memory backend (a subprocess of the tests).

Usage: python ms_serve_instance.py PORT DATABASE_URL ZOOKEEPER ADMIN_TOKEN RUN_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import uvicorn
from ms_memory_backend import MemoryBackend

from metadata_service import ServiceConfig, create_app

port, database_url, zookeeper, admin_token, run_dir = sys.argv[1:6]
config = ServiceConfig(
    database_url=database_url,
    zookeeper=zookeeper,
    admin_token=admin_token,
    run_dir=Path(run_dir),
    backend_factory=MemoryBackend,
)
uvicorn.run(create_app(config), host="127.0.0.1", port=int(port), log_level="warning")
