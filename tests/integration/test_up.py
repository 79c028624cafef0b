"""`xinfra up` as a user runs it: through a pipe and in a terminal, stopped every way there is.

Each test starts the real ``xinfra up`` (the real brokers and service) and checks by pid
and by command line that nothing it started is left.  Only one test runs the whole stack;
the signal tests run ``--only kafka,northguard`` (the supervisor's code is the same
whatever it supervises, and these two start in about a second).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pty
import queue
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from xinfra.services.ports import free_port, port_open

FAST = ["--only", "kafka,northguard"]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _closed(host: str, port: int) -> bool:
    return not port_open(host, port)


def _listeners(port: int) -> str:
    """Who listens on ``port`` (for a failure message): ``ss`` when installed."""
    try:
        return subprocess.run(
            ["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True, timeout=5
        ).stdout
    except OSError as error:
        return f"(ss: {error})"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone for our purpose once reaped or marked Z.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2] != "Z"
    except OSError:
        return False


def _wait(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _descendants(root: int) -> set[int]:
    """Every live process below ``root`` (by parent pid; children in new sessions included)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = (entry / "stat").read_text()
            parents[int(entry.name)] = int(stat[stat.rindex(")") + 2 :].split()[1])
    found: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return {pid for pid in found if _pid_alive(pid)}


def _processes_mentioning(markers: list[str]) -> list[str]:
    """Command lines of live processes that name any marker (a unique port, the run dir)."""
    hits = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            if any(marker in cmdline for marker in markers) and _pid_alive(int(entry.name)):
                hits.append(f"{entry.name}: {cmdline}")
    return hits


@dataclass
class Stack:
    """One ``xinfra up``: its environment, the ready event, and how to read its output."""

    env: dict[str, str]
    run_dir: Path
    pid: int = 0
    lines: queue.Queue[str] = field(default_factory=queue.Queue)
    ready: dict = field(default_factory=dict)  # type: ignore[type-arg]
    seen: list[str] = field(default_factory=list)
    hang_up: threading.Event = field(default_factory=threading.Event)
    reader: threading.Thread | None = None

    def close_terminal(self, master: int) -> None:
        """Close the terminal as a terminal emulator does: nothing reads it any more."""
        self.hang_up.set()
        if self.reader is not None:
            self.reader.join()
        os.close(master)

    @property
    def markers(self) -> list[str]:
        ports = [
            address.rpartition(":")[2]
            for k in (
                "XINFRA_ZOOKEEPER",
                "XINFRA_KAFKA_BOOTSTRAP",
                "XINFRA_NORTHGUARD_BOOTSTRAP",
                "XINFRA_METADATA_URL",
            )
            for address in self.env[k].split(",")
        ]
        return (
            [f"127.0.0.1:{p}" for p in ports] + [f"--port {p}" for p in ports] + [str(self.run_dir)]
        )

    def next_line(self, timeout_s: float = 120) -> str:
        line = self.lines.get(timeout=timeout_s)
        self.seen.append(line)
        return line

    def wait_for(self, text: str, timeout_s: float = 120) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.next_line(max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise AssertionError(self.story(f"no {text!r} within {timeout_s} s")) from None
            if text in line:
                return line

    def story(self, what: str) -> str:
        """``what``, then what `xinfra up` printed and the end of every component's log: a
        stack that never got ready says why in the failure itself."""
        parts = [what, "`xinfra up` printed:", *self.seen[-40:]]
        for log in sorted((self.run_dir / "logs").glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-15:]
            parts += [f"-- {log.name}:", *tail]
        return "\n".join(parts)

    def wait_ready(self) -> dict:  # type: ignore[type-arg]
        line = self.wait_for('"event": "ready"')
        self.ready = json.loads(line[line.index("{") :])
        for component in self.ready["components"]:
            assert _pid_alive(component["pid"]), component
        return self.ready

    def pids(self) -> set[int]:
        return {c["pid"] for c in self.ready.get("components", []) if c["pid"]} | _descendants(
            self.pid
        )

    def assert_nothing_left(self, pids: set[int]) -> None:
        assert _wait(lambda: not any(_pid_alive(p) for p in pids), 15), [
            p for p in pids if _pid_alive(p)
        ]
        assert _processes_mentioning(self.markers) == []
        for address in (
            self.env["XINFRA_KAFKA_BOOTSTRAP"],
            *self.env["XINFRA_NORTHGUARD_BOOTSTRAP"].split(","),
        ):
            host, _, port = address.rpartition(":")
            closed = functools.partial(_closed, host, int(port))
            assert _wait(closed, 10), f"{address} still answers: {_listeners(int(port))}"


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("XINFRA_")}
    return {
        **env,
        "XDG_CONFIG_HOME": str(tmp_path / "config"),
        "XINFRA_RUN_DIR": str(tmp_path / "run"),
        "XINFRA_ZOOKEEPER": f"127.0.0.1:{free_port()}",
        "XINFRA_KAFKA_BOOTSTRAP": f"127.0.0.1:{free_port()}",
        # The local Northguard cluster: three brokers, the coordinator first.
        "XINFRA_NORTHGUARD_BOOTSTRAP": ",".join(f"127.0.0.1:{free_port()}" for _ in range(3)),
        "XINFRA_NORTHGUARD_HTTP_PORTS": ",".join(str(free_port()) for _ in range(3)),
        "XINFRA_METADATA_URL": f"http://127.0.0.1:{free_port()}",
        "XINFRA_DATABASE_URL": f"sqlite:///{tmp_path / 'metadata.db'}",
    }


