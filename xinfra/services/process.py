"""A child service process: started in its own process group, logged to a file, stopped for sure.

A service that leaves a process behind breaks the next run (its port stays
taken), so ``stop`` escalates from SIGTERM to SIGKILL of the whole process
group and waits for it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path


class ServiceError(RuntimeError):
    """A local service could not be started; the message names its log file."""


@dataclass
class ManagedProcess:
    name: str
    argv: list[str]
    log_path: Path
    url: str
    env: dict[str, str] | None = None
    cwd: Path | None = None
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def start(self) -> ManagedProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        try:
            self.popen = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,
            )
        finally:
            log.close()
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None, f"{self.name} was never started"
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_ready(self, ready: Callable[[], bool], timeout_s: float = 60.0) -> ManagedProcess:
        """Poll ``ready`` until it is true; fail fast with the log tail if the process dies."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise ServiceError(
                    f"{self.name} exited during start-up (see {self.log_path}):\n{self.log_tail()}"
                )
            if ready():
                return self
            time.sleep(0.05)
        self.stop()
        raise ServiceError(
            f"{self.name} not ready after {timeout_s:.0f} s (see {self.log_path}):\n{self.log_tail()}"
        )

    def kill(self) -> None:
        """SIGKILL the process group at once: a crash, for crash tests."""
        self._signal_group(signal.SIGKILL)
        if self.popen is not None:
            self.popen.wait()

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL it if it lingers; idempotent."""
        if self.popen is None:
            return
        if self.popen.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.popen.wait()
        # Children that outlived the leader (a JVM's helpers) go too.
        self._signal_group(signal.SIGKILL)

    def _signal_group(self, signum: int) -> None:
        if self.popen is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signum)


def which_any(candidates: Sequence[str | Path]) -> Path | None:
    for candidate in candidates:
        path = Path(candidate)
        if path.is_file() and os.access(path, os.X_OK):
            return path
    return None
