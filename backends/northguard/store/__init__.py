"""Segment storage behind one interface (``base.SegmentStore``); the fps store is the primary one.

* ``FpsStore``: WAL + file per segment + sparse RocksDB index + group commit (``fps.py``).
* ``MemoryStore``: the same contract in memory, for unit tests and the simulator.
* ``OffsetIndex`` (``RocksOffsetIndex``, ``MemoryOffsetIndex``): the index seam, so a
  simulated runtime can run an ``FpsStore`` on its own disk with an in-memory index.
"""

from backends.northguard.store.base import Entry, SegmentInfo, SegmentState, SegmentStore
from backends.northguard.store.fps import FpsStore, FpsStoreStats
from backends.northguard.store.memory import MemoryStore
from backends.northguard.store.offset_index import MemoryOffsetIndex, OffsetIndex, RocksOffsetIndex

__all__ = [
    "Entry",
    "FpsStore",
    "FpsStoreStats",
    "MemoryOffsetIndex",
    "MemoryStore",
    "OffsetIndex",
    "RocksOffsetIndex",
    "SegmentInfo",
    "SegmentState",
    "SegmentStore",
]