def _xinfra(*args: str) -> list[str]:
    return [sys.executable, "-m", "xinfra.cli", *args]


@contextlib.contextmanager
def up_in_pipe(
    tmp_path: Path, *args: str, stderr_reader: bool = True, env: dict[str, str] | None = None
) -> Iterator[tuple[Stack, subprocess.Popen[str]]]:
    """``xinfra up --json`` with stdout and stderr on pipes (as under ``| tee``)."""
    env = env or _env(tmp_path)
    stack = Stack(env, tmp_path / "run")
    process = subprocess.Popen(
        _xinfra("up", "--json", *args),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=tmp_path,
        text=True,
    )
    stack.pid = process.pid
    threading.Thread(
        target=lambda: [stack.lines.put(line) for line in process.stdout],  # type: ignore[union-attr, func-returns-value]
        daemon=True,
    ).start()
    if stderr_reader:
        threading.Thread(target=process.stderr.read, daemon=True).start()  # type: ignore[union-attr]
    try:
        yield stack, process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@contextlib.contextmanager
def up_in_terminal(tmp_path: Path, *args: str) -> Iterator[tuple[Stack, int]]:
    """``xinfra up --json`` as the session leader of a pseudo-terminal: Ctrl-C is the byte
    0x03 typed on it, closing the terminal sends SIGHUP."""
    env = _env(tmp_path)
    stack = Stack(env, tmp_path / "run")
    pid, master = pty.fork()
    if pid == 0:  # the child: exec at once
        os.chdir(tmp_path)
        os.execve(sys.executable, _xinfra("up", "--json", *args), env)
    stack.pid = pid

    def read() -> None:
        buffer = b""
        while not stack.hang_up.is_set():
            # select, not a blocking read: a read in progress would keep the terminal open
            # after the test closes it.
            if not select.select([master], [], [], 0.05)[0]:
                continue
            try:
                chunk = os.read(master, 4096)
            except OSError:
                break
            if not chunk:
                break
            buffer += chunk
            *complete, buffer = buffer.split(b"\n")
            for line in complete:
                text = ANSI.sub("", line.decode(errors="replace")).strip()
                stack.lines.put(text)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    stack.reader = reader
    try:
        yield stack, master
    finally:
        with contextlib.suppress(ChildProcessError, ProcessLookupError):
            if os.waitpid(pid, os.WNOHANG) == (0, 0):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        with contextlib.suppress(OSError):
            os.close(master)


def _exit_code(pid: int, timeout_s: float = 30) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    raise AssertionError(f"xinfra up (pid {pid}) did not exit within {timeout_s} s")


# ---- the whole stack, once --------------------------------------------------------------


