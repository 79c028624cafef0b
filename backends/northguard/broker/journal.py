"""The durable log of metadata ops: the seam where a vnode's Raft log will go.

Today one broker owns all metadata, so the journal is a local file: each op
is ``length u32 | crc32c u32 | JSON``, written and fsynced before the op is
applied (an op is decided once it is durable).  A snapshot is the state at one
op's sequence number: ``write_snapshot_file`` writes and fsyncs it to
``snapshot.tmp`` from a worker thread while appends go on (no lock), then
``install_snapshot`` renames it into place and rewrites the log with only the
later ops.  Recovery is snapshot + the log's ops after it: a crash before the
rename leaves the previous snapshot and the whole log (a torn ``snapshot.tmp``
is never read, and the next build replaces it); a crash between the rename and
the log's rewrite replays ops the snapshot holds, which ``MetadataState.apply``
skips by sequence number.

Recovery stops at the first torn or corrupt record and cuts the log there:
such a record was never fsynced completely, so its op was never applied or
answered.  A bad snapshot is a loud stop (``CorruptData``): metadata is not
guessed.
"""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path
from typing import Any

import crc32c
import orjson

from backends.northguard.runtime import File, Runtime
from backends.northguard.store.sync_count import CountingDisk, SyncCount
from xinfra.errors import CorruptData

_RECORD = struct.Struct("<II")
OP_BYTES_MAX = 64 << 20
"""A longer record in the log is a torn or corrupt length, not an op (the largest, a delete of
every sealed segment of a topic, is ~12 B per segment)."""
JOURNAL_OPS_MAX = 10_000
"""Ops in the log before the coordinator writes a snapshot and empties it."""


class FileJournal:
    """Metadata ops in ``<dir>/journal.log`` and the latest snapshot in ``<dir>/snapshot``."""

    def __init__(self, runtime: Runtime, directory: Path) -> None:
        self._runtime = runtime
        self.syncs = SyncCount()  # every fsync it makes (renames' directory syncs included)
        self._disk = CountingDisk(runtime.disk, self.syncs, kind="journal")
        self._dir = directory
        self._log_path = directory / "journal.log"
        self._snapshot_path = directory / "snapshot"
        self._file: File | None = None
        self._size = 0
        self._lock = asyncio.Lock()
        self.ops_since_snapshot = 0
        self.snapshot_bytes = 0  # of the snapshot on disk, once loaded or written

    def load(self) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        """Read the snapshot and the ops after it; cut a torn tail.  Called once, before serving."""
        disk = self._disk
        disk.makedirs(self._dir)
        snapshot = self.read_snapshot()
        self._file = disk.open(self._log_path)
        data = self._file.pread(self._file.size(), 0)
        ops, good = _parse(data)
        if good < len(data):
            self._file.truncate(good)
            self._file.fsync()
        self._size = good
        self.ops_since_snapshot = len(ops)
        return snapshot, ops

    async def append_many(self, ops: list[dict[str, Any]]) -> None:
        """Make every op of ``ops`` durable with one write and one fsync (a group commit)."""
        record = b"".join(_encode(op) for op in ops)
        async with self._lock:
            file = self._file
            assert file is not None, "journal not loaded"
            await self._runtime.run_blocking(_write_sync, file, record, self._size)
            self._size += len(record)
            self.ops_since_snapshot += len(ops)

    def read_snapshot(self) -> dict[str, Any] | None:
        """The snapshot on disk, parsed (for a snapshot built off the event loop from it)."""
        disk = self._disk
        if not disk.exists(self._snapshot_path):
            return None
        file = disk.open(self._snapshot_path, create=False)
        try:
            data = file.pread(file.size(), 0)
        finally:
            file.close()
        records, good = _parse(data, record_bytes_max=len(data))  # one record, the whole file
        if len(records) != 1 or good != len(data):
            raise CorruptData(f"metadata snapshot {self._snapshot_path} is damaged")
        self.snapshot_bytes = len(data)
        return records[0]

    def write_snapshot_file(self, state: dict[str, Any]) -> int:
        """Write ``state`` to ``snapshot.tmp``, synced (blocking; no lock: appends go on); its size."""
        record = _encode(state)
        disk = self._disk
        temporary = self._dir / "snapshot.tmp"
        disk.remove(temporary)
        file = disk.open(temporary)
        try:
            _write_sync(file, record, 0)
        finally:
            file.close()
        return len(record)

    async def install_snapshot(self, upto_seq: int) -> None:
        """Put ``snapshot.tmp`` (the state at ``upto_seq``) in place; keep only the log's later ops.

        Appends wait only for the rename and the rewrite of the ops made while
        the snapshot was built, never for the snapshot's own build or write.
        """
        async with self._lock:
            file = self._file
            assert file is not None, "journal not loaded"
            self._file = await self._runtime.run_blocking(self._install_sync, file, upto_seq)
            self._size = self._file.size()

    async def replace(self, state: dict[str, Any]) -> None:
        """Make ``state`` the whole journal: its snapshot and no ops after it (a metadata copy
        installed from the coordinator, or a coordinator recovered from such a copy)."""
        if self._file is None:
            await self._runtime.run_blocking(self.load)
        await self._runtime.run_blocking(self.write_snapshot_file, state)
        async with self._lock:
            file = self._file
            assert file is not None
            self._file = await self._runtime.run_blocking(
                self._install_sync, file, int(state["applied_seq"]), True
            )
            self._size = self._file.size()

    def _install_sync(self, log_file: File, upto_seq: int, drop_all: bool = False) -> File:
        disk = self._disk
        disk.rename(self._dir / "snapshot.tmp", self._snapshot_path)
        ops, _good = _parse(log_file.pread(self._size, 0))
        later = [] if drop_all else [op for op in ops if int(op["seq"]) > upto_seq]
        temporary = self._dir / "journal.log.tmp"
        disk.remove(temporary)
        new = disk.open(temporary)
        try:
            _write_sync(new, b"".join(_encode(op) for op in later), 0)
        finally:
            new.close()
        disk.rename(temporary, self._log_path)
        log_file.close()
        self.ops_since_snapshot = len(later)
        return disk.open(self._log_path, create=False)

    @property
    def fsyncs(self) -> int:
        """fsync calls that returned since this journal was made: what a restart's recovery costs."""
        return self.syncs.get("journal")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _encode(payload: dict[str, Any]) -> bytes:
    """orjson: a snapshot of 24,576 ranges and segments (9.5 MB) in 0.02 s, against 0.13 s
    with ``json`` (measured), in the thread that shares the GIL with the event loop."""
    body = orjson.dumps(payload)
    return _RECORD.pack(len(body), crc32c.crc32c(body)) + body


def _write_sync(file: File, record: bytes, position: int) -> None:
    file.pwrite(record, position)
    file.fsync()


def _parse(data: bytes, record_bytes_max: int = OP_BYTES_MAX) -> tuple[list[dict[str, Any]], int]:
    """Whole good records from the start and the byte count they span.

    A length over ``record_bytes_max`` ends them like a bad CRC.  A snapshot is one
    record as large as its file: it grows with the metadata (390 B per range
    and segment), and a bound on it would leave a broker with a long history
    unable to start."""
    records: list[dict[str, Any]] = []
    position = 0
    while len(data) - position >= _RECORD.size:
        length, crc = _RECORD.unpack_from(data, position)
        body = data[position + _RECORD.size : position + _RECORD.size + length]
        if length > record_bytes_max or len(body) < length or crc32c.crc32c(body) != crc:
            break
        records.append(orjson.loads(body))
        position += _RECORD.size + length
    return records, position
