"""Durable per-segment metadata: a record in the offset index (``pack``), formerly a small JSON
document ``<data_dir>/segments/<segment_id>.meta`` (still read, and moved into the index, at start).

Written whole to ``.meta.tmp``, fsynced, then renamed over the old one (the
rename fsyncs the directory), so a crash leaves either the old or the new
document, never a mix.  Carries what must survive a restart and is not in
the segment file: the start offset, the creation time and the seal (state
plus the end the segment was sealed at, so a seal with truncation is
finished by recovery if it was cut short).
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import asdict, dataclass
from pathlib import Path

from backends.northguard.runtime import Disk
from backends.northguard.store.base import SegmentState
from xinfra.errors import CorruptData, InvalidRequest

META_SUFFIX = ".meta"
SEGMENT_SUFFIX = ".seg"
_SEGMENT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
META_BYTES_MAX = 4096
_PACKED = struct.Struct(">BqqBqq")
_PACKED_VERSION = 1


def check_segment_id(segment_id: str) -> None:
    """Segment ids name files: letters, digits, ``.``, ``_``, ``-``; at most 200 characters."""
    if not _SEGMENT_ID.fullmatch(segment_id):
        raise InvalidRequest(
            f"segment id {segment_id!r} is not valid: use 1-200 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )


@dataclass(frozen=True, slots=True)
class SegmentMeta:
    segment_id: str
    start_offset: int
    state: SegmentState
    created_ms: int
    sealed_end_offset: int | None = None
    sealed_end_position: int | None = None

    def encode(self) -> bytes:
        document = asdict(self)
        document["state"] = self.state.value
        document["version"] = 1
        data = json.dumps(document, sort_keys=True).encode()
        assert len(data) <= META_BYTES_MAX
        return data

    def pack(self) -> bytes:
        """The compact form kept in the offset index (decoded thousands at a time at a restart)."""
        return _PACKED.pack(
            _PACKED_VERSION,
            self.start_offset,
            self.created_ms,
            self.state is SegmentState.SEALED,
            -1 if self.sealed_end_offset is None else self.sealed_end_offset,
            -1 if self.sealed_end_position is None else self.sealed_end_position,
        )

    @classmethod
    def unpack(cls, segment_id: str, data: bytes) -> SegmentMeta:
        try:
            version, start, created, sealed, end_offset, end_position = _PACKED.unpack(data)
            assert version == _PACKED_VERSION
        except (struct.error, AssertionError) as error:
            raise CorruptData(
                f"segment metadata of {segment_id!r} in the offset index is unreadable ({error})"
            ) from error
        return cls(
            segment_id,
            start,
            SegmentState.SEALED if sealed else SegmentState.ACTIVE,
            created,
            None if end_offset < 0 else end_offset,
            None if end_position < 0 else end_position,
        )

    @classmethod
    def decode(cls, data: bytes, path: Path) -> SegmentMeta:
        try:
            document = json.loads(data)
            assert document.pop("version") == 1
            document["state"] = SegmentState(document["state"])
            return cls(**document)
        except (ValueError, TypeError, KeyError, AssertionError) as error:
            raise CorruptData(
                f"segment metadata {path} is unreadable ({error}); restore it or delete the segment"
            ) from error


def write_meta(disk: Disk, directory: Path, meta: SegmentMeta) -> None:
    path = directory / (meta.segment_id + META_SUFFIX)
    temporary = path.with_name(path.name + ".tmp")
    data = meta.encode()
    handle = disk.open(temporary)
    try:
        handle.truncate(0)
        handle.pwrite(data, 0)
        handle.fsync()
    finally:
        handle.close()
    disk.rename(temporary, path)


def read_meta(disk: Disk, path: Path) -> SegmentMeta:
    handle = disk.open(path, create=False)
    try:
        data = handle.pread(META_BYTES_MAX, 0)
    finally:
        handle.close()
    return SegmentMeta.decode(data, path)
