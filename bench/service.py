"""The metadata service as the benches run it: one ``python -m metadata_service serve`` process.

Three benches measure the service (``metadata_service``, ``groups``) or lean on
it (``migration``); they start it the same way, so a difference between their
figures is never a difference in how the service was started.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx

from xinfra.services.ports import free_port
from xinfra.services.process import ManagedProcess

ROOT = Path(__file__).resolve().parent.parent


def start_metadata_service(
    run_dir: Path,
    name: str,
    *,
    admin_token: str,
    database_url: str,
    zookeeper: str | None = None,
    env: dict[str, str] | None = None,
) -> ManagedProcess:
    """Start one instance on a free port of 127.0.0.1 and wait until ``/ready`` answers 200.

    With ``zookeeper`` it announces changes there and leaves the schema alone (the bench made it
    with ``upgrade_database`` beforehand); without, it notifies in-process and upgrades its own
    database (SQLite). Its run directory is ``run_dir/name``, its log ``run_dir/name.log``.
    """
    port = free_port()
    options = ["--zookeeper", zookeeper, "--notify", "zookeeper", "--no-upgrade"]
    process = ManagedProcess(
        name=f"metadata-{name}",
        argv=[
            sys.executable,
            "-m",
            "metadata_service",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--database-url",
            database_url,
            *(options if zookeeper else ["--notify", "local"]),
            "--log-level",
            "warning",
        ],
        log_path=run_dir / f"{name}.log",
        cwd=ROOT,  # ``-m metadata_service`` is the package, never bench/metadata_service.py
        url=f"http://127.0.0.1:{port}",
        env={
            **os.environ,
            "XINFRA_ADMIN_TOKEN": admin_token,
            "XINFRA_RUN_DIR": str(run_dir / name),
            "PYTHONPATH": str(ROOT),
            **(env or {}),
        },
    )

    def ready() -> bool:
        try:
            return httpx.get(f"{process.url}/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    return process.start().wait_ready(ready, timeout_s=60)