def test_whole_stack_status_and_down_from_another_shell(tmp_path: Path) -> None:
    with up_in_pipe(tmp_path) as (stack, process):
        ready = stack.wait_ready()
        components = {c["name"]: c for c in ready["components"]}
        assert {"zookeeper", "kafka"} <= components.keys()
        for component in components.values():
            assert not component["reused"], "fresh ports: nothing may be reused"
            assert Path(component["log"]).is_file()
            assert Path(component["log"]).stat().st_mode & 0o077 == 0, "logs are private"
        env = stack.env
        if "northguard-0" in components:
            # Three brokers, each on its stated client and health ports, its own data directory.
            addresses = env["XINFRA_NORTHGUARD_BOOTSTRAP"].split(",")
            http_ports = env["XINFRA_NORTHGUARD_HTTP_PORTS"].split(",")
            for index in range(3):
                northguard = components[f"northguard-{index}"]
                assert northguard["url"] == addresses[index]
                assert northguard["role"] == ("coordinator" if index == 0 else "member")
                assert northguard["data_dir"] == str(stack.run_dir / "northguard" / str(index))
                assert northguard["health_url"].endswith(f":{http_ports[index]}/health")
                assert httpx.get(northguard["health_url"]).status_code == 200
                assert httpx.get(northguard["metrics_url"]).status_code == 200
            assert len({components[f"northguard-{i}"]["pid"] for i in range(3)}) == 3
        if "metadata-service" in components:
            assert "kafka-local" in ready["clusters"]
            assert ("northguard-local" in ready["clusters"]) == ("northguard-0" in components)
            token = Path(ready["admin_token_file"]).read_text().strip()
            registered = httpx.get(
                f"{env['XINFRA_METADATA_URL']}/v1/clusters",
                headers={"Authorization": f"Bearer {token}"},
            ).json()
            assert {c["name"] for c in registered["clusters"]} == set(ready["clusters"])
            bootstraps = {c["name"]: c["bootstrap"] for c in registered["clusters"]}
            if "northguard-0" in components:  # every broker of the cluster, coordinator first
                assert bootstraps["northguard-local"] == env["XINFRA_NORTHGUARD_BOOTSTRAP"]
            for log in stack.run_dir.joinpath("logs").iterdir():
                assert token not in log.read_text(errors="replace"), f"token in {log}"

        # Another shell, elsewhere, with no XINFRA_* set: it finds the stack by the user config.
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        shell = {k: v for k, v in env.items() if not k.startswith("XINFRA_")}
        status = subprocess.run(
            _xinfra("status", "--json"), env=shell, cwd=elsewhere, capture_output=True, text=True
        )
        assert status.returncode == 0, status.stderr
        report = json.loads(status.stdout)
        assert report["running"] and report["supervisor_pid"] == process.pid
        assert {c["name"]: (c["pid"], c["healthy"]) for c in report["components"]} == {
            name: (c["pid"], True) for name, c in components.items()
        }

        # The same shell finds the service and the token; a wrong token or URL names the setting.
        listed = subprocess.run(
            _xinfra("topics", "list", "--json"),
            env=shell,
            cwd=elsewhere,
            capture_output=True,
            text=True,
        )
        if "metadata-service" in components:
            assert listed.returncode == 0, listed.stderr
            assert json.loads(listed.stdout) == []
            wrong = subprocess.run(
                _xinfra("topics", "list"),
                env={**shell, "XINFRA_TOKEN": "wrong"},
                cwd=elsewhere,
                capture_output=True,
                text=True,
            )
            assert wrong.returncode == 1 and "XINFRA_TOKEN" in wrong.stderr, wrong.stderr
        unreachable = subprocess.run(
            _xinfra("topics", "list"),
            env={**shell, "XINFRA_METADATA_URL": f"http://127.0.0.1:{free_port()}"},
            cwd=elsewhere,
            capture_output=True,
            text=True,
        )
        assert unreachable.returncode == 3, unreachable.stderr
        assert "XINFRA_METADATA_URL" in unreachable.stderr

        # A second stack: same run directory, then another run directory on the same ports.
        again = subprocess.run(
            _xinfra("up"), env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
        )
        assert again.returncode == 1 and "already running" in again.stderr, again.stderr
        other = {**env, "XINFRA_RUN_DIR": str(tmp_path / "other")}
        second = subprocess.run(
            _xinfra("up"), env=other, cwd=tmp_path, capture_output=True, text=True, timeout=60
        )
        assert second.returncode == 1, second.stderr
        assert str(stack.run_dir) in second.stderr and "already listens" in second.stderr

        pids = stack.pids()
        down = subprocess.run(
            _xinfra("down"), env=shell, cwd=elsewhere, capture_output=True, text=True, timeout=90
        )
        assert down.returncode == 0, down.stderr
        assert process.wait(timeout=30) == 0
        assert json.loads(stack.wait_for('"event"'))["event"] == "stopped"
        stack.assert_nothing_left(pids)
        assert not (stack.run_dir / "stack.json").exists()
        gone = subprocess.run(_xinfra("status"), env=shell, cwd=elsewhere, capture_output=True)
        assert gone.returncode == 1


