"""What ``xinfra up`` leaves on disk so that other shells can find, inspect and stop its stack.

Two files:

* ``<run_dir>/stack.json``, the *state file*: the supervisor's pid and every
  component's pid, address and health probe.  Written when the stack starts,
  rewritten when it is ready or a component restarts, removed when it stops.
  ``xinfra status`` and ``xinfra down`` read it.
* ``$XDG_CONFIG_HOME/xinfra/stack.json`` (``~/.config/xinfra/stack.json``), the
  *user config*: the run directory, service URL and token file of the last
  stack started, and the run directories of the stacks started before it.  It
  is how a shell outside the repository finds the service and the token
  (``xinfra.settings.get_settings``) and how a second stack on the same
  ports is detected and named.

A pid alone can be reused by an unrelated process, so every pid is stored
with the kernel's start time of that process and is only signalled while both
match.  This module imports nothing heavy: ``xinfra status`` stays fast.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from xinfra.services.process import same_process

STATE_FILE = "stack.json"
USER_CONFIG_FILE = "stack.json"
RUN_DIRS_MAX = 16


def user_config_path() -> Path:
    """``$XDG_CONFIG_HOME/xinfra/stack.json``, else ``~/.config/xinfra/stack.json``."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "xinfra" / USER_CONFIG_FILE


def _write_private(path: Path, data: dict[str, Any]) -> None:
    """Write JSON atomically, readable by the owner only (it names the token file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump(data, handle, indent=2)
        handle.write("\n")
    os.replace(tmp, path)


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_state(run_dir: Path) -> dict[str, Any] | None:
    return _read(run_dir / STATE_FILE)


def write_state(run_dir: Path, state: dict[str, Any]) -> None:
    _write_private(run_dir / STATE_FILE, state)


def remove_state(run_dir: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        (run_dir / STATE_FILE).unlink()


def read_user_config() -> dict[str, Any] | None:
    return _read(user_config_path())


def record_user_config(last: dict[str, Any]) -> None:
    """Make ``last`` the stack that clients find; keep the run dirs of earlier stacks."""
    previous = read_user_config() or {}
    run_dirs = [last["run_dir"]] + [
        d for d in previous.get("run_dirs", []) if d != last["run_dir"] and Path(d).is_dir()
    ]
    _write_private(user_config_path(), {**last, "run_dirs": run_dirs[:RUN_DIRS_MAX]})


def supervisor_alive(state: dict[str, Any]) -> bool:
    supervisor = state.get("supervisor") or {}
    pid = supervisor.get("pid")
    return isinstance(pid, int) and same_process(pid, supervisor.get("start_time"))


def live_stack() -> dict[str, Any] | None:
    """The state of the last stack started, when its supervisor still runs."""
    config = read_user_config()
    if not config or "run_dir" not in config:
        return None
    state = read_state(Path(config["run_dir"]))
    return state if state and supervisor_alive(state) else None


def other_stacks(run_dir: Path) -> list[dict[str, Any]]:
    """Running stacks started from other run directories (from the user config's list)."""
    config = read_user_config() or {}
    stacks = []
    for other in config.get("run_dirs", []):
        if Path(other).resolve() == run_dir.resolve():
            continue
        state = read_state(Path(other))
        if state and supervisor_alive(state):
            stacks.append(state)
    return stacks


# ---- health probes ---------------------------------------------------------------------------


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def probe(health: dict[str, str]) -> bool:
    """Run one stored health probe: ``zookeeper`` (ruok), ``tcp`` (connect) or ``http`` (200)."""
    kind, target = health.get("kind"), health.get("target", "")
    try:
        if kind == "http":
            with urllib.request.urlopen(target, timeout=1.0) as response:
                return bool(response.status == 200)
        host, port = _split(target)
        with socket.create_connection((host, port), timeout=0.5) as sock:
            if kind == "zookeeper":
                sock.sendall(b"ruok")
                return sock.recv(16) == b"imok"
            return True
    except (OSError, ValueError, urllib.error.URLError):
        return False


def status(run_dir: Path) -> dict[str, Any]:
    """What runs in ``run_dir``'s stack: supervisor and components with pid, liveness, health."""
    state = read_state(run_dir)
    if state is None:
        return {"run_dir": str(run_dir), "running": False, "components": []}
    running = supervisor_alive(state)
    components = []
    for component in state.get("components", []):
        pid = component.get("pid")
        alive = isinstance(pid, int) and same_process(pid, component.get("start_time"))
        health = component.get("health")
        components.append(
            {
                **{k: v for k, v in component.items() if k not in ("start_time", "health")},
                "alive": alive if pid is not None else None,
                "healthy": probe(health) if health else None,
            }
        )
    return {
        **{k: v for k, v in state.items() if k not in ("components", "supervisor")},
        "run_dir": str(run_dir),
        "running": running,
        "supervisor_pid": (state.get("supervisor") or {}).get("pid"),
        "components": components,
    }


def down(run_dir: Path, timeout_s: float = 60.0) -> dict[str, Any]:
    """Stop ``run_dir``'s stack: SIGTERM to its supervisor (which stops every component in
    order), then SIGKILL to any component left (a supervisor that was SIGKILLed earlier)."""
    state = read_state(run_dir)
    if state is None:
        return {"run_dir": str(run_dir), "stopped": False, "reason": "no stack state here"}
    supervisor = state.get("supervisor") or {}
    pid = supervisor.get("pid")
    stopped_supervisor = False
    if isinstance(pid, int) and supervisor_alive(state):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while supervisor_alive(state) and time.monotonic() < deadline:
            time.sleep(0.05)
        stopped_supervisor = not supervisor_alive(state)
        if not stopped_supervisor:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    killed = kill_leftovers(state)
    remove_state(run_dir)
    return {
        "run_dir": str(run_dir),
        "stopped": True,
        "supervisor_pid": pid,
        "supervisor_stopped": stopped_supervisor,
        "killed": killed,
    }


def kill_leftovers(state: dict[str, Any]) -> list[str]:
    """SIGKILL the process group of every component of ``state`` that still runs; their names."""
    killed = []
    for component in state.get("components", []):
        pid = component.get("pid")
        if isinstance(pid, int) and same_process(pid, component.get("start_time")):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            killed.append(component.get("name", str(pid)))
    return killed
