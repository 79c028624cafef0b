"""Redis for the checkpoint cache: the server at 127.0.0.1:6379 when it answers, else a private one."""

from __future__ import annotations

import shutil
from pathlib import Path

import redis

from xinfra.services.ports import free_port
from xinfra.services.process import ManagedProcess, ServiceError


def redis_answers(url: str) -> bool:
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except redis.RedisError:
        return False


def ensure_redis(run_dir: Path) -> tuple[str, ManagedProcess | None]:
    """A Redis URL, and the process when this call had to start one."""
    default = "redis://127.0.0.1:6379/0"
    if redis_answers(default):
        return default, None
    process = start_redis(run_dir)
    return process.url, process


def start_redis(run_dir: Path, port: int | None = None) -> ManagedProcess:
    """A private, memory-only redis-server on a free port; ``url`` is its redis:// URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise ServiceError("redis-server is not installed (apt-get install redis-server)")
    port = port or free_port()
    url = f"redis://127.0.0.1:{port}/0"
    process = ManagedProcess(
        name="redis",
        argv=[
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        log_path=run_dir / "redis.log",
        url=url,
    )
    return process.start().wait_ready(lambda: redis_answers(url), timeout_s=30)