# ---- every way a supervisor stops ---------------------------------------------------------


def test_ctrl_c_in_a_terminal_stops_everything(tmp_path: Path) -> None:
    with up_in_terminal(tmp_path, *FAST) as (stack, master):
        stack.wait_ready()
        pids = stack.pids()
        os.write(master, b"\x03")
        assert _exit_code(stack.pid) == 0
    stack.assert_nothing_left(pids)


def test_closing_the_terminal_stops_everything(tmp_path: Path) -> None:
    with up_in_terminal(tmp_path, *FAST) as (stack, master):
        stack.wait_ready()
        pids = stack.pids()
        stack.close_terminal(master)  # SIGHUP to its session leader
        _exit_code(stack.pid)
    stack.assert_nothing_left(pids)


def test_ctrl_c_during_start_up_stops_at_once(tmp_path: Path) -> None:
    with up_in_terminal(tmp_path, *FAST) as (stack, master):
        stack.wait_for("northguard-0: starting")
        pids = stack.pids()
        os.write(master, b"\x03")
        assert _exit_code(stack.pid, timeout_s=15) == 128 + signal.SIGINT
        assert not any('"event": "ready"' in line for line in stack.seen)
    stack.assert_nothing_left(pids)
    assert not (stack.run_dir / "stack.json").exists()


def test_sigint_with_a_broken_stderr_pipe_still_stops_everything(tmp_path: Path) -> None:
    """``xinfra up 2>&1 | tee log`` and Ctrl-C: tee dies first, every message then hits EPIPE."""
    with up_in_pipe(tmp_path, *FAST, stderr_reader=False) as (stack, process):
        stack.wait_ready()
        pids = stack.pids()
        process.stderr.close()  # type: ignore[union-attr]  # the reader (tee) is gone
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
    stack.assert_nothing_left(pids)


def test_sigterm_stops_everything(tmp_path: Path) -> None:
    with up_in_pipe(tmp_path, *FAST) as (stack, process):
        stack.wait_ready()
        pids = stack.pids()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        assert json.loads(stack.wait_for('"event"'))["event"] == "stopped"
    stack.assert_nothing_left(pids)


def test_sigkill_of_the_supervisor_takes_its_children(tmp_path: Path) -> None:
    with up_in_pipe(tmp_path, *FAST) as (stack, process):
        stack.wait_ready()
        pids = stack.pids()
        process.kill()
        process.wait()
    stack.assert_nothing_left(pids)


def test_a_service_dies_with_the_python_process_that_started_it(tmp_path: Path) -> None:
    port = free_port()
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from xinfra.services.kafka import start_kafka\n"
        f"process = start_kafka(Path({str(tmp_path)!r}), {port})\n"
        "print(process.pid, flush=True)\n"
        "sys.stdin.read()\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    child = int(parent.stdout.readline())  # type: ignore[union-attr]
    assert _pid_alive(child)
    parent.kill()
    parent.wait()
    assert _wait(lambda: not _pid_alive(child), 10)
    assert _wait(lambda: not port_open("127.0.0.1", port), 10), _listeners(port)


# ---- ports that are not free ---------------------------------------------------------------


def test_up_names_a_port_taken_by_something_else(tmp_path: Path) -> None:
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    taken = blocker.getsockname()[1]
    env = {**_env(tmp_path), "XINFRA_KAFKA_BOOTSTRAP": f"127.0.0.1:{taken}"}
    try:
        # Kafka's probe is a TCP connect, so use ZooKeeper's (ruok) on the taken port.
        env["XINFRA_ZOOKEEPER"] = f"127.0.0.1:{taken}"
        result = subprocess.run(
            _xinfra("up", "--only", "zookeeper"),
            capture_output=True,
            env=env,
            cwd=tmp_path,
            text=True,
            timeout=60,
        )
    finally:
        blocker.close()
    assert result.returncode == 1
    assert f"port 127.0.0.1:{taken} is taken" in result.stderr
    assert "zookeeper" in result.stderr


