"""A child service process: started in its own process group, logged to a file, stopped for sure.

A service that leaves a process behind breaks the next run (its port stays
taken), so ``stop`` escalates from SIGTERM to SIGKILL of the whole process
group and waits for it.

Every child also dies with the process that started it, even when that
process is SIGKILLed and never runs ``stop``: the child asks the kernel for a
parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGKILL)``) between fork and
exec.  The kernel sends it when the *thread* that forked the child ends, not
the process, so every child is forked from one spawner thread that lives as
long as the interpreter (a service started from ``asyncio.to_thread`` must not
die when that worker thread is retired).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

PR_SET_PDEATHSIG = 1

READY_POLL_S = 0.01
"""How often ``wait_ready`` asks: a readiness check is a connect or a GET to a local port, nothing
at 100 a second, and at 20 a second every start waited 25 ms on average past its readiness (a
broker's restart, timed to its port answering, fell on 50 ms steps)."""


class ServiceError(RuntimeError):
    """A local service could not be started; the message names its log file."""


def _load_prctl() -> Callable[..., int] | None:
    """libc's prctl, resolved once in the parent (nothing is loaded between fork and exec)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    prctl: Callable[..., int] = libc.prctl
    return prctl


_PRCTL = _load_prctl()


def die_with_parent(parent_pid: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGKILL when its parent (thread) ends.

    If the parent already died between fork and the prctl call the child
    would have no one to watch it, so it exits at once.
    """
    prctl = _PRCTL
    if prctl is None:
        return None

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent_pid:
            os._exit(1)

    return preexec


class _Spawner:
    """One long-lived thread that forks every child (the parent-death signal follows the thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._pid = 0

    def popen(self, argv: list[str], **kwargs: object) -> subprocess.Popen[bytes]:
        with self._lock:
            if self._executor is None or self._pid != os.getpid():  # new, or inherited by fork
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="xinfra-spawner")
                self._pid = os.getpid()
            executor = self._executor
        parent_pid = os.getpid()

        def spawn() -> subprocess.Popen[bytes]:
            popen: subprocess.Popen[bytes] = subprocess.Popen(  # type: ignore[call-overload]
                argv, preexec_fn=die_with_parent(parent_pid), **kwargs
            )
            return popen

        return executor.submit(spawn).result()


_SPAWNER = _Spawner()


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
        # Logs are the owner's only: a service may log addresses, names, paths of secrets.
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.fchmod(fd, 0o600)
        log = os.fdopen(fd, "ab")
        try:
            self.popen = _SPAWNER.popen(
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

    def start_time(self) -> int | None:
        """The kernel's start time of the process (clock ticks since boot): with the pid it names
        this process, not a later one that reused the pid."""
        return process_start_time(self.pid) if self.popen is not None else None

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
        try:
            while time.monotonic() < deadline:
                if not self.alive():
                    raise ServiceError(
                        f"{self.name} exited during start-up (see {self.log_path}):\n"
                        f"{self.log_tail()}"
                    )
                if ready():
                    return self
                time.sleep(READY_POLL_S)
        except BaseException:
            # Interrupted (Ctrl-C during start-up) or failed: the caller never gets this
            # process, so nobody else could stop it.
            self.stop()
            raise
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


def process_start_time(pid: int) -> int | None:
    """Field 22 of ``/proc/<pid>/stat`` (None when the process is gone or a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":
        return None
    return int(fields[19])


def same_process(pid: int, start_time: int | None) -> bool:
    """Whether ``pid`` is still the process that had ``start_time`` (not a reused pid)."""
    current = process_start_time(pid)
    return current is not None and (start_time is None or current == start_time)
