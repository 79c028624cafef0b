"""The sparse offset index: where in a segment file an offset's entry starts, and each segment's durable end.

Three kinds of record per segment:

* **points** ``(segment_id, base_offset) -> position``: one every
  ``index_interval_bytes`` of segment file, so a read seeks to the floor
  point and scans at most one interval forward;
* the **end** ``segment_id -> (position, end_offset)``: the logical end of the
  segment file after the last flush whose fsync succeeded.  Recovery trusts
  the file up to this end and rebuilds the rest from the write-ahead log.
* the **meta** ``segment_id -> bytes``: the segment's own metadata (start
  offset, creation time, seal; ``segment_meta``), so creating or sealing
  thousands of segments is one batch and one sync, and a restart reads them
  all in one scan instead of opening a file per segment.

Writes are not synced one by one (RocksDB's own log reaches the OS at each
write, so a killed process loses nothing); ``sync()`` makes them durable
against power loss and is called before any WAL file is deleted, because
until then the WAL can rebuild whatever the index lost.

``RocksOffsetIndex`` is the production one (``rocksdict``, which does its own
file handling: the one piece of the store that does not go through the
runtime's disk).  ``MemoryOffsetIndex`` is a dict for the simulator and tests.
"""

from __future__ import annotations

import abc
import bisect
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from rocksdict import Options, Rdict, ReadOptions, WriteBatch

_U64 = struct.Struct(">Q")
_END = struct.Struct(">QQ")


@dataclass(frozen=True, slots=True)
class IndexPoint:
    segment_id: str
    base_offset: int
    position: int


@dataclass(frozen=True, slots=True)
class SegmentEnd:
    position: int
    end_offset: int


class OffsetIndex(abc.ABC):
    @abc.abstractmethod
    def write(self, points: list[IndexPoint], ends: dict[str, SegmentEnd]) -> None:
        """Add points and replace ends, atomically."""

    @abc.abstractmethod
    def put_metas(self, metas: dict[str, bytes]) -> None:
        """Write segment metadata documents, atomically."""

    @abc.abstractmethod
    def metas(self) -> dict[str, bytes]:
        """Every segment's metadata document (one scan)."""

    @abc.abstractmethod
    def ends(self) -> dict[str, SegmentEnd]:
        """Every recorded end (one scan)."""

    @abc.abstractmethod
    def floor(self, segment_id: str, offset: int) -> IndexPoint | None:
        """The point with the greatest ``base_offset <= offset``."""

    @abc.abstractmethod
    def end(self, segment_id: str) -> SegmentEnd | None: ...

    @abc.abstractmethod
    def truncate(self, segment_id: str, end: SegmentEnd) -> None:
        """Drop the points at or past ``end.end_offset`` and set the end, atomically."""

    @abc.abstractmethod
    def delete_segment(self, segment_id: str) -> None: ...

    @abc.abstractmethod
    def segment_ids(self) -> list[str]:
        """Segments that have an end recorded."""

    @abc.abstractmethod
    def sync(self) -> None:
        """Make every write so far durable."""

    @abc.abstractmethod
    def close(self) -> None: ...


def _check_id(segment_id: str) -> bytes:
    sid = segment_id.encode()
    assert b"\x00" not in sid and b"\x01" not in sid, segment_id
    return sid


def _point_key(sid: bytes, base_offset: int) -> bytes:
    return b"p" + sid + b"\x00" + _U64.pack(base_offset)