def test_up_names_a_northguard_health_port_taken_by_something_else(tmp_path: Path) -> None:
    env = _env(tmp_path)
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    taken = blocker.getsockname()[1]
    http_ports = env["XINFRA_NORTHGUARD_HTTP_PORTS"].split(",")
    env["XINFRA_NORTHGUARD_HTTP_PORTS"] = ",".join([*http_ports[:2], str(taken)])
    try:
        result = subprocess.run(
            _xinfra("up", "--only", "northguard"),
            capture_output=True,
            env=env,
            cwd=tmp_path,
            text=True,
            timeout=120,
        )
    finally:
        blocker.close()
    assert result.returncode == 1
    said = " ".join(result.stderr.split())
    assert f"northguard-2: port 127.0.0.1:{taken} is taken" in said, result.stderr
    for address in env["XINFRA_NORTHGUARD_BOOTSTRAP"].split(","):  # the first two were stopped
        host, _, port = address.rpartition(":")
        assert _wait(functools.partial(_closed, host, int(port)), 10), address


def test_up_refuses_northguard_settings_that_do_not_fit(tmp_path: Path) -> None:
    env = {**_env(tmp_path), "XINFRA_NORTHGUARD_HTTP_PORTS": str(free_port())}
    result = subprocess.run(
        _xinfra("up", "--only", "northguard"), capture_output=True, env=env, text=True, timeout=60
    )
    assert result.returncode == 1
    said = " ".join(result.stderr.split())
    assert "XINFRA_NORTHGUARD_HTTP_PORTS" in said and "one health port per broker" in said, said
    env = {**_env(tmp_path), "XINFRA_NORTHGUARD_REPLICATION_FACTOR": "4"}
    result = subprocess.run(
        _xinfra("up", "--only", "northguard"), capture_output=True, env=env, text=True, timeout=60
    )
    assert result.returncode == 1
    assert "XINFRA_NORTHGUARD_REPLICATION_FACTOR=4" in " ".join(result.stderr.split())


def test_up_rejects_unknown_components(tmp_path: Path) -> None:
    result = subprocess.run(
        _xinfra("up", "--only", "kafka,nope"), capture_output=True, env=_env(tmp_path), text=True
    )
    assert result.returncode == 2
    assert "nope" in result.stderr


# ---- a restart of the memory-only local Kafka ------------------------------------------------


def _cli(env: dict[str, str], *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        _xinfra(*args), env=env, input=stdin, capture_output=True, text=True, timeout=60
    )


def _drop_physical_topic(bootstrap: str, physical: str) -> None:
    import asyncio

    from xinfra.backend import open_backend
    from xinfra.model import ClusterKind, PhysicalCluster

    async def drop() -> None:
        backend = open_backend(
            PhysicalCluster(name="kafka-local", kind=ClusterKind.KAFKA, bootstrap=bootstrap)
        )
        try:
            await backend.delete_topic(physical)
        finally:
            await backend.close()

    asyncio.run(drop())


def _round_trip(env: dict[str, str], value: str) -> None:
    produced = _cli(env, "produce", "orders", "-q", stdin=f"{value}\n")
    assert produced.returncode == 0, produced.stderr
    # The only record there is: what the lost physical topic held is gone with it.
    consumed = _cli(env, "consume", "orders", "-q", "-n", "1")
    assert consumed.stdout.split() == [value], consumed


