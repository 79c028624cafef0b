"""How any shell finds the service and the token: XINFRA_* first, then the user config that
``xinfra up`` writes (only while its stack runs), then the repository's run directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from xinfra.services.process import process_start_time
from xinfra.services.state import record_user_config, write_state

PRINT_SETTINGS = (
    "from xinfra.settings import get_settings; s = get_settings(); "
    "print(s.metadata_url, s.run_dir, s.kafka_bootstrap)"
)


def _settings(env: dict[str, str], cwd: Path) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-c", PRINT_SETTINGS], env=env, cwd=cwd, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def _clean_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("XINFRA_")}
    return {**env, "XDG_CONFIG_HOME": str(tmp_path / "config")}


def _record_stack(tmp_path: Path, supervisor_pid: int, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A run dir whose state names ``supervisor_pid``, recorded as the last stack started."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_state(
        run_dir,
        {
            "run_dir": str(run_dir),
            "supervisor": {"pid": supervisor_pid, "start_time": process_start_time(supervisor_pid)},
            "components": [],
        },
    )
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    record_user_config(
        {
            "run_dir": str(run_dir),
            "metadata_url": "http://127.0.0.1:18780",
            "token_file": str(run_dir / "admin-token"),
            "kafka_bootstrap": "127.0.0.1:19092",
        }
    )
    return run_dir


def test_a_live_stack_is_found_from_anywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = _clean_env(tmp_path)
    run_dir = _record_stack(tmp_path, os.getpid(), monkeypatch)  # this process plays the supervisor
    config = Path(env["XDG_CONFIG_HOME"]) / "xinfra" / "stack.json"
    assert config.stat().st_mode & 0o077 == 0
    assert json.loads(config.read_text())["run_dir"] == str(run_dir)
    assert _settings(env, tmp_path) == ["http://127.0.0.1:18780", str(run_dir), "127.0.0.1:19092"]
    # XINFRA_* settings come first.
    explicit = {**env, "XINFRA_METADATA_URL": "http://10.0.0.1:1", "XINFRA_RUN_DIR": "/r"}
    assert _settings(explicit, tmp_path)[:2] == ["http://10.0.0.1:1", "/r"]


def test_a_stopped_stack_is_not_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = _clean_env(tmp_path)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    _record_stack(tmp_path, gone.pid, monkeypatch)
    url, run_dir, _ = _settings(env, tmp_path)
    assert url == "http://127.0.0.1:8780"
    assert run_dir != str(tmp_path / "run")
