"""Helpers of the Northguard tests, in a module of their own name (``conftest`` is ambiguous on sys.path)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from backends.northguard import protocol
from backends.northguard.backend import NorthguardBackend
from backends.northguard.broker.server import Broker, BrokerConfig
from backends.northguard.launcher import NorthguardProcess
from backends.northguard.protocol import Frame, MsgType
from xinfra.backend import Backend, ShardReader
from xinfra.model import ClusterKind, ConsumedRecord, PhysicalCluster

WAIT_S = 30.0
"""Deadline of every wait on a condition; generous, as the machine is shared."""


def backend_for(address: str, **attributes: str) -> NorthguardBackend:
    return NorthguardBackend(
        PhysicalCluster(
            name="ng-test", kind=ClusterKind.NORTHGUARD, bootstrap=address, attributes=attributes
        )
    )


def broker_metrics(process: NorthguardProcess) -> dict[str, float]:
    """Every sample on a broker process's ``/metrics``, by name with its labels."""
    url = f"http://127.0.0.1:{process.http_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


async def in_process_broker(data_dir: Path, **overrides: Any) -> Broker:
    broker = Broker(BrokerConfig(data_dir=data_dir, port=0, http_port=0, **overrides))
    await broker.start()
    return broker


async def wait_for(
    condition: Callable[[], Awaitable[bool]], what: str, timeout_s: float = WAIT_S
) -> None:
    deadline = time.monotonic() + timeout_s
    while not await condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def read_until(
    reader: ShardReader, count: int, timeout_s: float = WAIT_S
) -> list[ConsumedRecord]:
    records: list[ConsumedRecord] = []
    deadline = time.monotonic() + timeout_s
    while len(records) < count:
        assert time.monotonic() < deadline, f"only {len(records)} of {count} records arrived"
        records += await reader.poll(max_records=count - len(records), timeout_s=0.5)
    return records


class RawClient:
    """A blocking socket speaking raw frames: for malformed input and protocol-level checks."""

    def __init__(self, address: str, timeout_s: float = WAIT_S) -> None:
        host, _, port = address.rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        self.decoder = protocol.FrameDecoder()
        self.frames: list[Frame] = []

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def receive(self) -> Frame | None:
        """The next frame, or None when the broker closed the connection."""
        while not self.frames:
            try:
                data = self.sock.recv(1 << 16)
            except ConnectionResetError:
                return None
            if not data:
                return None
            self.frames += self.decoder.feed(data)
        return self.frames.pop(0)

    def request(self, op: str, **arguments: Any) -> dict[str, Any]:
        self.send(protocol.encode_json(MsgType.REQUEST, 7, {"op": op, **arguments}))
        item = self.receive()
        assert item is not None and item.type is MsgType.RESPONSE, item
        return protocol.decode_json(item.body)[1]

    def close(self) -> None:
        self.sock.close()


@contextlib.contextmanager
def mounted_tmpfs(path: Path, size_bytes: int) -> Iterator[Path]:
    """A tmpfs of ``size_bytes`` at ``path``: a disk that really fills up (ENOSPC), unmounted after.

    Skips the test when the mount is refused (not root, or no mount namespace).
    """
    path.mkdir(parents=True, exist_ok=True)
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill up: {mount.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


async def assert_read_back(
    backend: Backend,
    topic: str,
    shard: int,
    acknowledged: list[tuple[int, bytes]],
    skip: int = 0,
) -> None:
    """Every acknowledged (offset, value) of ``shard`` is read back once, at its offset, and in
    send order: the check after each fault under keyed produce, whose values end in
    ``:<send number>``.  ``skip``: leading records of the shard written by something else."""
    reader = backend.reader(topic)
    reader.assign({shard: 0})
    end = max(offset for offset, _ in acknowledged) + 1
    got = await read_until(reader, end, timeout_s=60)
    await reader.close()
    stored = {record.offset: record.value for record in got}
    assert [r.offset for r in got] == list(range(len(got)))
    for offset, value in acknowledged:
        assert stored[offset] == value, f"acknowledged offset {offset} lost or changed"
    values = [r.value or b"" for r in got[skip:]]
    assert len(values) == len(set(values)), "a record was stored twice"
    numbers = [int(value.split(b":")[1]) for value in values]
    assert numbers == sorted(numbers), "records out of send order"