def test_lost_kafka_topics_are_repaired_by_reconcile_and_by_a_restart(tmp_path: Path) -> None:
    env = _env(tmp_path)
    only = ["--only", "kafka,metadata-service"]
    with up_in_pipe(tmp_path, *only, env=env) as (stack, process):
        stack.wait_ready()
        created = _cli(
            env, "topics", "create", "orders", "--cluster", "kafka-local", "--shards", "2", "--json"
        )
        assert created.returncode == 0, created.stderr
        physical = json.loads(created.stdout)["epochs"][0]["physical_topic"]
        _round_trip(env, "before")

        _drop_physical_topic(env["XINFRA_KAFKA_BOOTSTRAP"], physical)
        drift = _cli(env, "topics", "reconcile")
        assert drift.returncode == 1
        assert "missing_physical_topic" in drift.stdout
        assert "xinfra topics reconcile --repair" in drift.stderr
        repaired = _cli(env, "topics", "reconcile", "--repair", "--json")
        assert repaired.returncode == 0, repaired.stdout + repaired.stderr
        [item] = json.loads(repaired.stdout)["repaired"]
        assert (item["action"], item["physical_topic"], item["shards"]) == (
            "recreated_physical_topic",
            physical,
            2,
        )
        _round_trip(env, "after-repair")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0

    # The restarted stack's Kafka has no topics at all: up repairs the epoch and says so.
    with up_in_pipe(tmp_path, *only, env=env) as (stack, process):
        ready = stack.wait_ready()
        assert [
            (t["topic"], t["epoch"], t["physical_topic"]) for t in ready["repaired_topics"]
        ] == [("orders", 0, physical)]
        _round_trip(env, "after-restart")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0


# ---- the local Northguard requires credentials ----------------------------------------------


def _unauthenticated_list(bootstrap: str) -> BaseException | None:
    """What the broker answers a connection that presents no credential (None: it served it)."""
    import asyncio

    from xinfra.backend import open_backend
    from xinfra.model import ClusterKind, PhysicalCluster

    async def attempt() -> BaseException | None:
        backend = open_backend(
            PhysicalCluster(name="anonymous", kind=ClusterKind.NORTHGUARD, bootstrap=bootstrap)
        )
        try:
            await backend.list_topics()
        except Exception as error:  # the refusal is what this returns
            return error
        finally:
            await backend.close()
        return None

    return asyncio.run(attempt())


def test_local_northguard_refuses_anonymous_clients_while_the_cli_works(tmp_path: Path) -> None:
    from xinfra.errors import Unauthorized

    env = _env(tmp_path)
    only = ["--only", "northguard,metadata-service"]
    with up_in_pipe(tmp_path, *only, env=env) as (stack, process):
        ready = stack.wait_ready()
        secret_file = Path(ready["northguard_secret_file"])
        assert secret_file.parent == stack.run_dir
        assert secret_file.stat().st_mode & 0o777 == 0o600
        secret = secret_file.read_text()
        assert len(secret.strip()) >= 32
        refused = _unauthenticated_list(env["XINFRA_NORTHGUARD_BOOTSTRAP"])
        assert isinstance(refused, Unauthorized), refused

        created = _cli(env, "topics", "create", "orders", "--cluster", "northguard-local")
        assert created.returncode == 0, created.stderr
        _round_trip(env, "with-credentials")
        for log in stack.run_dir.joinpath("logs").iterdir():
            assert secret.strip() not in log.read_text(errors="replace"), f"secret in {log}"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0

    # The same run directory: the same secret, the broker still closed, the topic still readable.
    with up_in_pipe(tmp_path, *only, env=env) as (stack, process):
        ready = stack.wait_ready()
        assert Path(ready["northguard_secret_file"]).read_text() == secret
        refused = _unauthenticated_list(env["XINFRA_NORTHGUARD_BOOTSTRAP"])
        assert isinstance(refused, Unauthorized), refused
        consumed = _cli(env, "consume", "orders", "-q", "-n", "1")
        assert consumed.stdout.split() == ["with-credentials"], consumed
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0


def test_up_adds_the_secret_to_a_northguard_cluster_registered_without_it(tmp_path: Path) -> None:
    env = _env(tmp_path)
    with up_in_pipe(tmp_path, "--only", "metadata-service", env=env) as (stack, process):
        stack.wait_ready()
        token = (stack.run_dir / "admin-token").read_text().strip()
        registered = httpx.post(  # as an `xinfra up` before credentials did
            f"{env['XINFRA_METADATA_URL']}/v1/clusters",
            params={"check": "false"},
            headers={"Authorization": f"Bearer {token}"},
            json={
                "name": "northguard-local",
                "kind": "northguard",
                "bootstrap": env["XINFRA_NORTHGUARD_BOOTSTRAP"],
            },
        )
        assert registered.status_code == 201, registered.text
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0

    with up_in_pipe(tmp_path, "--only", "northguard,metadata-service", env=env) as (
        stack,
        process,
    ):
        stack.wait_ready()
        cluster = httpx.get(
            f"{env['XINFRA_METADATA_URL']}/v1/clusters/northguard-local",
            headers={"Authorization": f"Bearer {token}"},
        ).json()
        assert cluster["attributes"] == {"northguard.secret": "<redacted>"}
        created = _cli(env, "topics", "create", "orders", "--cluster", "northguard-local")
        assert created.returncode == 0, created.stderr
        _round_trip(env, "re-registered")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0


