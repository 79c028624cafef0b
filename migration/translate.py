"""Exact translation of positions between a migration's source epoch and its target, pure.

A target record written by a dual write carries the source position it
mirrors (``xinfra.model.mirror_header``).  Readers crossing into the target
use that header one way: they skip the *mirrored prefix*, the target's
records that mirror a source offset below the source's end offset
(``clients.consumer``).  A checkpoint moves by the same header and the same
prefix: a ``MirrorMap`` holds, for one shard, the source offset each prefix
record mirrors, in target order, and answers

* ``to_target(o)``: the target offset from which a reader gets exactly the
  source records ``[o, end)`` (each once, none below ``o``), then what follows
  the prefix; ``None`` when no target offset does.  That happens when ``o`` is
  below the first mirrored offset (the dual writes began later), when a source
  record at or past ``o`` has no mirror (a producer died between its two
  writes), when one is mirrored twice, or when two producers' dual writes
  landed in the target in another order around ``o``.  Such a checkpoint
  stays on the source, where the read-through delivers it exactly.
* ``to_source(t)``: for a rollback, the source offset from which a reader gets
  every record the target reader had not yet read; ``None`` when the target
  order around ``t`` interleaves (no source offset is exact there).

Cost: the map keeps four 8-byte integers per mirrored record of the shard
(the dual-write window) and one bit per source offset while it is built,
bounded by ``MIRRORED_RECORDS_MAX``; it is built once per step, off the data
path.
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field

MIRRORED_RECORDS_MAX = 2_000_000
"""Mirrored records of one shard a map may hold (64 MB); past it the shard's checkpoints
stay on the source (``migration.checkpoints``), where the read-through is exact."""


@dataclass
class MirrorMap:
    """The mirrored prefix of one target shard: source offsets in target order."""

    first_target: int
    """Target offset of the prefix's first record (the shard's first retained offset)."""
    after: int
    """Target offset one past the prefix: the first record a crossing reader delivers."""
    end: int | None
    """The source's end offset (sealed), or None during dual writes (rollback: everything)."""
    targets: array[int] = field(default_factory=lambda: array("q"))
    sources: array[int] = field(default_factory=lambda: array("q"))
    _prefix_max: array[int] = field(default_factory=lambda: array("q"), repr=False)
    _suffix_min: array[int] = field(default_factory=lambda: array("q"), repr=False)
    _distinct_from: int = 0

    @classmethod
    def build(
        cls, first_target: int, after: int, end: int | None, pairs: Iterable[tuple[int, int]]
    ) -> MirrorMap:
        """From (target offset, mirrored source offset) pairs of the prefix, in target order."""
        built = cls(first_target, after, end)
        for target, source in pairs:
            assert not built.targets or target > built.targets[-1], "target offsets ascend"
            assert end is None or source < end, "the prefix mirrors offsets below the end"
            built.targets.append(target)
            built.sources.append(source)
        assert len(built.targets) <= MIRRORED_RECORDS_MAX
        running = -1
        for source in built.sources:
            running = max(running, source)
            built._prefix_max.append(running)
        count = len(built.sources)
        built._suffix_min = array("q", bytes(8 * count))
        base = min(built.sources, default=0)
        seen = bytearray((max(built.sources, default=0) - base) // 8 + 1)  # one bit per offset
        repeated = False
        low = 1 << 62
        for index in range(count - 1, -1, -1):
            source = built.sources[index]
            low = min(low, source)
            built._suffix_min[index] = low
            byte, bit = divmod(source - base, 8)
            if seen[byte] >> bit & 1 and not repeated:
                built._distinct_from, repeated = index + 1, True  # no repeat from here on
            seen[byte] |= 1 << bit
        return built

    def to_target(self, offset: int) -> int | None:
        """The target offset a reader resumes at to get exactly the source records from ``offset``."""
        assert self.end is not None, "forward translation needs the source's end offsets"
        if offset >= self.end:
            return self.after if offset == self.end else None
        index = bisect.bisect_left(self._prefix_max, offset)  # the first record >= offset
        if index == len(self.sources):
            return None  # [offset, end) is not mirrored at all
        exact = (
            self._suffix_min[index] >= offset  # nothing below offset follows
            and index >= self._distinct_from  # nothing is mirrored twice
            and len(self.sources) - index == self.end - offset  # nothing is missing
        )
        return self.targets[index] if exact else None

    def to_source(self, offset: int) -> int | None:
        """The source offset a reader resumes at after reading the target up to ``offset``."""
        index = bisect.bisect_left(self.targets, offset)  # records read: [0, index)
        if not self.sources:
            return None  # nothing mirrored: no source position is known
        if index == 0:
            return self._suffix_min[0]
        if index < len(self.sources) and self._prefix_max[index - 1] > self._suffix_min[index]:
            return None  # a record below one already read is still unread: interleaved
        return self._prefix_max[index - 1] + 1
