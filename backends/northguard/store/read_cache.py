"""The application-level read cache: the most recent durable entries of each segment, bounded in bytes.

Fed by appends as they become durable, so a consume stream reading at the
tail (the common case) is served from memory and never touches the disk.
Each segment caches one contiguous window ``[first_offset, end_offset)`` of
its newest entries; when the cache is over ``bytes_max``, the oldest entries
of the least recently used segment go first.  Reads of older data miss and
go to the segment file; they do not populate the cache, so a reader catching
up on old data, or sealed-segment re-replication, cannot evict the tail
everyone else reads.

Only the event loop touches it: no locking.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from dataclasses import dataclass, field

from backends.northguard.store.base import Entry

ENTRY_OVERHEAD_BYTES = 96  # the Entry object and its list slots, roughly


@dataclass
class _Window:
    entries: list[Entry] = field(default_factory=list)
    bases: list[int] = field(default_factory=list)
    head: int = 0  # entries before it are evicted (compacted lazily)
    bytes: int = 0

    def compact(self) -> None:
        if self.head > 64 and self.head * 2 > len(self.entries):
            del self.entries[: self.head], self.bases[: self.head]
            self.head = 0


class ReadCache:
    def __init__(self, bytes_max: int) -> None:
        assert bytes_max >= 0
        self.bytes_max = bytes_max
        self.bytes = 0
        self._windows: OrderedDict[str, _Window] = OrderedDict()  # least recently used first

    @staticmethod
    def _cost(entry: Entry) -> int:
        return len(entry.batch) + ENTRY_OVERHEAD_BYTES

    def add(self, segment_id: str, entry: Entry) -> None:
        """Append a durable entry; it must follow the segment's cached window (or start a new one)."""
        cost = self._cost(entry)
        if cost > self.bytes_max:
            self.drop(segment_id)  # the window must stay contiguous with the log end
            return
        window = self._windows.get(segment_id)
        if window is None:
            window = self._windows[segment_id] = _Window()
        elif (
            window.head < len(window.entries) and window.entries[-1].end_offset != entry.base_offset
        ):
            self.drop(segment_id)
            window = self._windows[segment_id] = _Window()
        self._windows.move_to_end(segment_id)
        window.entries.append(entry)
        window.bases.append(entry.base_offset)
        window.bytes += cost
        self.bytes += cost
        self._evict()

    def read(self, segment_id: str, offset: int, bytes_max: int) -> list[Entry] | None:
        """Entries from the one holding ``offset``, or ``None`` when the window does not cover it."""
        window = self._windows.get(segment_id)
        if (
            window is None
            or window.head >= len(window.entries)
            or offset < window.bases[window.head]
        ):
            return None
        at = bisect.bisect_right(window.bases, offset, lo=window.head) - 1
        if offset >= window.entries[at].end_offset:  # at or past the cached end
            return None
        self._windows.move_to_end(segment_id)
        result: list[Entry] = []
        total = 0
        for entry in window.entries[at:]:
            if result and total + len(entry.batch) > bytes_max:
                break
            result.append(entry)
            total += len(entry.batch)
        return result

    def truncate(self, segment_id: str, end_offset: int) -> None:
        """Forget cached entries at or past ``end_offset`` (a seal that truncates)."""
        window = self._windows.get(segment_id)
        if window is None:
            return
        while len(window.entries) > window.head and window.entries[-1].end_offset > end_offset:
            entry = window.entries.pop()
            window.bases.pop()
            window.bytes -= self._cost(entry)
            self.bytes -= self._cost(entry)

    def drop(self, segment_id: str) -> None:
        window = self._windows.pop(segment_id, None)
        if window is not None:
            self.bytes -= window.bytes

    def _evict(self) -> None:
        while self.bytes > self.bytes_max:
            segment_id, window = next(iter(self._windows.items()))
            while self.bytes > self.bytes_max and window.head < len(window.entries):
                cost = self._cost(window.entries[window.head])
                window.head += 1
                window.bytes -= cost
                self.bytes -= cost
            if window.head >= len(window.entries):
                del self._windows[segment_id]
            else:
                window.compact()
        assert self.bytes >= 0