# ---- the local Northguard is a three-broker cluster, replication factor 3 --------------------


def _cluster_status(env: dict[str, str], run_dir: Path) -> dict:  # type: ignore[type-arg]
    result = _cli(
        env,
        "northguard",
        "status",
        "--bootstrap",
        env["XINFRA_NORTHGUARD_BOOTSTRAP"],
        "--secret-file",
        str(run_dir / "northguard-secret"),
        "--json",
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)  # type: ignore[no-any-return]


def _stack_component(env: dict[str, str], name: str) -> dict:  # type: ignore[type-arg]
    report = json.loads(_cli(env, "status", "--json").stdout)
    [component] = [c for c in report["components"] if c["name"] == name]
    return component  # type: ignore[no-any-return]


def test_northguard_cluster_replicates_and_survives_a_member_sigkill(tmp_path: Path) -> None:
    env = _env(tmp_path)
    with up_in_pipe(tmp_path, "--only", "northguard,metadata-service", env=env) as (
        stack,
        process,
    ):
        ready = stack.wait_ready()
        brokers = {c["name"]: c for c in ready["components"] if c["name"].startswith("northguard")}
        assert sorted(brokers) == ["northguard-0", "northguard-1", "northguard-2"]
        status = _cluster_status(env, stack.run_dir)
        assert status["coordinator"] == "0"
        assert {b["broker_id"]: (b["live"], b["address"]) for b in status["brokers"]} == {
            str(i): (True, address)
            for i, address in enumerate(env["XINFRA_NORTHGUARD_BOOTSTRAP"].split(","))
        }

        created = _cli(env, "topics", "create", "orders", "--cluster", "northguard-local")
        assert created.returncode == 0, created.stderr
        produced = _cli(env, "produce", "orders", "-q", stdin="first\n")
        assert produced.returncode == 0, produced.stderr
        status = _cluster_status(env, stack.run_dir)
        assert status["segments"], status  # the topic's only
        for segment in status["segments"]:  # every segment on all three brokers
            assert sorted(segment["replicas"]) == ["0", "1", "2"], segment
            assert segment["replicas_wanted"] == 3, segment
        assert status["under_replicated_total"] == 0, status
        # The coordinator's metadata journal is copied to both members (an op since they joined).
        assert sorted(status["metadata"]["replicas"]) == ["0", "1", "2"], status["metadata"]

        # SIGKILL a member: the supervisor restarts it, and the stack keeps serving.
        victim = brokers["northguard-1"]["pid"]
        os.kill(victim, signal.SIGKILL)
        assert _wait(
            lambda: (
                _stack_component(env, "northguard-1")["pid"] not in (victim, None)
                and _stack_component(env, "northguard-1")["healthy"]
            ),
            60,
        ), _stack_component(env, "northguard-1")
        assert _wait(
            lambda: all(b["live"] for b in _cluster_status(env, stack.run_dir)["brokers"]), 60
        ), _cluster_status(env, stack.run_dir)
        produced = _cli(env, "produce", "orders", "-q", stdin="second\n")
        assert produced.returncode == 0, produced.stderr
        consumed = _cli(env, "consume", "orders", "-q", "-e")
        assert consumed.returncode == 0, consumed.stderr
        assert consumed.stdout.split() == ["first", "second"], consumed
        # Every segment gets back to three replicas (a sealed one by re-replication).
        assert _wait(
            lambda: (
                (status := _cluster_status(env, stack.run_dir))["under_replicated_total"] == 0
                and all(len(s["replicas"]) == 3 for s in status["segments"])
            ),
            90,
        ), _cluster_status(env, stack.run_dir)
        pids = stack.pids()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    stack.assert_nothing_left(pids)