class RocksOffsetIndex(OffsetIndex):
    """The index in a RocksDB at ``path`` (created when missing)."""

    def __init__(self, path: Path) -> None:
        options = Options(raw_mode=True)
        options.create_if_missing(True)
        options.set_keep_log_file_num(4)  # RocksDB's info logs: bounded, 4 x 1 MiB
        options.set_max_log_file_size(1 << 20)
        options.set_max_open_files(64)  # its tables' descriptors: bounded, like the segment files
        self._db: Rdict | None = Rdict(str(path), options)

    @property
    def db(self) -> Rdict:
        assert self._db is not None, "offset index used after close"
        return self._db

    def write(self, points: list[IndexPoint], ends: dict[str, SegmentEnd]) -> None:
        batch = WriteBatch(raw_mode=True)
        for point in points:
            batch.put(
                _point_key(_check_id(point.segment_id), point.base_offset),
                _U64.pack(point.position),
            )
        for segment_id, end in ends.items():
            batch.put(b"e" + _check_id(segment_id), _END.pack(end.position, end.end_offset))
        self.db.write(batch)

    def put_metas(self, metas: dict[str, bytes]) -> None:
        batch = WriteBatch(raw_mode=True)
        for segment_id, document in metas.items():
            batch.put(b"m" + _check_id(segment_id), document)
        self.db.write(batch)

    def _scan(self, prefix: bytes) -> dict[str, bytes]:
        """Every record under the one-byte ``prefix``, by segment id.

        RocksDB bounds the scan (``iterate_upper_bound``) and ``items`` yields
        each pair in one call: at 24,576 segments the scan of the metas took
        0.020 s this way, 0.040 s with a call per key, value and step and a
        prefix test in Python (measured).
        """
        bound = ReadOptions()
        bound.set_iterate_upper_bound(bytes([prefix[0] + 1]))
        items = cast(
            "Iterator[tuple[bytes, bytes]]", self.db.items(from_key=prefix, read_opt=bound)
        )
        return {key[1:].decode(): value for key, value in items}  # raw mode: keys are bytes

    def metas(self) -> dict[str, bytes]:
        return self._scan(b"m")

    def ends(self) -> dict[str, SegmentEnd]:
        return {sid: SegmentEnd(*_END.unpack(value)) for sid, value in self._scan(b"e").items()}

    def floor(self, segment_id: str, offset: int) -> IndexPoint | None:
        sid = _check_id(segment_id)
        iterator = self.db.iter()
        iterator.seek_for_prev(_point_key(sid, offset))
        if not iterator.valid():
            return None
        key = iterator.key()
        prefix = b"p" + sid + b"\x00"
        assert isinstance(key, bytes)
        if not key.startswith(prefix) or len(key) != len(prefix) + 8:
            return None
        value = iterator.value()
        assert isinstance(value, bytes)
        (base_offset,) = _U64.unpack(key[len(prefix) :])
        (position,) = _U64.unpack(value)
        return IndexPoint(segment_id, base_offset, position)

    def end(self, segment_id: str) -> SegmentEnd | None:
        value = self.db.get(b"e" + _check_id(segment_id))
        if value is None:
            return None
        assert isinstance(value, bytes)
        position, end_offset = _END.unpack(value)
        return SegmentEnd(position, end_offset)

    def truncate(self, segment_id: str, end: SegmentEnd) -> None:
        sid = _check_id(segment_id)
        batch = WriteBatch(raw_mode=True)
        batch.delete_range(_point_key(sid, end.end_offset), b"p" + sid + b"\x01")
        batch.put(b"e" + sid, _END.pack(end.position, end.end_offset))
        self.db.write(batch)

    def delete_segment(self, segment_id: str) -> None:
        sid = _check_id(segment_id)
        batch = WriteBatch(raw_mode=True)
        batch.delete_range(b"p" + sid + b"\x00", b"p" + sid + b"\x01")
        batch.delete(b"e" + sid)
        batch.delete(b"m" + sid)
        self.db.write(batch)

    def segment_ids(self) -> list[str]:
        ids: list[str] = []
        iterator = self.db.iter()
        iterator.seek(b"e")
        while iterator.valid():
            key = iterator.key()
            assert isinstance(key, bytes)
            if not key.startswith(b"e"):
                break
            ids.append(key[1:].decode())
            iterator.next()
        return ids

    def sync(self) -> None:
        self.db.flush_wal(True)

    def close(self) -> None:
        db, self._db = self._db, None
        if db is not None:
            db.close()  # may raise (its flush on a full disk); the handle is dropped either way


@dataclass
class _MemorySegment:
    # (base_offset, position), sorted; one list so a reader thread never sees half an insert
    points: list[tuple[int, int]] = field(default_factory=list)
    end: SegmentEnd | None = None


class MemoryOffsetIndex(OffsetIndex):
    """The same index in a dict: for the simulator, which keeps the object across a simulated restart."""

    def __init__(self) -> None:
        self._segments: dict[str, _MemorySegment] = {}
        self._metas: dict[str, bytes] = {}

    def put_metas(self, metas: dict[str, bytes]) -> None:
        self._metas.update(metas)

    def metas(self) -> dict[str, bytes]:
        return dict(self._metas)

    def ends(self) -> dict[str, SegmentEnd]:
        return {sid: s.end for sid, s in self._segments.items() if s.end is not None}

    def write(self, points: list[IndexPoint], ends: dict[str, SegmentEnd]) -> None:
        for point in points:
            segment = self._segments.setdefault(point.segment_id, _MemorySegment())
            at = bisect.bisect_left(segment.points, point.base_offset, key=lambda p: p[0])
            if at < len(segment.points) and segment.points[at][0] == point.base_offset:
                segment.points[at] = (point.base_offset, point.position)
            else:
                segment.points.insert(at, (point.base_offset, point.position))
        for segment_id, end in ends.items():
            self._segments.setdefault(segment_id, _MemorySegment()).end = end

    def floor(self, segment_id: str, offset: int) -> IndexPoint | None:
        segment = self._segments.get(segment_id)
        if segment is None:
            return None
        points = segment.points
        at = bisect.bisect_right(points, offset, key=lambda p: p[0]) - 1
        if at < 0:
            return None
        base_offset, position = points[at]
        return IndexPoint(segment_id, base_offset, position)

    def end(self, segment_id: str) -> SegmentEnd | None:
        segment = self._segments.get(segment_id)
        return None if segment is None else segment.end

    def truncate(self, segment_id: str, end: SegmentEnd) -> None:
        segment = self._segments.setdefault(segment_id, _MemorySegment())
        at = bisect.bisect_left(segment.points, end.end_offset, key=lambda p: p[0])
        segment.points = segment.points[:at]
        segment.end = end

    def delete_segment(self, segment_id: str) -> None:
        self._segments.pop(segment_id, None)
        self._metas.pop(segment_id, None)

    def segment_ids(self) -> list[str]:
        return [sid for sid, segment in self._segments.items() if segment.end is not None]

    def sync(self) -> None:
        pass

    def close(self) -> None:
        pass
