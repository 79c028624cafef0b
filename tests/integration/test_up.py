"""`xinfra up` as a user runs it: one command, everything healthy, SIGTERM leaves no process."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx

from xinfra.services.ports import free_port, port_open


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone for our purpose once reaped or marked Z.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _wait(predicate, timeout_s: float) -> bool:  # type: ignore[no-untyped-def]
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_up_starts_everything_and_sigterm_leaves_nothing(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "XINFRA_RUN_DIR": str(tmp_path / "run"),
        "XINFRA_ZOOKEEPER": f"127.0.0.1:{free_port()}",
        "XINFRA_KAFKA_BOOTSTRAP": f"127.0.0.1:{free_port()}",
        "XINFRA_NORTHGUARD_BOOTSTRAP": f"127.0.0.1:{free_port()}",
        "XINFRA_METADATA_URL": f"http://127.0.0.1:{free_port()}",
        "XINFRA_DATABASE_URL": f"sqlite:///{tmp_path / 'metadata.db'}",
    }
    up = subprocess.Popen(
        [sys.executable, "-m", "xinfra.cli", "up", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=tmp_path,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in up.stdout], daemon=True).start()  # type: ignore[union-attr]
    try:
        ready = json.loads(lines.get(timeout=120))
        assert ready["event"] == "ready", ready
        components = {c["name"]: c for c in ready["components"]}
        assert {"zookeeper", "kafka"} <= components.keys()
        for component in components.values():
            assert not component["reused"], "fresh ports: nothing may be reused"
            assert _pid_alive(component["pid"]), component
            assert Path(component["log"]).is_file()
        if "metadata-service" in components:
            assert "kafka-local" in ready["clusters"]
            assert ("northguard-local" in ready["clusters"]) == ("northguard-0" in components)
            registered = httpx.get(
                f"{env['XINFRA_METADATA_URL']}/v1/clusters",
                headers={
                    "Authorization": f"Bearer {(tmp_path / 'run' / 'admin-token').read_text().strip()}"
                },
            ).json()
            assert {c["name"] for c in registered["clusters"]} == set(ready["clusters"])
        kafka_host, kafka_port = env["XINFRA_KAFKA_BOOTSTRAP"].split(":")
        assert port_open(kafka_host, int(kafka_port))
    finally:
        up.send_signal(signal.SIGTERM)
        code = up.wait(timeout=60)
    assert code == 0, up.stderr.read() if up.stderr else ""
    assert json.loads(lines.get(timeout=5))["event"] == "stopped"
    for component in components.values():
        assert _wait(lambda pid=component["pid"]: not _pid_alive(pid), 10), (
            f"{component['name']} left behind"
        )
    assert not port_open(kafka_host, int(kafka_port))


def test_up_fails_clearly_when_a_port_is_taken_by_something_else(tmp_path: Path) -> None:
    import socket

    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    taken = blocker.getsockname()[1]
    env = {
        **os.environ,
        "XINFRA_RUN_DIR": str(tmp_path / "run"),
        "XINFRA_ZOOKEEPER": f"127.0.0.1:{taken}",  # answers TCP but is no ZooKeeper
        "XINFRA_KAFKA_BOOTSTRAP": f"127.0.0.1:{free_port()}",
    }
    try:
        result = subprocess.run(
            [sys.executable, "-m", "xinfra.cli", "up", "--json"],
            capture_output=True,
            env=env,
            cwd=tmp_path,
            text=True,
            timeout=120,
        )
    finally:
        blocker.close()
    assert result.returncode == 1
    assert "zookeeper" in result.stderr.lower()