def test_a_run_dir_of_the_single_broker_stack_keeps_its_northguard_data(tmp_path: Path) -> None:
    """A run directory from before the three-broker cluster: one broker (id 0, not a cluster)
    kept its data in ``northguard/0`` and ``northguard-local`` names its address alone.  The
    cluster's coordinator is broker 0 on that data directory: the records stay readable, and
    once the single broker's active segment rolls (its age limit, short here) it is
    re-replicated onto the two new brokers."""
    import secrets as random_secrets

    from xinfra.services.process import ManagedProcess

    env = _env(tmp_path)
    run_dir = tmp_path / "run"
    coordinator = env["XINFRA_NORTHGUARD_BOOTSTRAP"].split(",")[0]
    host, _, port = coordinator.rpartition(":")
    http_port = env["XINFRA_NORTHGUARD_HTTP_PORTS"].split(",")[0]
    secret_file = run_dir / "northguard-secret"
    run_dir.mkdir()
    fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(random_secrets.token_urlsafe(32) + "\n")
    # The broker as `xinfra up` ran it before this change (same argv).
    old_broker = ManagedProcess(
        "old northguard-0",
        _xinfra(
            "northguard",
            "broker",
            "--id",
            "0",
            "--host",
            host,
            "--port",
            port,
            "--http-port",
            http_port,
            "--data-dir",
            str(run_dir / "northguard" / "0"),
            "--attr",
            "rack=r0",
            "--secret-file",
            str(secret_file),
        ),
        tmp_path / "old-northguard.log",
        coordinator,
        env=env,
    )
    try:
        old_broker.start().wait_ready(lambda: port_open(host, int(port)), timeout_s=60)
        with up_in_pipe(tmp_path, "--only", "metadata-service", env=env) as (stack, process):
            stack.wait_ready()
            token = (run_dir / "admin-token").read_text().strip()
            registered = httpx.post(  # as the single-broker `xinfra up` registered it
                f"{env['XINFRA_METADATA_URL']}/v1/clusters",
                headers={"Authorization": f"Bearer {token}"},
                json={
                    "name": "northguard-local",
                    "kind": "northguard",
                    "bootstrap": coordinator,
                    "attributes": {"northguard.secret": f"file:{secret_file}"},
                },
            )
            assert registered.status_code == 201, registered.text
            created = _cli(
                env, "topics", "create", "orders", "--cluster", "northguard-local", "--shards", "1"
            )
            assert created.returncode == 0, created.stderr
            produced = _cli(env, "produce", "orders", "-q", stdin="old\n")
            assert produced.returncode == 0, produced.stderr
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=30) == 0
    finally:
        old_broker.stop()
    assert not (run_dir / "northguard" / "1").exists()

    cluster_env = {**env, "XINFRA_SEGMENT_AGE_S_MAX": "2"}
    with up_in_pipe(tmp_path, "--only", "northguard,metadata-service", env=cluster_env) as (
        stack,
        process,
    ):
        stack.wait_ready()
        status = _cluster_status(env, run_dir)
        # The single broker's segment (it may already be sealed and re-replicated).
        [old_segment] = [s for s in status["segments"] if s["start_offset"] == 0]
        assert "0" in old_segment["replicas"], old_segment
        consumed = _cli(env, "consume", "orders", "-q", "-e")
        assert consumed.stdout.split() == ["old"], consumed
        produced = _cli(env, "produce", "orders", "-q", stdin="new\n")
        assert produced.returncode == 0, produced.stderr
        consumed = _cli(env, "consume", "orders", "-q", "-e")
        assert consumed.stdout.split() == ["old", "new"], consumed

        def healed() -> bool:
            segments = {s["segment_id"]: s for s in _cluster_status(env, run_dir)["segments"]}
            old = segments.get(old_segment["segment_id"])
            return (
                old is not None
                and old["state"] == "sealed"
                and sorted(old["replicas"]) == ["0", "1", "2"]
            )

        assert _wait(healed, 90), _cluster_status(env, run_dir)
        consumed = _cli(env, "consume", "orders", "-q", "-e")
        assert consumed.stdout.split() == ["old", "new"], consumed
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
