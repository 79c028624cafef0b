"""The write-ahead log: every flush's frames, written and fsynced before any segment file is touched.

Files are ``<data_dir>/wal/<sequence>.wal``, appended with O_DIRECT where the
filesystem grants it (``direct_append``: a group's frames are copied once,
into an aligned buffer, and the last partial block is padded with zeros that
the next group overwrites; a buffered write copied every byte into the page
cache, the WAL's largest cost with 10 KB appends to 512 ranges) and rolled
when the next group would take the current one past ``file_bytes_max``.  A
file is **retired** when a newer one exists.  A flush writes its frames to
the segment files but does not fsync them (the WAL's fsync is what
acknowledges); a **checkpoint** of the store rolls the WAL, fsyncs the
segment files written since the last one and records their ends in the
offset index, and only then removes the files it retired: until then they
are what recovery replays.

Replay stops at the zeros that pad a file's last block (nothing was lost
there) and distinguishes a **torn tail** (the last frame of the last flush
cut by a crash, with nothing but zeros after it; that flush was never
acknowledged, so it is dropped quietly) from **corruption** (a frame whose
CRC fails with something other than zeros after it: data that may have been
acknowledged).  Corruption is logged as an error, the damaged
frame is skipped, and the file is kept as ``<name>.corrupt`` for inspection.
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from backends.northguard.runtime import Disk, File
from backends.northguard.store.direct_append import BLOCK_BYTES, append_direct
from backends.northguard.store.framing import Frame, FrameStatus, decode_frame

log = logging.getLogger(__name__)
SUFFIX = ".wal"


def create_durably(disk: Disk, path: Path) -> None:
    """Create an empty file whose directory entry survives power loss (rename fsyncs the directory)."""
    temporary = path.with_name(path.name + ".tmp")
    handle = disk.open(temporary)
    try:
        handle.truncate(0)
        handle.fsync()
    finally:
        handle.close()
    disk.rename(temporary, path)


@dataclass
class ReplayReport:
    frames: int = 0
    torn_bytes: int = 0
    corrupt_frames: int = 0
    corrupt_files: list[Path] = field(default_factory=list)


class WriteAheadLog:
    def __init__(
        self, disk: Disk, directory: Path, *, file_bytes_max: int, direct: bool = True
    ) -> None:
        """``direct``: ask for O_DIRECT (a file that does not get it is written buffered)."""
        assert file_bytes_max > 0
        self._disk = disk
        self._directory = directory
        self._file_bytes_max = file_bytes_max
        self._direct = direct
        self._tail = b""  # the current file's partial last block, with O_DIRECT
        self._sequence = 0
        self._file: File | None = None
        self._position = 0
        self._retired: list[Path] = []
        self._held: dict[Path, int] = {}  # files before the current one not removed yet: bytes
        self._held_lock = threading.Lock()  # rolls and removals run on worker threads

    def existing(self) -> list[Path]:
        return [
            self._directory / name
            for name in self._disk.listdir(self._directory)
            if name.endswith(SUFFIX)
        ]

    def replay(self, path: Path, report: ReplayReport) -> Iterator[Frame]:
        """The valid frames of one file, in order; torn tails and corruption are logged, never yielded."""
        handle = self._disk.open(path, create=False)
        try:
            data = handle.pread(handle.size(), 0)
        finally:
            handle.close()
        position = 0
        corrupt = False
        while True:
            decoded = decode_frame(data, position)
            if decoded.status is FrameStatus.END:
                break
            if decoded.status is FrameStatus.OK:
                assert decoded.frame is not None
                report.frames += 1
                yield decoded.frame
                position += decoded.frame_bytes
                continue
            # Only zeros after a damaged frame (the end of the file, or a direct write's padding):
            # the last flush's, cut by a crash.
            last = decoded.status is FrameStatus.BAD_BODY and _zeros_from(
                data, position + decoded.frame_bytes
            )
            if decoded.status is FrameStatus.BAD_BODY and not last:
                # The header is intact, so the frame's length is known and the frames after it are readable.
                corrupt = True
                report.corrupt_frames += 1
                assert decoded.frame is not None
                log.error(
                    "WAL %s: CRC mismatch in the frame at byte %d (segment %s, offsets %d..%d); "
                    "skipping it; the file will be kept as %s.corrupt",
                    path, position, decoded.frame.segment_id, decoded.frame.base_offset,
                    decoded.frame.end_offset, path.name,
                )  # fmt: skip
                position += decoded.frame_bytes
                continue
            if _padding(data, position):
                break
            torn = len(data) - position
            # ZERO, TRUNCATED, BAD_HEADER or a bad last frame: the end of what the last flush got to disk.
            report.torn_bytes += torn
            log.warning(
                "WAL %s: %s at byte %d, ignoring the last %d bytes (a flush cut by a crash, never acknowledged)",
                path, decoded.status.value, position, torn,
            )  # fmt: skip
            break
        if corrupt:
            report.corrupt_files.append(path)

    def start(self, sequence: int) -> None:
        """Begin writing to a fresh file numbered ``sequence``; files before it become retired."""
        assert self._file is None
        self._sequence = sequence
        self._open_next()

    def _current_path(self) -> Path:
        return self._directory / f"{self._sequence:016d}{SUFFIX}"

    def _open_next(self) -> None:
        path = self._current_path()
        create_durably(self._disk, path)
        self._file = self._disk.open(path, create=False, direct=self._direct)
        self._position = 0
        self._tail = b""

    def append(self, frames: Sequence[bytes]) -> None:
        """Write and fsync one group's frames (rolling to a new file first when this one is full)."""
        assert self._file is not None, "WAL not started"
        size = sum(len(frame) for frame in frames)
        if self._position > 0 and self._position + size > self._file_bytes_max:
            self.roll()
        if getattr(self._file, "direct", False):
            try:
                self._tail = append_direct(self._file, self._tail, self._position, frames)
            except OSError as error:
                if error.errno != errno.EINVAL:
                    raise
                self._write_buffered(frames, error)
        else:
            self._file.pwrite(b"".join(frames), self._position)
        self._position += size
        self._file.fsync()

    def _write_buffered(self, frames: Sequence[bytes], refusal: OSError) -> None:
        """An aligned write refused (a device with larger logical blocks): this file goes on
        buffered, from the logical end (the zeros of the last padding are overwritten)."""
        assert self._file is not None
        path = self._current_path()
        log.warning("WAL %s: O_DIRECT write refused (%s); using buffered I/O", path, refusal)
        self._file.close()
        self._file = self._disk.open(path, create=False)
        self._tail = b""
        self._file.pwrite(b"".join(frames), self._position)

    def roll(self) -> None:
        assert self._file is not None
        self._file.close()
        path = self._current_path()
        self._retired.append(path)
        self._sequence += 1
        self._file = None
        with self._held_lock:  # one step for a reader: the bytes move, never counted twice or not
            self._held[path] = self._position
            self._position = 0
        self._open_next()

    def next_sequence(self) -> int:
        """One past the highest file number in the directory, kept ``.corrupt`` files included."""
        numbers = [
            int(name.split(".")[0])
            for name in self._disk.listdir(self._directory)
            if name[:1].isdigit()
        ]
        return max(numbers, default=-1) + 1

    def has_retired(self) -> bool:
        return bool(self._retired)

    def take_retired(self) -> list[Path]:
        """The retired files, handed to a checkpoint that removes them once the segments are synced."""
        retired, self._retired = self._retired, []
        return retired

    def remove(self, paths: list[Path]) -> None:
        for path in paths:
            self._disk.remove(path)
            with self._held_lock:
                self._held.pop(path, None)

    @property
    def position(self) -> int:
        """Bytes in the current file."""
        return self._position

    @property
    def held_bytes(self) -> int:
        """Frame bytes no checkpoint has released yet (the current file's, and those of rolled
        files not removed): what a crash now would replay."""
        with self._held_lock:
            return self._position + sum(self._held.values())

    def remove_retired(self) -> None:
        """Call only once the offset index is synced: the retired files are then redundant."""
        self.remove(self._retired)
        self._retired.clear()

    def sync_directory(self) -> None:
        """Make the removals so far durable (the marker's durable creation syncs the directory)."""
        create_durably(self._disk, self._directory / "removed.sync")

    def retire(self, paths: list[Path]) -> None:
        self._retired.extend(paths)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _padding(data: bytes, position: int) -> bool:
    """Whether the bytes from ``position`` on are the zeros that pad a direct write's last block."""
    rest = len(data) - position
    return len(data) % BLOCK_BYTES == 0 and 0 < rest < BLOCK_BYTES and _zeros_from(data, position)


def _zeros_from(data: bytes, position: int) -> bool:
    """Whether every byte from ``position`` to the end is zero (true when none follows)."""
    return data.count(0, position) == len(data) - position
